"""One node of a scheduled training job: `python -m llmpipe.train.cluster.node ...` (the scheduler
starts it once per node).

It finds its node rank and the first node's address in the scheduler's environment, writes its marker
into the shared run folder, waits for the stage's go (the stage saw every node's marker), then execs
torchrun for this node (llmpipe.train.launch.torchrun_argv): the first node serves the rendezvous.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmpipe.train.cluster import spec
from llmpipe.train.launch import TORCHRUN_LOGS, stderr_log, torchrun_argv, torchrun_env

# The scheduler's own variables for the node's rank and the first node's address: Slurm's; Kubeflow's
# torchrun variables (Trainer v2 sets PET_*, the training operator's PyTorchJob MASTER_ADDR and RANK,
# its replica index); MindCluster's ascend-operator (MASTER_ADDR, MASTER_PORT, RANK: the pod's rank).
_JOB_ID = {"slurm": "SLURM_JOB_ID"}


def _first_slurm_host() -> str:
    """The job's first node (where the rendezvous is): scontrol expands the node list."""
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return hosts[0]


def where(scheduler: str, port: int) -> tuple[int, str, int]:
    """(this node's rank, the first node's address, the rendezvous port) from the scheduler's environment
    (an operator's port, when it sets one, is the one its service exposes)."""
    env = os.environ
    if scheduler == "slurm":
        return int(env["SLURM_NODEID"]), _first_slurm_host(), port
    rank = env.get("PET_NODE_RANK") or env.get("RANK") or "0"
    addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or "localhost"
    return int(rank), addr, int(env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or port)


def _wait_for_go(folder: Path, job_id: str, node: int, wait_s: float) -> None:
    spec.marker(folder, job_id, node).parent.mkdir(parents=True, exist_ok=True)
    spec.marker(folder, job_id, node).write_text(f"{socket.gethostname()} {time.time()}\n")
    deadline = time.monotonic() + wait_s
    go = spec.go_file(folder, job_id)
    while not go.is_file():
        if time.monotonic() > deadline:
            sys.exit(f"llmpipe node {node}: no go from the stage in {folder} within {wait_s:.0f} s (it sees every "
                     "node's marker there only when the folder is shared)")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="llmpipe.train.cluster.node")
    p.add_argument("--scheduler", choices=("slurm", "kubeflow", "ascend"), required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--wait-s", type=float, default=600)
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--job-id", help="default: the scheduler's (SLURM_JOB_ID)")
    a = p.parse_args(argv)
    job_id = a.job_id or os.environ[_JOB_ID[a.scheduler]]
    node, first, port = where(a.scheduler, a.port)
    out = Path(a.out)
    _wait_for_go(out / spec.FOLDER, job_id, node, a.wait_s)
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")  # a requeued job meets under a fresh id
    cmd = torchrun_argv(a.nproc_per_node, Path(a.config), Path(a.data), out, python=sys.executable,
                        nnodes=a.nodes, node_rank=node, rdzv_endpoint=f"{first}:{port}",
                        rdzv_id=f"{job_id}-{restart}")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(torchrun_env(a.nodes))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.nproc_per_node)))
    env["TORCHELASTIC_ERROR_FILE"] = str(out / TORCHRUN_LOGS / f"agent-error-node{node}.json")
    print(f"llmpipe node {node}/{a.nodes} on {socket.gethostname()}: {' '.join(cmd)}", flush=True)
    # torchrun's own messages go to a file per node, as on one machine; the ranks' stdout stays the job's
    err = out / TORCHRUN_LOGS / stderr_log(node)
    err.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
