"""DDP communication hooks on 2 gloo ranks, the demo model and data: bytes each rank all-reduces per
step, step time and the loss reached, each against uncompressed DDP in the same run.

    python benchmarks/comm_hooks.py [--steps 200] [--hooks none,fp16,bf16,powersgd@15,...] [--rank 4] [--start S]

A PowerSGD entry may carry its own rank and start, `powersgd:RANK@START`, for a sweep in one run
(the default runs powersgd@15, powersgd@50 and powersgd:8@15 beside none, fp16 and bf16); plain
`powersgd` takes --rank and --start (default: the config's start_powersgd_iter, torch's 1000, which a 200-step
run never reaches).

The demo config (configs/tiny.yaml: ~5M parameters, DDP on 2 ranks, global batch 32 x 128 tokens)
trains `--steps` steps once per hook (prepare_data once, shared). Bytes are what each rank hands to
the all-reduce (counted in the hook; llmpipe.parallel.comm_hooks), averaged over the steps after
PowerSGD's start; step time is the median of the same steps; the loss is the mean training loss of
the last 10 steps and the final validation loss. Goals (issue 15): loss within 2% of uncompressed for
fp16/bf16, within 5% for PowerSGD rank 4. On 2 CPU ranks sharing 2 cores, communication is a memory
copy through gloo, so compression saves little time here: the bytes column is what carries to a
network, the step-time column is only this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmpipe import config as config_mod  # noqa: E402
from llmpipe import stages  # noqa: E402
from llmpipe.train import metrics  # noqa: E402
from tests.conftest import torchrun  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hooks", default="none,fp16,bf16,powersgd@15,powersgd@50,powersgd:8@15")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (default 4)")
    p.add_argument("--start", type=int, default=None,
                   help="PowerSGD's start_powersgd_iter for a plain `powersgd` entry (default: the config's)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = [f"run.artifacts_dir={root / 'artifacts'}", "run.name=bench-hooks", f"train.max_steps={a.steps}",
                "train.checkpoint.every_steps=100000", f"train.eval.every_steps={a.steps}", "train.log_every=100000"]
        cfg = config_mod.load(ROOT / "configs" / "tiny.yaml", base)
        stages.run_stage("prepare_data", cfg)
        data = stages.stage_dir(cfg.run_dir(), "prepare_data")
        rows = {}
        for entry in a.hooks.split(","):
            hook, rank, start = _entry(entry, a.rank, a.start)
            h = config_mod.load(ROOT / "configs" / "tiny.yaml", base + [
                f"train.parallel.comm_hook={hook}", f"train.parallel.powersgd_rank={rank}"]
                + ([f"train.parallel.start_powersgd_iter={start}"] if start is not None else []))
            start = h.train.parallel.start_powersgd_iter if hook == "powersgd" else None
            out = root / entry.replace(":", "-").replace("@", "-")
            code, text = torchrun(h, data, out, nproc=h.train.nproc_per_node)
            if code != 0:
                raise SystemExit(f"{hook} failed:\n{text[-3000:]}")
            recs = [r for r in metrics.read(out / "metrics.jsonl") if "loss" in r]
            steady = recs[start or 0:]
            summary = json.loads((out / "summary.json").read_text())
            name = f"powersgd (rank {rank}, from step {start})" if hook == "powersgd" else hook
            rows[name] = {"bytes": statistics.mean(r["comm_bytes"] for r in steady),
                          "step_s": statistics.median(r["step_time_s"] for r in steady),
                          "loss": statistics.mean(r["loss"] for r in recs[-10:]), "val": summary["val_loss"]}
            r = rows[name]
            print(f"{name}: {r['bytes'] / 1e6:.3f} MB/step, {r['step_s'] * 1e3:.1f} ms/step, loss {r['loss']:.4f}, "
                  f"val {r['val']:.4f}", flush=True)
    ref = rows.get("none")
    print(f"\ncomm hooks: configs/tiny.yaml, DDP on 2 gloo ranks (CPU), {a.steps} steps; bytes and step time "
          "per rank over the steps after PowerSGD's start (all steps for the others)")
    print("| hook | MB all-reduced / step | bytes / none | step ms | step time / none | loss (last 10) | "
          "loss / none | val loss | val / none |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hook, r in rows.items():
        def rel(k: str, r: dict = r) -> str:
            return f"{r[k] / ref[k]:.3f}" if ref else "-"

        print(f"| {hook} | {r['bytes'] / 1e6:.3f} | {rel('bytes')} | {r['step_s'] * 1e3:.1f} | {rel('step_s')} | "
              f"{r['loss']:.4f} | {rel('loss')} | {r['val']:.4f} | {rel('val')} |")
    print("goals: loss within 2% of none for fp16/bf16, within 5% for powersgd")


def _entry(entry: str, rank: int, start: int | None) -> tuple[str, int, int | None]:
    """'powersgd:8@50' -> ('powersgd', 8, 50); other hooks and plain 'powersgd' take the defaults."""
    hook, _, at = entry.partition("@")
    hook, _, r = hook.partition(":")
    return hook, int(r) if r else rank, int(at) if at else start


if __name__ == "__main__":
    main()
