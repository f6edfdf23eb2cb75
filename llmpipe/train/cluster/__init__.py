"""The train stage on a scheduled cluster (train.launcher slurm or kubernetes).

The scheduler starts one process per node, `python -m llmpipe.train.cluster.node` (node.py), which
writes a marker into the shared run folder, waits until the stage has seen every node's marker (so
every node and the stage see the same folder), then becomes torchrun for that node: the first node
serves the c10d rendezvous at train.master_port. The job description (an sbatch script, a TrainJob /
PyTorchJob / AscendJob manifest) is rendered by a pure function from `Job` (slurm.py, kubernetes.py);
the stage writes it into its folder, submits it, follows it (state, the ranks' output into the stage
log), and cancels it when the stage is interrupted.
"""

from __future__ import annotations

from pathlib import Path

from llmpipe.train.cluster.spec import FOLDER, RECORD, Job, job

__all__ = ["FOLDER", "RECORD", "Job", "check", "describe", "job", "launch", "planned_world"]


def launch(cfg, config_path: Path, data_dir: Path, out: Path, log) -> dict:
    """Submit the train stage's job to train.launcher's scheduler and follow it to its end; what the
    stage records of it (the job's id)."""
    j = job(cfg, config_path, data_dir, out)
    if cfg.train.launcher == "slurm":
        from llmpipe.train.cluster import slurm

        return slurm.launch(cfg, j, out, log)
    from llmpipe.train.cluster import kubernetes

    return kubernetes.launch(cfg, j, out, log)


def check(cfg) -> None:
    """What can be checked before anything trains: the scheduler's client here, and its answer."""
    if cfg.train.launcher == "slurm":
        from llmpipe.train.cluster import slurm

        slurm.check(cfg)
    elif cfg.train.launcher == "kubernetes":
        from llmpipe.train.cluster import kubernetes

        kubernetes.check(cfg)


def planned_world(cfg, world_size: int | None) -> int | None:
    """The world size `llmpipe plan` and `llmpipe dryrun` size for: --world-size, or under a scheduler
    the job's (train.nodes x train.nproc_per_node); a --world-size other than the job's is refused."""
    t = cfg.train
    if t.launcher == "local":
        return world_size
    launched = t.nodes * t.nproc_per_node
    if world_size is not None and world_size != launched:
        from llmpipe.errors import ConfigError

        raise ConfigError(f"--world-size {world_size}, but train.launcher {t.launcher} starts train.nodes {t.nodes} "
                          f"x train.nproc_per_node {t.nproc_per_node} = {launched} processes")
    return launched


def describe(cfg) -> str:
    """The job description the train stage would submit for `cfg` (its paths as they will be; a
    Kubernetes job's name without the per-attempt suffix): the sbatch script or the manifest's YAML."""
    from llmpipe import stages

    run_dir = cfg.run_dir()
    out = stages.partial_dir(run_dir, "train")
    j = job(cfg, out / "config.yaml", stages.stage_dir(run_dir, "prepare_data"), out)
    if cfg.train.launcher == "slurm":
        from llmpipe.train.cluster import slurm

        return slurm.batch_script(j)
    import yaml

    from llmpipe.train.cluster import kubernetes

    return yaml.safe_dump(kubernetes.manifest(j), sort_keys=False)
