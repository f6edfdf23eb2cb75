"""train.compile against eager: training tokens/s of the train stage's loop, same model, batch and data,
in the same run, and the time spent compiling.

    python benchmarks/compile.py [--flavors tiny,small] [--steps 12] [--repeats 2] [--threads N]

Each run is one torchrun rank (fp32, CPU here) training `--steps` steps; tokens/s is the summary's
steady-state figure (the first step, which compiles, is left out), compile time is what
torch._dynamo recorded (forward and backward graphs, and the no-grad graph of the first evaluation).
Eager and compiled runs take turns so a busy spell of a shared machine falls on both; the ratio of
medians is printed. The first compiled run of a flavor compiles cold; later ones may find
inductor's on-disk cache (their compile time is shorter, their step time is the same).
Goal (issue 15): compiled / eager >= 1.10 on the small flavor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import make_cfg, make_data_dir, torchrun  # noqa: E402


def one(root: Path, data: Path, flavor: str, compiled: bool, steps: int, threads: int, seq: int, tag: str) -> dict:
    out = root / f"{flavor}-{'compiled' if compiled else 'eager'}-{tag}"
    cfg = make_cfg(out, data={"seq_len": seq}, model={"flavor": flavor},
                   train={"micro_batch_size": 8, "max_steps": steps, "threads_per_proc": threads, "compile": compiled,
                          "log_every": 10 ** 6, "checkpoint": {"every_steps": 10 ** 6},
                          "eval": {"every_steps": 10 ** 6, "batches": 1}})
    code, text = torchrun(cfg, data, out, nproc=1)
    if code != 0:
        raise SystemExit(f"{out.name} failed:\n{text[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"tok_s": summary["tokens_per_s"], "compile_s": summary.get("compile_time_s") or 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", default="tiny,small")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_data_dir(root / "data", seq_len=a.seq, vocab=4096, n_docs=2000)
        for flavor in a.flavors.split(","):
            eager, comp = [], []
            for i in range(a.repeats):
                eager.append(one(root, data, flavor, False, a.steps, a.threads, a.seq, str(i)))
                comp.append(one(root, data, flavor, True, a.steps, a.threads, a.seq, str(i)))
                print(f"{flavor} repeat {i}: eager {eager[-1]['tok_s']:.0f} tok/s, compiled {comp[-1]['tok_s']:.0f} "
                      f"tok/s (compiling took {comp[-1]['compile_s']:.1f} s)", flush=True)
            e = statistics.median(r["tok_s"] for r in eager)
            c = statistics.median(r["tok_s"] for r in comp)
            rows.append((flavor, e, c, comp[0]["compile_s"], comp[-1]["compile_s"]))
    print(f"\ntrain.compile vs eager: 1 rank, fp32, {a.threads} threads, micro-batch 8 x seq {a.seq}, "
          f"{a.steps} steps (first left out), median of {a.repeats}")
    print("| flavor | eager tok/s | compiled tok/s | compiled / eager | compile s (cold) | compile s (cached) |")
    print("|---|---|---|---|---|---|")
    for flavor, e, c, cold, warm in rows:
        print(f"| {flavor} | {e:.0f} | {c:.0f} | {c / e:.3f} | {cold:.1f} | {warm:.1f} |")
    print("goal: >= 1.10 on small")


if __name__ == "__main__":
    main()
