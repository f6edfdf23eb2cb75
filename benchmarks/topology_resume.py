"""Resume overhead after a topology change: the time to read a checkpoint of another layout and reshard
it into the new one (llmpipe.checkpoint.portable), against the time one checkpoint save took, in one run.

    python benchmarks/topology_resume.py [--dim 1024 --layers 8]

A 2-rank DDP run trains 2 steps and saves (its metrics record each save's stall); then a 1-rank FSDP2
run and a 2-rank tp2 run resume from that checkpoint (their log line gives the resharding time) and
save once more. Printed: seconds and the ratio conversion / save.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import make_cfg, make_data_dir, torchrun  # noqa: E402


def _stalls(out: Path) -> list[float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["checkpoint_stall_s"] for r in recs if "checkpoint_stall_s" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    a = p.parse_args()
    model = {"flavor": "debug", "dim": a.dim, "n_layers": a.layers, "n_heads": a.dim // 64,
             "n_kv_heads": a.dim // 64, "ffn_dim": 3 * a.dim, "max_seq_len": 64}
    base = {"model": model, "train__checkpoint": {"every_steps": 2}, "train__eval": {"every_steps": 100, "samples": 4}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_data_dir(tmp / "data")
        first = tmp / "ddp2"
        code, text = torchrun(make_cfg(first, **base, train__max_steps=2, train__micro_batch_size=2), data, first, 2)
        if code:
            sys.exit(text[-3000:])
        save_s = _stalls(first)[-1]
        source = first / "checkpoints" / "step-000002"
        rows = []
        for name, nproc, par, micro in (("fsdp1", 1, {"data": "fsdp"}, 4), ("tp2", 2, {"tp": 2}, 4)):
            out = tmp / name
            cfg = make_cfg(out, **{**base, "train__checkpoint": {"every_steps": 2, "resume": str(source)}},
                           train__max_steps=3, train__micro_batch_size=micro, train__parallel=par)
            code, text = torchrun(cfg, data, out, nproc)
            if code:
                sys.exit(text[-3000:])
            convert_s = float(re.search(r"resharded in ([\d.]+)s", text).group(1))
            rows.append((name, convert_s, _stalls(out)[-1]))
    params = a.layers * (4 * a.dim * a.dim + 3 * a.dim * 3 * a.dim) + 2 * 256 * a.dim
    print(f"\n~{params / 1e6:.0f}M parameters (fp32 + AdamW: {16 * params / 2**30:.2f} GiB of state), "
          f"written by DDP on 2 ranks; one save there: {save_s:.2f} s\n")
    print(f"{'resumed as':<12}{'reshard s':>10}{'its save s':>12}{'reshard / DDP save':>20}")
    for name, convert_s, own_save in rows:
        print(f"{name:<12}{convert_s:>10.2f}{own_save:>12.2f}{convert_s / save_s:>20.2f}")


if __name__ == "__main__":
    main()
