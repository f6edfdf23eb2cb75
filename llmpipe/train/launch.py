"""Build the torchrun command (a pure function) and run it in its own process group.

The command is what a user would type by hand; the runner streams its output line by line to a
callback (the Prefect log, or stdout) and kills the whole process group on timeout, cancellation
or an exception in the caller, so no rank outlives the stage.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from llmpipe.errors import ConfigError, StageError

TORCHRUN_LOGS = "torchrun-logs"  # under the train stage's folder
RENDEZVOUS = "rendezvous.filestore"  # in TORCHRUN_LOGS: one node's rendezvous, a file instead of a socket
LOOPBACK = "127.0.0.1"  # where one node's ranks meet (MASTER_ADDR)


def stderr_log(node_rank: int = 0) -> str:
    """The file in TORCHRUN_LOGS that takes torchrun's stderr (its own messages, its ChildFailedError
    report, and the ranks' stderr) when the train stage launches it: the console keeps the ranks'
    progress (stdout) and the stage's one error line."""
    return f"stderr-node{node_rank}.log"


# NOTE: a TCPStore server listens on every interface (:: dual-stack, else 0.0.0.0) whatever host it is
# given, in torch 2.13 (pytorch/pytorch#173909), and torchrun has no flag for its bind address:
# --standalone's rendezvous store on "localhost:0" and the store its agent shares with the ranks were
# reachable from the network. On one node nothing needs the network, so nothing listens beyond loopback:
#   - the rendezvous is a FileStore in TORCHRUN_LOGS (store_type=file: no socket); torchrun keeps a
#     finished launch's state in it, closed, under the launch's rdzv id, so each launch takes a fresh
#     id; every heartbeat appends ~1 KB to the file and nobody watches them on one node: one an hour;
#   - torchrun_env() stops the agent from serving the ranks a TCPStore of its own;
#   - --local-addr makes the ranks' MASTER_ADDR 127.0.0.1, where rank 0 serves their store from a
#     socket it bound to loopback itself (llmpipe.train.main._attempt_store, TCPStore's master_listen_fd).
# Several nodes meet at node 0's c10d store over the network: that one listens on every interface.
def torchrun_env(nnodes: int = 1) -> dict[str, str]:
    """Environment for torchrun beside its argv (see the note above)."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if nnodes == 1 else {}


def hosts(cfg) -> list[str]:
    """The hostfile's hosts, or [] on one node (no hostfile); how the launcher and the pre-flight read it."""
    if cfg.train.hostfile is None:
        return []
    hostfile = Path(cfg.train.hostfile)
    hosts = [ln.split()[0] for ln in hostfile.read_text().splitlines() if ln.strip() and not ln.startswith("#")] \
        if hostfile.is_file() else []
    if not hosts:
        raise StageError(f"train.hostfile: {hostfile} is missing or lists no hosts ('host slots=N' per line)")
    return hosts


MAX_HOSTFILE_BYTES = 1 << 20  # a line per node: 4096 nodes take ~100 KB


def hostfile_nodes(cfg) -> int:
    """Hosts in train.hostfile, read as the launcher reads it; ConfigError naming it when it cannot be."""
    path = Path(cfg.train.hostfile)
    try:
        if path.is_file() and path.stat().st_size > MAX_HOSTFILE_BYTES:  # it is read whole
            raise ConfigError(f"train.hostfile: {path} is over {MAX_HOSTFILE_BYTES >> 20} MiB, not a hostfile")
        return len(hosts(cfg))
    except StageError as err:
        raise ConfigError(str(err)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"train.hostfile: {path} is not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"train.hostfile: {path}: {(err.strerror or str(err)).lower()}") from None


def launch_world(cfg) -> tuple[int, int] | None:
    """(world size, nodes) of the train stage's launch: nproc_per_node x train.nodes under torchrun,
    x the hostfile's hosts under DeepSpeed's launcher; None when the hostfile cannot be read here
    (`check_launch` refuses that before a run trains; a fingerprint or `--only benchmark` on another
    machine needs none)."""
    if cfg.train.hostfile is None:
        return cfg.train.nproc_per_node * cfg.train.nodes, cfg.train.nodes
    try:
        nodes = hostfile_nodes(cfg)
    except ConfigError:
        return None
    return cfg.train.nproc_per_node * nodes, nodes



def torchrun_argv(nproc_per_node: int, config_path: Path, data_dir: Path, out_dir: Path,
                  python: str = sys.executable, nnodes: int = 1, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None, max_restarts: int = 0) -> list[str]:
    """argv for `torchrun` (as `python -m torch.distributed.run`) running llmpipe.train.main.

    One node: a rendezvous in a file and the ranks' store on 127.0.0.1 (run it with torchrun_env());
    `rdzv_id` defaults to a fresh one per launch, as --standalone's. Several: every node runs this
    same command with its own `node_rank`, meeting at `rdzv_endpoint` (host:port of a c10d store that
    node 0's agent serves) under `rdzv_id` (default "llmpipe").
    `max_restarts`: times torchrun restarts all of its ranks in place after one fails (they resume
    from the newest checkpoint).
    """
    argv = [python, "-m", "torch.distributed.run"]
    logs = Path(out_dir) / TORCHRUN_LOGS
    if nnodes == 1:
        argv += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={logs / RENDEZVOUS}",
                 "--rdzv-conf=store_type=file,keep_alive_interval=3600",
                 f"--rdzv-id={rdzv_id or uuid.uuid4().hex[:12]}", f"--local-addr={LOOPBACK}"]
    else:
        if not rdzv_endpoint:
            raise ValueError(f"{nnodes} nodes need a rendezvous endpoint (host:port)")
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'llmpipe'}"]
    # --monitor-interval=1: notice a dead rank within a second and stop the others (default 5 s).
    # --log-dir: torchrun's per-attempt folder (rank error files) kept with the run as evidence,
    # instead of a /tmp/torchelastic_* folder per run that nothing ever removes.
    argv += [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}", "--monitor-interval=1",
             f"--log-dir={logs}", "-m", "llmpipe.train.main",
             "--config", str(config_path), "--data", str(data_dir),
             "--out", str(out_dir)]
    return argv


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the parent thread dies.

    NOTE: the child runs in its own session (so we can kill its whole group), which also means a
    SIGKILLed parent (a cancelled flow run, a killed CLI) would orphan it; PR_SET_PDEATHSIG closes
    that hole, and torchrun forwards SIGTERM to its ranks.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def deepspeed_argv(hostfile: Path, nproc_per_node: int, config_path: Path, data_dir: Path, out_dir: Path,
                   master_addr: str, master_port: int = 29500, launcher: str = "deepspeed") -> list[str]:
    """argv for DeepSpeed's multi-node launcher: it reads `hostfile` ("host slots=N" lines), starts
    llmpipe.train.main on every host over ssh/pdsh with RANK/LOCAL_RANK/WORLD_SIZE set."""
    return [launcher, f"--hostfile={hostfile}", f"--num_gpus={nproc_per_node}", f"--master_addr={master_addr}",
            f"--master_port={master_port}", "--module", "llmpipe.train.main",
            "--config", str(config_path), "--data", str(data_dir), "--out", str(out_dir)]


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            # Children of a dead torchrun may linger in the group: make sure they are gone too.
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


def run_streaming(argv: Sequence[str], on_line: Callable[[str], None], env: Mapping[str, str] | None = None,
                  timeout_s: float | None = None, tail: int = 40,
                  stderr_to: Path | None = None) -> tuple[int, list[str]]:
    """Run argv (no shell) in a new session; feed each output line to `on_line`.

    stderr goes with stdout, or, given `stderr_to`, is appended to that file (created with its folder).
    Returns (exit code, the last `tail` lines). Kills the process group on timeout or when the
    caller is interrupted (KeyboardInterrupt, task cancellation), then re-raises.
    """
    err = subprocess.STDOUT
    if stderr_to is not None:
        Path(stderr_to).parent.mkdir(parents=True, exist_ok=True)
        err = open(stderr_to, "ab")  # noqa: SIM115 (the child holds it; closed below once it is started)
        err.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {' '.join(argv)}\n".encode())
        err.flush()
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=err, text=True,
                                env=dict(env) if env is not None else None, start_new_session=True, bufsize=1,
                                preexec_fn=_die_with_parent if _LIBC is not None else None)
    finally:
        if stderr_to is not None:
            err.close()
    last: deque[str] = deque(maxlen=tail)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            last.append(line)
            on_line(line)
            if deadline and time.monotonic() > deadline:
                raise TimeoutError(f"exceeded {timeout_s:.0f}s")
        code = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    _kill_group(proc, grace_s=2.0)  # stray grandchildren, if any
    return code, list(last)
