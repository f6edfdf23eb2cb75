"""Peak RSS of consolidating one ZeRO-3 checkpoint: llmpipe's streaming consolidation vs DeepSpeed's
zero_to_fp32, as multiples of the consolidated model's bytes.

    python benchmarks/consolidate_rss.py [--dim 768 --layers 8] [--keep DIR]

Trains one step with train.parallel.data=zero, zero_stage=3 on 2 gloo ranks (torchrun, llmpipe's
own train entry), then consolidates the checkpoint to fp32 in a fresh child process per method:

    llmpipe             llmpipe.checkpoint.zero.consolidate_zero -> model.safetensors
    ds-convert          zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True)
    ds-state-dict       zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint (in memory, no file)

Each child reports its resident set before the work (after its imports) and its peak (getrusage
ru_maxrss, which counts touched pages of memory-mapped files too); the table shows the growth
(peak - before) / model bytes, the number the issue bounds (llmpipe: <= 1.3), and the raw peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# NOTE: lets `python benchmarks/consolidate_rss.py` run from a checkout without installing llmpipe.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("llmpipe", "ds-convert", "ds-state-dict")


def rss_now() -> int:
    """This process's current resident set (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(method: str, checkpoint: Path, out: Path) -> dict:
    """Run one consolidation in this (fresh) process; returns RSS before and at peak, and the time."""
    if method == "llmpipe":
        from llmpipe.checkpoint.zero import consolidate_zero

        def work():
            consolidate_zero(checkpoint, out, "fp32")
    else:
        from deepspeed.utils import zero_to_fp32

        from llmpipe.checkpoint.zero import TAG

        def work():
            if method == "ds-convert":
                zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(out), tag=TAG,
                                                                         safe_serialization=True)
            else:
                state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=TAG)
                assert state  # held until here, as a caller would hold it
    before = rss_now()
    t0 = time.perf_counter()
    work()
    return {"before": before, "peak": rss_peak(), "seconds": time.perf_counter() - t0}


def make_checkpoint(root: Path, dim: int, layers: int) -> tuple[Path, int]:
    """One ZeRO-3 training step through llmpipe's train entry; returns (checkpoint, fp32 model bytes)."""
    import yaml

    from llmpipe.checkpoint import io as ckpt
    from llmpipe.models.llama import model_args
    from llmpipe.train.launch import run_streaming, torchrun_argv
    from tests.conftest import make_cfg, make_data_dir

    data = make_data_dir(root / "data")
    cfg = make_cfg(root, model={"flavor": "debug", "dim": dim, "n_layers": layers, "n_heads": dim // 64,
                                "n_kv_heads": dim // 64, "ffn_dim": 8 * dim // 3 // 64 * 64},
                   train={"nproc_per_node": 2, "micro_batch_size": 1, "grad_accum_steps": 1, "max_steps": 1,
                          "threads_per_proc": 1, "parallel": {"data": "zero", "zero_stage": 3},
                          "checkpoint": {"every_steps": 1}, "eval": {"every_steps": 1, "batches": 1}})
    (root / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    lines: list[str] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code, _ = run_streaming(torchrun_argv(2, root / "config.yaml", data, root / "train"), lines.append, env=env)
    if code != 0:
        sys.exit("training failed:\n" + "\n".join(lines[-40:]))
    params = model_args(cfg.model, vocab_size=256).num_params()
    return ckpt.step_dir(root / "train" / "checkpoints", 1), params * 4


def measure(method: str, checkpoint: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, __file__, "--child", method, str(checkpoint), str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        sys.exit(f"{method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: dict[str, dict], model_bytes: int) -> None:
    mb = 1 << 20
    print(f"\nconsolidated model: {model_bytes / mb:.0f} MiB fp32\n")
    print(f"{'method':<15}{'growth MiB':>11}{'growth/model':>14}{'peak MiB':>10}{'peak/model':>12}{'seconds':>9}")
    for name, r in rows.items():
        growth = r["peak"] - r["before"]
        print(f"{name:<15}{growth / mb:>11.0f}{growth / model_bytes:>14.2f}{r['peak'] / mb:>10.0f}"
              f"{r['peak'] / model_bytes:>12.2f}{r['seconds']:>9.1f}")
    ours = rows["llmpipe"]["peak"] - rows["llmpipe"]["before"]
    for name in METHODS[1:]:
        theirs = rows[name]["peak"] - rows[name]["before"]
        print(f"growth ratio {name} / llmpipe: {theirs / max(ours, 1):.1f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    p.add_argument("--child", nargs=3, metavar=("METHOD", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], Path(a.child[1]), Path(a.child[2]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        checkpoint, model_bytes = make_checkpoint(root, a.dim, a.layers)
        rows = {m: measure(m, checkpoint, root / f"out-{m}") for m in METHODS}
        report(rows, model_bytes)


if __name__ == "__main__":
    main()
