"""The train stage: launch torchrun over llmpipe.train.main and collect what it wrote."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import yaml

from llmpipe import console, mfu
from llmpipe import device as dev
from llmpipe.checkpoint import io as ckpt
from llmpipe.stages import StageContext, StageError, StageResult
from llmpipe.train import launch, warm
from llmpipe.train import metrics as metrics_mod
from llmpipe.train.launch import TORCHRUN_LOGS, deepspeed_argv, run_streaming, stderr_log, torchrun_argv, torchrun_env

log = logging.getLogger("llmpipe.train")


def rank_env(cfg) -> dict[str, str]:
    """The environment the train stage launches its ranks with (the device's distributed settings,
    OMP threads per rank, unbuffered output); `llmpipe tune` launches its short runs with it too."""
    env = dict(os.environ)
    env.update(dev.dist_env(cfg.run.device, cfg.train.dist_timeout_s, cfg.train.hccl))
    if cfg.train.hostfile is None:  # torchrun (DeepSpeed's launcher otherwise): on one node, loopback only
        env.update(torchrun_env(cfg.train.nodes))
    env.setdefault("OMP_NUM_THREADS", str(cfg.train.threads_per_proc or
                                          max(1, (os.cpu_count() or 1) // cfg.train.nproc_per_node)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _launch_argv(cfg, config_path: Path, data_dir: Path, out: Path) -> list[str]:
    """torchrun on one node or on train.nodes (c10d rendezvous); DeepSpeed's launcher over a hostfile."""
    t = cfg.train
    listed = launch.hosts(cfg)
    if listed and t.nodes > 1:
        raise StageError(f"train.nodes={t.nodes} with train.hostfile: the hostfile already lists the nodes "
                         "(DeepSpeed's launcher); set one or the other")
    if not listed:
        if t.nodes > 1 and not t.rdzv_endpoint:
            raise StageError(f"train.nodes={t.nodes} needs train.rdzv_endpoint (host:port of node 0)")
        if t.node_rank >= t.nodes:
            raise StageError(f"train.node_rank={t.node_rank} but train.nodes={t.nodes} (0 ... {t.nodes - 1})")
        return torchrun_argv(t.nproc_per_node, config_path, data_dir, out, nnodes=t.nodes, node_rank=t.node_rank,
                             rdzv_endpoint=t.rdzv_endpoint, rdzv_id=cfg.run.name if t.nodes > 1 else None,
                             max_restarts=t.restarts)
    return deepspeed_argv(Path(t.hostfile), t.nproc_per_node, config_path, data_dir, out,
                          master_addr=t.master_addr or listed[0], master_port=t.master_port)


def check_layout(cfg, data_dir: Path) -> None:
    """Validate dp x tp x pp against the world size this launch will have and the model, before any
    process starts: one line naming the numbers (the ranks check again at start)."""
    from llmpipe.models.llama import model_args
    from llmpipe.parallel import mesh
    from llmpipe.parallel.mesh import check_supported

    p = cfg.train.parallel
    nodes = len(launch.hosts(cfg)) or cfg.train.nodes
    world = cfg.train.nproc_per_node * nodes
    vocab = json.loads((Path(data_dir) / "data_meta.json").read_text())["vocab_size"]
    try:
        mesh.validate(p, model_args(cfg.model, vocab_size=vocab), world, cfg.train.micro_batch_size)
        if p.tp > 1 or p.pp > 1:
            check_supported(cfg, dev.precision(dev.resolve(cfg.run.device), cfg.train.precision.dtype))
    except mesh.LayoutError as err:
        raise StageError(f"train.parallel: {err} (world size {world} = nproc_per_node "
                         f"{cfg.train.nproc_per_node} x {nodes} node(s))") from None


def check_data_sizes(cfg, data_dir: Path) -> None:
    """What the benchmark will draw from the validation shard, checked now that prepare_data has written it and
    before training: int8s's calibration windows (benchmark.quantize.calibration_samples) and at least one
    quality sequence (benchmark.quality), each of its length; one line with the numbers (the benchmark checks
    again, for a run whose training was done before)."""
    from llmpipe.data.shards import TokenShard
    from llmpipe.models.llama import model_args

    b = cfg.benchmark
    vocab = json.loads((Path(data_dir) / "data_meta.json").read_text())["vocab_size"]
    max_len = model_args(cfg.model, vocab_size=vocab).max_seq_len
    val = TokenShard(Path(data_dir) / "val.bin")
    quality_len = min(b.quality.seq_len or cfg.data.seq_len, max_len)
    wants = [("benchmark.quality.samples", 1, quality_len, "lower benchmark.quality.seq_len")]
    if "int8s" in b.variants:
        q = b.quantize
        wants.append(("benchmark.quantize.calibration_samples", q.calibration_samples,
                      min(q.calibration_seq_len or b.quality.seq_len or cfg.data.seq_len, max_len),
                      "lower it (or calibration_seq_len), or raise data.val_fraction"))
    for field, n, length, fix in wants:
        available = val.num_samples(length - 1)
        if n > available:
            raise StageError(f"{field}: the benchmark needs {n} validation window(s) of {length} tokens, but the "
                             f"validation shard ({val.n_tokens} tokens) holds {available}; {fix}")


def calibrate_cpu(cfg) -> None:
    """Measure this machine's CPU GEMM peak for MFU once, here, before the ranks start: they find it in
    the artifacts folder's cache instead of each measuring while the others start up."""
    if cfg.train.launcher != "local":  # the ranks run on other machines
        return
    device = dev.resolve(cfg.run.device)
    if device.type != "cpu" or cfg.train.peak_tflops is not None:
        return
    # the ranks' intra-op threads (llmpipe.train.loop._set_threads, with LOCAL_WORLD_SIZE = nproc_per_node)
    threads = cfg.train.threads_per_proc or max(1, (os.cpu_count() or 1) // cfg.train.nproc_per_node)
    mfu.cpu_peak(dev.precision(device, cfg.train.precision.dtype), threads, mfu.calibration_dir(cfg.run.artifacts_dir))


def run(ctx: StageContext) -> StageResult:
    cfg, out = ctx.cfg, ctx.work_dir
    data_dir = ctx.inputs["prepare_data"][0]
    check_layout(cfg, data_dir)
    check_data_sizes(cfg, data_dir)
    calibrate_cpu(cfg)
    config_path = out / "config.yaml"
    tree, warm_start = warm.prepare(ctx)  # an earlier attempt's checkpoint to continue from, if any
    config_path.write_text(yaml.safe_dump(tree, sort_keys=False))
    if cfg.train.launcher == "local":
        job = _launch_local(cfg, config_path, data_dir, out)
    else:  # a scheduler starts the ranks; the stage submits the job, follows it, cancels it if interrupted
        from llmpipe.train import cluster

        job = cluster.launch(cfg, config_path, data_dir, out, log)
    final = ckpt.latest_valid(out / "checkpoints")
    if final is None or ckpt.read_meta(final)["step"] != cfg.train.max_steps:
        raise StageError(f"training ended without a valid checkpoint at step {cfg.train.max_steps} in {out}")
    return StageResult(
        outputs={"checkpoint": final.relative_to(out).as_posix(), "metrics": metrics_mod.METRICS,
                 "model_config": "model_config.json", "summary": "summary.json", "config": "config.yaml"},
        metrics={**_summary_metrics(out), **({"warm_start": warm_start} if warm_start else {}), **job},
    )


def _launch_local(cfg, config_path: Path, data_dir: Path, out: Path) -> dict:
    """torchrun (or DeepSpeed's launcher) from this process, its output streamed into the stage log."""
    argv = _launch_argv(cfg, config_path, data_dir, out)
    log.info("launching: %s", " ".join(argv))
    env, agent_file = rank_env(cfg), None
    if argv[1:3] == ["-m", "torch.distributed.run"]:  # torchrun's own @record: its exit reason
        agent_file = out / TORCHRUN_LOGS / f"agent-error-node{cfg.train.node_rank}.json"
        agent_file.unlink(missing_ok=True)  # a previous attempt's
        env["TORCHELASTIC_ERROR_FILE"] = str(agent_file)
    since = time.time()
    # torchrun's own messages and its 40-line ChildFailedError report go to a file, not the console
    steps = console.StepBar()  # a progress bar on a terminal, from rank 0's step lines

    def on_line(line: str) -> None:
        log.info("%s", line)
        steps.line(line)

    try:
        code, _ = run_streaming(argv, on_line, env=env,
                                stderr_to=out / TORCHRUN_LOGS / stderr_log(cfg.train.node_rank))
    finally:
        steps.close()
    if code != 0:
        raise failure(code, out / TORCHRUN_LOGS, agent_file, since)
    return {}


def _summary_metrics(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    records = metrics_mod.read(out / metrics_mod.METRICS)
    evals = [r for r in records if "val_loss" in r]
    if evals:  # the first eval of the whole run, even when this attempt resumed
        summary["val_loss_start"] = evals[0]["val_loss"]
    return summary


# -- why torchrun failed, from its structured results ------------------------------------------------------
# torchrun gives each rank a folder, <log-dir>/<run>/attempt_<n>/<local rank>/, where main.py writes:
#   error.json, traceback.txt  the rank raised (@record's error file: message, type, rank, sub-second time)
#   sigterm.txt (not empty)    a SIGTERM ended it: torchrun stopping it after a peer failed, or from outside
#   rank.json                  its rank, and "exit" once it left on its own
# A rank with none of these (no error, no SIGTERM, no exit) died from another signal: SIGKILL, the OOM
# killer, a crash. Such a death (or a SIGTERM before any error) may well pass on a retry, which resumes
# from the newest checkpoint; an exception in a rank will not. torchrun's agent, under @record too, writes
# agent_file only for its own failure (a rendezvous that failed): its first failing rank is picked with
# one-second timestamps, so the ranks' own files decide here.
_AGENT_TRANSIENT = ("SignalException", "RendezvousClosedError", "RendezvousTimeoutError",
                    "RendezvousConnectionError", "DistNetworkError", "DistStoreError")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ranks(logs: Path, since: float) -> list[dict]:
    """What each rank of this launch's final attempts left: rank, state (raised/terminated/killed/exited), time."""
    out = []
    for run in logs.glob("*/"):  # one per torchrun agent (several nodes may share a machine's log folder)
        attempts = [a for a in run.glob("attempt_*") if a.stat().st_mtime >= since - 1]
        if not attempts:
            continue
        final = max(attempts, key=lambda a: int(a.name.rpartition("_")[2]))
        for folder in sorted(d for d in final.iterdir() if d.is_dir()):
            mark = _read_json(folder / "rank.json") or {}
            error = _read_json(folder / "error.json")
            sigterm = folder / "sigterm.txt"
            rank = mark.get("rank", f"(local {folder.name})")
            if error and "rank" in error.get("message", {}).get("extraInfo", {}):
                info = error["message"]["extraInfo"]
                out.append({**info, "state": "raised", "file": folder / "traceback.txt"})
            elif "exit" in mark:  # it finished on its own (a SIGTERM during teardown changes nothing)
                out.append({"rank": rank, "state": "exited", "time": float("inf")})
            elif sigterm.is_file() and sigterm.stat().st_size:
                out.append({"rank": rank, "state": "terminated", "time": sigterm.stat().st_mtime})
            else:
                out.append({"rank": rank, "state": "killed", "time": -1.0})
    return sorted(out, key=lambda r: r["time"])


def _describe(err: dict) -> str:
    if err["user_error"]:  # a config/data mistake or a diverged run: its own clear message
        return f"rank {err['rank']}: {err['error']} (traceback: {err['file']})"
    return f"rank {err['rank']} raised {err['type']}: {err['error']} (traceback: {err['file']})"


def failure(code: int, logs: Path, agent_file: Path | None, since: float) -> StageError:
    """One line for a failed launch: the first failing rank with its exception and traceback file, or
    the signal it died from; transient (worth a retry) when a rank died from a signal, not when it raised."""
    head = f"training failed: torchrun exited with {code}"
    ranks = _ranks(logs, since)
    agent = _read_json(agent_file) if agent_file is not None else None
    agent_msg = ""
    if agent and isinstance(agent.get("message"), (str, dict)) and "errorCode" not in agent["message"]:
        msg = agent["message"] if isinstance(agent["message"], str) else agent["message"].get("message", "")
        agent_msg = msg.splitlines()[0] if msg else "no message"  # torchrun's own failure, not a rank's
    raised = [r for r in ranks if r["state"] == "raised"]
    then = f"; then {_describe(raised[0])}" if raised else ""
    killed = [str(r["rank"]) for r in ranks if r["state"] == "killed"]
    if killed:
        return StageError(f"{head}: rank {', '.join(killed)} died from a signal without an error file (SIGKILL, "
                          f"the OOM killer or a crash; torchrun-logs: {logs}){then}", transient=True)
    if ranks and ranks[0]["state"] == "terminated":
        return StageError(f"{head}: rank {ranks[0]['rank']} was stopped by SIGTERM{then}", transient=True)
    # torchrun itself failed: its rendezvous lost (another node gone), a signal to the agent
    lost = agent_msg.split(":")[0] in _AGENT_TRANSIENT
    if raised:
        return StageError(f"{head}: {_describe(raised[0])}" + (f"; torchrun: {agent_msg}" if agent_msg else ""),
                          transient=lost)
    if agent_msg:
        return StageError(f"{head}: torchrun: {agent_msg}", transient=lost)
    return StageError(f"{head}: no rank left an error file (torchrun-logs: {logs})", transient=code < 0)
