"""Prefill latency: PyTorch eager vs onnxruntime FP32 / FP16 / INT8, side by side, with ratios.

Builds a random-init model of a named flavor, exports it with llmpipe's exporter, makes the
variants and measures them with the benchmark stage's own functions; prints a p50 table where
each ORT column carries its speed-up over torch eager (torch p50 / ORT p50; > 1 is faster).

    python benchmarks/inference.py --flavor tiny --shapes 1x128,4x128 --iters 30
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

# NOTE: lets `python benchmarks/inference.py` run from a checkout without installing llmpipe.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe import device  # noqa: E402
from llmpipe.bench.run import TORCH, benchmark, markdown_table  # noqa: E402
from llmpipe.export.onnx import export_prefill  # noqa: E402
from llmpipe.infer.ort import VARIANTS, make_variants  # noqa: E402
from llmpipe.models.llama import FLAVORS, Transformer  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x128,4x128' -> [(1, 128), (4, 128)]."""
    try:
        return [tuple(int(n) for n in item.lower().split("x", 1)) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes: expected BATCHxSEQ[,BATCHxSEQ...], got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", choices=["debug", "tiny"], default="tiny")
    p.add_argument("--shapes", type=parse_shapes, default=[(1, 128), (4, 128)], help="e.g. 1x128,4x128")
    p.add_argument("--iters", type=int, default=30, help="timed iterations per measurement")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of fp32,fp16,int8")
    p.add_argument("--providers", default="auto", help="auto, or comma-separated (e.g. cpu)")
    p.add_argument("--full", action="store_true", help="also print the stage's full markdown table")
    return p.parse_args(argv)


def ratio_table(results: dict, variants: list[str]) -> str:
    """One line per (shape, provider): torch p50 ms, then each variant's p50 ms and speed-up."""
    p50 = {(r["batch"], r["seq"], r["provider"], r["variant"]): r for r in results["rows"]}
    head = f"{'shape':>8} {'provider':>8} {'torch ms':>9}"
    head += "".join(f" {v + ' ms (x)':>18}" for v in variants)
    lines = [head, "-" * len(head)]
    for b, s in results["shapes"]:
        for provider in results["providers"]:
            torch_row = p50.get((b, s, provider, TORCH))
            cells = [f"{b}x{s}".rjust(8), provider.rjust(8), _ms(torch_row).rjust(9)]
            for v in variants:
                row = p50.get((b, s, provider, v))
                ratio = row and row["speedup_vs_torch"]
                cells.append(f"{_ms(row)} ({ratio:.2f}x)".rjust(18) if ratio else _ms(row).rjust(18))
            lines.append(" ".join(cells))
    return "\n".join(lines)


def _ms(row: dict | None) -> str:
    if row is None:
        return "-"
    return "failed" if row["error"] else f"{row['latency_ms']['p50']:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    providers = device.ort_providers("auto" if args.providers == "auto" else args.providers.split(","))
    model = Transformer(FLAVORS[args.flavor])
    model.init_weights(seed=0)
    model.eval()
    print(f"flavor {args.flavor}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"providers {[p.name for p in providers]}")
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        export_prefill(model, onnx_path, opset=17)
        made = make_variants(onnx_path, variants, Path(tmp) / "variants")
        results = benchmark(made, providers, args.shapes, requested=variants,
                            vocab_size=model.args.vocab_size, warmup=args.warmup, iters=args.iters,
                            threads=args.threads, torch_model=model)
    print(f"\np50 latency, {results['threads']} threads; (x) = torch p50 / ORT p50, > 1 is faster\n")
    print(ratio_table(results, variants))
    if args.full:
        print("\n" + markdown_table(results))
    else:
        print("\n" + "\n".join(f"- {n}" for n in results["notes"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
