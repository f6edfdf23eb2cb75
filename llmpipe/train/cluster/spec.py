"""What every scheduler's job is rendered from (Job, built purely from the config) and the stage's side
of the shared-folder check (Gate) and of following the job's output (Tail)."""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmpipe import device as dev
from llmpipe.errors import StageError

FOLDER = "cluster"  # in the train stage's folder: the job description, the job's record, the markers
RECORD = "job.json"  # the submitted job: scheduler, id, description file
MARKERS = "markers"  # every node's "I see this folder" file, per job
NODE_MODULE = "llmpipe.train.cluster.node"


def go_file(folder: Path, job_id: str) -> Path:
    """Written by the stage once every node's marker is there: the nodes start training."""
    return Path(folder) / MARKERS / f"go-{job_id}"


def marker(folder: Path, job_id: str, node: int) -> Path:
    return Path(folder) / MARKERS / f"node{node}-{job_id}"


@dataclass(frozen=True)
class Job:
    """What a job description is rendered from: the config's launch settings and the paths as the
    nodes see them. Built by `job()`; the renderers are pure functions of it."""

    name: str  # the job's name: run.name made a DNS-1123 label (Kubernetes needs one)
    nodes: int
    nproc_per_node: int
    devices_per_node: int  # 0 on CPU
    accelerator: str
    port: int  # the rendezvous on the first node
    python: str
    config: str  # paths on the nodes
    data: str
    out: str
    env: dict[str, str] = field(default_factory=dict)  # every rank's: the device's, then train.cluster.env
    wait_s: int = 600  # how long a node waits for the stage's go
    cluster: object = None  # train.cluster (ClusterSection): the scheduler's own settings

    @property
    def world(self) -> int:
        return self.nodes * self.nproc_per_node


def job_name(run_name: str) -> str:
    """run.name as a DNS-1123 label (lower case, digits, '-'; at most 63), prefixed llmpipe-."""
    label = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    return f"llmpipe-{label}"[:63].rstrip("-")


def on_nodes(cfg, path: Path) -> str:
    """`path` (under run.artifacts_dir) as the nodes see it: train.cluster.shared_dir in place of
    run.artifacts_dir, or the same path."""
    shared = cfg.train.cluster.shared_dir
    if shared is None:
        return str(path)
    root = Path(cfg.run.artifacts_dir).resolve()
    rel = Path(path).resolve().relative_to(root)
    return str(Path(shared) / rel)


def rank_env(cfg) -> dict[str, str]:
    """The environment every rank gets from the job (not this machine's): the accelerator's collective
    settings (llmpipe.device), OMP threads when set, unbuffered output, then train.cluster.env."""
    t = cfg.train
    env = dev.cluster_env(t.cluster.accelerator, t.dist_timeout_s, t.hccl)
    if t.threads_per_proc:
        env["OMP_NUM_THREADS"] = str(t.threads_per_proc)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(t.cluster.env)
    return env


def job(cfg, config_path: Path, data_dir: Path, out: Path, python: str | None = None) -> Job:
    """The Job of the train stage writing into `out` (pure: the config and these paths)."""
    t, c = cfg.train, cfg.train.cluster
    default_python = sys.executable if t.launcher == "slurm" else "python"
    return Job(name=job_name(cfg.run.name), nodes=t.nodes, nproc_per_node=t.nproc_per_node,
               devices_per_node=0 if c.accelerator == "cpu" else t.nproc_per_node * c.devices_per_proc,
               accelerator=c.accelerator, port=t.master_port, python=python or c.python or default_python,
               config=on_nodes(cfg, config_path), data=on_nodes(cfg, data_dir), out=on_nodes(cfg, out),
               env=rank_env(cfg), wait_s=c.marker_timeout_s, cluster=c)


def node_argv(j: Job, scheduler: str, job_id: str | None = None) -> list[str]:
    """What the scheduler starts once on every node (node.py). `scheduler`: where the node finds its
    rank and the first node's address (slurm, kubeflow, ascend)."""
    argv = [j.python, "-m", NODE_MODULE, "--scheduler", scheduler, "--nodes", str(j.nodes),
            "--nproc-per-node", str(j.nproc_per_node), "--port", str(j.port), "--wait-s", str(j.wait_s),
            "--config", j.config, "--data", j.data, "--out", j.out]
    return argv + (["--job-id", job_id] if job_id else [])


def missing_markers(folder: Path, job_id: str, nodes: int) -> list[int]:
    return [n for n in range(nodes) if not marker(folder, job_id, n).is_file()]


class Gate:
    """The stage's side of the shared-folder check: once the job runs, every node's marker must appear
    within `timeout_s`; then the go file lets the nodes train. `check()` returns a StageError to raise
    (after cancelling the job) when the time is up."""

    def __init__(self, folder: Path, job_id: str, nodes: int, timeout_s: float, shown: str):
        self.folder, self.job_id, self.nodes, self.timeout_s, self.shown = folder, job_id, nodes, timeout_s, shown
        self.since: float | None = None
        self.open = go_file(folder, job_id).is_file()

    def check(self, running: bool, log) -> StageError | None:
        if self.open or not running:
            return None
        self.since = self.since or time.monotonic()
        missing = missing_markers(self.folder, self.job_id, self.nodes)
        if not missing:
            go = go_file(self.folder, self.job_id)
            go.write_text(f"{time.time()}\n")
            self.open = True
            log.info("all %d node(s) of job %s see %s: training starts", self.nodes, self.job_id, self.shown)
            return None
        if time.monotonic() - self.since > self.timeout_s:
            return StageError(f"train.cluster.shared_dir: node(s) {', '.join(map(str, missing))} of {self.nodes} "
                              f"wrote no marker into {self.shown} within {self.timeout_s:.0f} s: the artifacts "
                              "folder is not shared with every node (set train.cluster.shared_dir to its path on "
                              "the nodes)")
        return None


class Tail:
    """Follows a growing text file (the job's output) from where it left off, whole lines only."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = Path(path), 0, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(1 << 20)  # bounded per poll; the rest comes next time
        except OSError:
            return []
        self.offset += len(chunk)
        *whole, self.rest = (self.rest + chunk).split(b"\n")
        return [w.decode(errors="replace") for w in whole]


def write_description(out: Path, name: str, text: str) -> Path:
    folder = Path(out) / FOLDER
    (folder / MARKERS).mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


