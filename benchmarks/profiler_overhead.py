"""Cost of train.profile: llmpipe's loop with the profiler recording every measured step against the
same loop without it, in the same run.

    python benchmarks/profiler_overhead.py [--flavor tiny] [--steps 14] [--repeats 3]

One process (world size 1) on memory-mapped shards, evaluation and checkpoints outside the
measured steps. Profiled runs use wait=0, warmup=2 and active = steps - 2, so every step after the
first two is recorded; the median step time of those steps is compared with the same steps of an
unprofiled run (runs alternate to share the machine's noise). Printed: the ratio profiled /
plain step time (1.00 = free) and the breakdown the profiler reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: runs from a checkout

from llmpipe.train import metrics  # noqa: E402
from llmpipe.train.loop import train  # noqa: E402
from llmpipe.train.profile import PARTS  # noqa: E402
from tests.conftest import make_cfg, make_data_dir  # noqa: E402


def step_time(cfg, data_dir: Path, out: Path, skip: int) -> float:
    train(cfg, data_dir, out)
    recs = [r for r in metrics.read(out / "metrics.jsonl") if "loss" in r]
    return statistics.median(r["step_time_s"] for r in recs[skip:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocab, seq = 4096, 128
        data_dir = make_data_dir(tmp / "data", seq_len=seq, vocab=vocab, n_docs=2000)
        base = {"data": {"seq_len": seq}, "model": {"flavor": a.flavor},
                "train": {"micro_batch_size": 8, "grad_accum_steps": 2, "max_steps": a.steps,
                          "threads_per_proc": a.threads, "log_every": 10 ** 6,
                          "checkpoint": {"every_steps": 10 ** 6}, "eval": {"every_steps": 10 ** 6, "batches": 1}}}
        plain_cfg = make_cfg(tmp, **base)
        prof_cfg = make_cfg(tmp, **{**base, "train": {**base["train"], "profile": {
            "enabled": True, "wait": 0, "warmup": 2, "active": a.steps - 2}}})
        plain, profiled = [], []
        for i in range(a.repeats):
            plain.append(step_time(plain_cfg, data_dir, tmp / f"plain{i}", skip=2))
            profiled.append(step_time(prof_cfg, data_dir, tmp / f"prof{i}", skip=2))
            print(f"repeat {i}: plain {plain[-1] * 1e3:.1f} ms/step, profiled {profiled[-1] * 1e3:.1f} ms/step")
        report = json.loads((tmp / f"prof{a.repeats - 1}" / "profile" / "breakdown_rank0.json").read_text())
    pl, pr = statistics.median(plain), statistics.median(profiled)
    mean = report["mean_ms"]
    print(f"\n| run | step time (median of {a.repeats}) |\n|---|---|\n| plain | {pl * 1e3:.1f} ms |\n"
          f"| profiled | {pr * 1e3:.1f} ms |\n\nratio profiled / plain = {pr / pl:.3f}")
    print("profiled breakdown (mean ms per step, last repeat): step {:.1f} = {}".format(
        mean["step"], " + ".join(f"{k} {mean[k]:.1f}" for k in PARTS)))


if __name__ == "__main__":
    main()
