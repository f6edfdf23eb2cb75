"""What verifying inputs costs a rerun: llmpipe's digest-cached sha256 checks vs the previous
release's policy, measured in the same run.

    python benchmarks/verify_cost.py [--gib 1.0] [--run-dir artifacts/tiny]

1. One stage folder with a GIB-sized output (random bytes, so no file-system shortcut):
     size-only      presence and size (what inputs got before: no content check)
     cold sha256    a full read and hash (what happens once after any write to the file)
     cached         stat fields matched against .verified.json (every later rerun)
2. The skip checks of a finished pipeline's rerun, all six stages, as run_stage does them:
     previous       each stage's own outputs hashed in full every rerun, its inputs size-only
     llmpipe        each stage's own outputs and its inputs verified in full through the cache
   over --run-dir (a finished run) or, without one, a small run made here with `llmpipe stage`
   (about a minute: 10 training steps of the tiny demo model on one process).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# NOTE: lets `python benchmarks/verify_cost.py` run from a checkout without installing llmpipe.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmpipe import config as config_mod  # noqa: E402
from llmpipe import stages  # noqa: E402
from llmpipe.manifest import Manifest, file_entry  # noqa: E402

QUICK = ["train.max_steps=10", "train.checkpoint.every_steps=5", "train.eval.every_steps=5",
         "train.eval.batches=2", "data.max_files=60", "benchmark.iters=2", "benchmark.warmup=0",
         "benchmark.shapes=[[1,32]]", "export.parity_shapes=[[1,16]]", "train.schedule.warmup_steps=2",
         "train.nproc_per_node=1"]


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _drop_cache(path: Path) -> None:
    """Ask the kernel to forget the file's pages, so a cold hash reads from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def big_output(gib: float, root: Path) -> list[tuple[str, float]]:
    folder = root / "01_big"
    folder.mkdir()
    chunk = os.urandom(64 << 20)
    with open(folder / "data.bin", "wb") as f:
        for _ in range(max(1, round(gib * 16))):
            f.write(chunk)
    manifest = Manifest(stage="big", status="completed", fingerprint="f",
                        outputs={"data": file_entry(folder, "data.bin")})
    _drop_cache(folder / "data.bin")
    cold = _best(lambda: manifest.verify(folder, rehash=True), repeat=1)
    hot = _best(lambda: manifest.verify(folder, rehash=True))
    manifest.verify(folder)  # fills the cache
    return [("size-only", _best(lambda: manifest.verify(folder, full=False))),
            ("cold sha256 (page cache dropped)", cold), ("sha256 (file in page cache)", hot),
            ("cached", _best(lambda: manifest.verify(folder)))]


def make_run(root: Path) -> config_mod.RunConfig:
    overrides = [*QUICK, f"run.artifacts_dir={root}", "run.name=verify"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in stages.SPECS:
        argv = [sys.executable, "-m", "llmpipe.cli", "stage", name, str(ROOT / "configs/tiny.yaml")]
        for o in overrides:
            argv += ["--set", o]
        subprocess.run(argv, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return config_mod.load(ROOT / "configs/tiny.yaml", overrides)


def previous_policy(cfg: config_mod.RunConfig) -> None:
    run_dir = cfg.run_dir()
    for name, spec in stages.SPECS.items():
        Manifest.read(stages.stage_dir(run_dir, name)).verify(stages.stage_dir(run_dir, name), rehash=True)
        for dep in spec.inputs:
            Manifest.read(stages.stage_dir(run_dir, dep)).verify(stages.stage_dir(run_dir, dep), full=False)


def current_policy(cfg: config_mod.RunConfig) -> None:
    fps = stages.fingerprints(cfg)
    for name, spec in stages.SPECS.items():
        assert stages.state(cfg, name, fps[name])[0] == "done", name
        for dep in spec.inputs:
            stages.state(cfg, dep, fps[dep], full=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the large output (GiB)")
    p.add_argument("--run-dir", type=Path, help="a finished run folder (artifacts/<run>); default: make one")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "artifacts") as tmp:
        rows = big_output(args.gib, Path(tmp))
        print(f"\nVerifying one {args.gib:g} GiB output (best of 3)\n")
        print(f"{'check':<34} {'seconds':>9} {'GB/s':>7}")
        for name, s in rows:
            gbs = f"{args.gib * 1.074 / s:7.2f}" if "sha256" in name else ""
            print(f"{name:<34} {s:9.4f} {gbs}")
        cached = dict(rows)["cached"]
        print(f"time a rerun adds for this output: {cached * 1e3:.2f} ms cached, "
              f"{dict(rows)['cold sha256 (page cache dropped)']:.2f} s after the file changed")

    with tempfile.TemporaryDirectory(dir=ROOT / "artifacts") as tmp:
        if args.run_dir:
            run_dir = args.run_dir.resolve()
            cfg = config_mod.load(ROOT / "configs/tiny.yaml",
                                  [f"run.artifacts_dir={run_dir.parent}", f"run.name={run_dir.name}"])
            cfg = config_mod.from_dict(Manifest.read(stages.stage_dir(run_dir, "benchmark")).config)
        else:
            cfg = make_run(Path(tmp))
        size = sum(e["bytes"] for s in stages.SPECS
                   for e in Manifest.read(stages.stage_dir(cfg.run_dir(), s)).outputs.values())
        current_policy(cfg)  # warm: the cache is filled at publish; this also checks every stage is done
        prev, cur = _best(lambda: previous_policy(cfg)), _best(lambda: current_policy(cfg))
        print(f"\nSkip checks of a finished pipeline's rerun ({size / 1e6:.1f} MB of outputs, best of 3)\n")
        print(f"{'policy':<52} {'seconds':>9}")
        print(f"{'previous (own outputs hashed, inputs size-only)':<52} {prev:9.4f}")
        print(f"{'llmpipe (own outputs and inputs, sha256 via cache)':<52} {cur:9.4f}")
        print(f"ratio llmpipe / previous: {cur / prev:.2f}x (goal <= 1.2x)")


if __name__ == "__main__":
    main()
