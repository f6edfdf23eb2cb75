"""Slurm: the sbatch script (a pure function of the Job), its submission, following and cancelling.

One `srun` step starts llmpipe.train.cluster.node once per node (--ntasks-per-node=1), which becomes
torchrun with that node's rank; the first node serves the rendezvous. `sbatch --requeue`: a preempted
or requeued job runs the script again, and the ranks resume from the newest checkpoint that verifies.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from llmpipe import device as dev
from llmpipe.errors import ConfigError, StageError
from llmpipe.train.cluster import spec
from llmpipe.train.cluster.spec import Job

SCRIPT = "job.sbatch"
OUTPUT = "slurm-%j.out"  # sbatch's output pattern, in the cluster folder
# States after which the job will not run again (squeue/scontrol's JobState); PREEMPTED and NODE_FAIL
# jobs with --requeue come back as PENDING, so they are followed on.
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED", "SPECIAL_EXIT"}
_TIMEOUT_S = 60  # for one call of a Slurm client


def sbatch_options(j: Job) -> list[str]:
    """The #SBATCH options: nodes, one task per node, the devices, output, requeue, partition/time/account."""
    c = j.cluster
    opts = [f"--job-name={j.name}", f"--nodes={j.nodes}", "--ntasks-per-node=1", "--exclusive",
            f"--output={Path(j.out) / spec.FOLDER / OUTPUT}", "--open-mode=append",
            "--requeue" if c.requeue else "--no-requeue"]
    gres = dev.slurm_gres(j.accelerator)
    if gres and j.devices_per_node:
        opts.append(f"--gres={gres}:{j.devices_per_node}")
    for flag, value in (("partition", c.partition), ("time", c.time), ("account", c.account)):
        if value is not None:
            opts.append(f"--{flag}={value}")
    return opts


def srun_argv(j: Job) -> list[str]:
    """The one step: every node starts the node entry (which becomes torchrun); a node that fails ends the job."""
    return ["srun", f"--nodes={j.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            *spec.node_argv(j, "slurm")]


def batch_script(j: Job) -> str:
    """The sbatch script: options, the ranks' environment, the one srun step. Shell-quoted throughout."""
    lines = ["#!/bin/bash", f"# llmpipe: {j.nodes} node(s) x {j.nproc_per_node} process(es) = world {j.world}; "
             f"rendezvous on the first node, port {j.port}"]
    lines += [f"#SBATCH {shlex.quote(o)}" for o in sbatch_options(j)]
    lines += ["set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(j.env.items())]
    lines += ["exec " + shlex.join(srun_argv(j)), ""]
    return "\n".join(lines)


def submit_argv(script: Path) -> list[str]:
    return ["sbatch", "--parsable", str(script)]


def _client(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise StageError(f"train.launcher=slurm: {argv[0]} failed: {err}", transient=True) from None
    if check and res.returncode != 0:
        raise StageError(f"train.launcher=slurm: {shlex.join(argv)}: {_first_line(res.stderr or res.stdout)}")
    return res


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "no message"


def check(cfg) -> None:
    """Before anything trains: sbatch on PATH, the controller answering, the partition existing."""
    missing = [t for t in ("sbatch", "squeue", "scancel", "sinfo") if shutil.which(t) is None]
    if missing:
        raise ConfigError(f"train.launcher: slurm, but {missing[0]} is not on PATH (run on a Slurm login node)")
    res = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=_TIMEOUT_S)
    if res.returncode != 0:
        raise ConfigError(f"train.launcher: slurm, but sinfo failed: {_first_line(res.stderr or res.stdout)}")
    partitions = [p.rstrip("*") for p in res.stdout.split()]
    wanted = cfg.train.cluster.partition
    if wanted is not None and wanted not in partitions:
        raise ConfigError(f"train.cluster.partition: {wanted!r} is not a partition of this cluster "
                          f"(sinfo: {', '.join(partitions) or 'none'})")


def state(job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) of the job: squeue while it is queued or running, scontrol after."""
    res = _client(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
    if res.returncode == 0 and res.stdout.strip():
        return res.stdout.split()[0], ""
    res = _client(["scontrol", "show", "job", job_id, "-o"], check=False)
    fields = dict(w.split("=", 1) for w in res.stdout.split() if "=" in w)
    if "JobState" in fields:
        return fields["JobState"], fields.get("ExitCode", "")
    res = _client(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], check=False)
    if res.returncode == 0 and res.stdout.strip():
        st, _, code = res.stdout.splitlines()[0].partition("|")
        return st.split()[0], code
    return "UNKNOWN", ""


def cancel(job_id: str, wait_s: float = 60) -> None:
    """scancel the job and wait until squeue no longer lists it."""
    _client(["scancel", job_id], check=False)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        res = _client(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
        if res.returncode != 0 or not res.stdout.strip():
            return
        time.sleep(0.5)


def _still_queued(out: Path) -> str | None:
    """The job an earlier attempt of this stage submitted into the same folder, if Slurm still has it
    queued or running (the stage was killed without cancelling it): followed, never submitted twice."""
    try:
        record = json.loads((out / spec.FOLDER / spec.RECORD).read_text())
    except (OSError, ValueError):
        return None
    job_id = str(record.get("job_id", "")) if record.get("scheduler") == "slurm" else ""
    if not job_id.isdigit():
        return None
    st, _ = state(job_id)
    return job_id if st not in DONE and st != "UNKNOWN" else None


def launch(cfg, j: Job, out: Path, log) -> dict:
    """Write the script, submit it (or take up the job an earlier attempt left running), follow the job
    to its end (its output into `log`), cancel it when interrupted. Returns what the stage records: the
    job id and the times it was requeued."""
    script = spec.write_description(out, SCRIPT, batch_script(j))
    job_id = _still_queued(out)
    try:  # from here on, an interrupt cancels the job (the id is known once sbatch returns)
        if job_id is not None:
            log.info("following Slurm job %s, submitted by an earlier attempt and still queued", job_id)
        else:
            job_id = _submit(script, out)
            log.info("submitted Slurm job %s (%s)", job_id, script)
        return _follow(cfg, j, job_id, out, log)
    except BaseException:
        if job_id is not None:
            log.info("cancelling Slurm job %s", job_id)
            cancel(job_id)
        raise


def _submit(script: Path, out: Path) -> str:
    """sbatch the script; the job id, also written into the stage's record."""
    res = _client(submit_argv(script), check=False)
    if res.returncode != 0:
        raise StageError(f"train.launcher=slurm: sbatch refused the job: {_first_line(res.stderr or res.stdout)}")
    job_id = res.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    (out / spec.FOLDER / spec.RECORD).write_text(json.dumps(
        {"scheduler": "slurm", "job_id": job_id, "script": SCRIPT, "submitted_at": time.time()}) + "\n")
    return job_id


def _follow(cfg, j: Job, job_id: str, out: Path, log) -> dict:
    folder = out / spec.FOLDER
    tail = spec.Tail(folder / OUTPUT.replace("%j", job_id))
    gate = spec.Gate(folder, job_id, j.nodes, j.wait_s, j.out)
    runs, last = 0, ""
    while True:
        st, code = state(job_id)
        for line in tail.lines():
            log.info("%s", line)
        if st == "RUNNING" and last != "RUNNING":
            runs += 1
            if runs > 1:
                log.info("Slurm job %s runs again (requeued): the ranks resume from the newest checkpoint", job_id)
        if st != last:
            log.info("Slurm job %s: %s", job_id, st)
            last = st
        err = gate.check(st == "RUNNING", log)
        if err is not None:
            cancel(job_id)
            raise err
        if st in DONE and not (st == "PREEMPTED" and j.cluster.requeue):  # requeued: it comes back
            for line in tail.lines():
                log.info("%s", line)
            if not gate.open:  # it ended before every node reported: did its output even reach this folder?
                raise StageError(f"Slurm job {job_id} ended {st} (exit {code or '?'}) before node(s) "
                                 f"{', '.join(map(str, spec.missing_markers(folder, job_id, j.nodes)))} wrote a "
                                 f"marker into {j.out}; its output {tail.path} is "
                                 + ("there" if tail.path.is_file() else "not in this folder: the artifacts folder is "
                                    "not shared with every node (train.cluster.shared_dir)"))
            if st != "COMPLETED":
                raise StageError(f"Slurm job {job_id} ended {st} (exit {code or '?'}); its output: "
                                 f"{tail.path}", transient=st in ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL"))
            return {"slurm_job": job_id, "requeued": max(0, runs - 1)}
        time.sleep(cfg.train.cluster.poll_s)
