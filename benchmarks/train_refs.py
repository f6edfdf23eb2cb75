"""Training tokens/s of this checkout against another git revision, on the same prepared data, in
alternating runs (so machine drift hits both alike).

    python benchmarks/train_refs.py [--ref d1d0288] [--runs 3] [--steps 40] [--nproc 2]

The other revision is checked out into a temporary git worktree and run with PYTHONPATH pointing at
it; both train configs/tiny.yaml's model (train.max_steps = --steps, no checkpoints but the last)
under torchrun exactly as the train stage launches it. Reported: each run's steady tokens/s (the
train summary's mean, first step excluded) and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _train(tree: Path, config: Path, data: Path, out: Path, nproc: int) -> float:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
            "-m", "llmpipe.train.main", "--config", str(config), "--data", str(data), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training in {tree} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())["tokens_per_s"]


def main() -> None:
    import yaml

    from llmpipe import config as config_mod
    from llmpipe import stages

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default="d1d0288", help="the other revision (default: before the one-builder change)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        other = tmp / "other"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), a.ref], check=True,
                       capture_output=True)
        try:
            overrides = [f"run.artifacts_dir={tmp / 'artifacts'}", f"train.max_steps={a.steps}",
                         f"train.nproc_per_node={a.nproc}", f"train.checkpoint.every_steps={a.steps}",
                         f"train.eval.every_steps={a.steps}", "train.eval.batches=1"]
            cfg = config_mod.load(ROOT / "configs" / "tiny.yaml", overrides)
            stages.run_stage("prepare_data", cfg)
            data = stages.stage_dir(cfg.run_dir(), "prepare_data")
            # the config as written, not resolved: each revision fills in its own defaults (an older one
            # refuses fields added since)
            tree = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
            for assignment in overrides:
                config_mod.apply_override(tree, assignment)
            config = tmp / "config.yaml"
            config.write_text(yaml.safe_dump(tree))
            rows: dict[str, list[float]] = {"this checkout": [], a.ref: []}
            for i in range(a.runs):
                for name, tree in (("this checkout", ROOT), (a.ref, other)):
                    rows[name].append(_train(tree, config, data, tmp / f"{name[:4]}-{i}", a.nproc))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], capture_output=True)
    print(f"\ntiny model, {a.steps} steps on {a.nproc} ranks, tokens/s per run (alternating)\n")
    for name, vals in rows.items():
        print(f"{name:<16}" + "".join(f"{v:>10.0f}" for v in vals) + f"   median {statistics.median(vals):.0f}")
    ratio = statistics.median(rows["this checkout"]) / statistics.median(rows[a.ref])
    print(f"\nratio this checkout / {a.ref}: {ratio:.3f}")


if __name__ == "__main__":
    main()
