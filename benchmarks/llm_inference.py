"""Generation speed: onnxruntime with llmpipe's static KV-cache decoder vs PyTorch eager with its KV
cache, side by side in one run, as ratios.

For each flavor (random-init weights: speed does not depend on the values) it exports the prefill
graph and decoder_static.onnx with llmpipe's exporter, makes the INT8 variants, and measures with the
benchmark stage's engines (llmpipe.infer.decode):

- decode tokens/s at batch 1 (prompt 128, 128 new tokens): ORT fp32 / torch eager (goal >= 2.0) and
  ORT int8 / ORT fp32;
- time to first token at prompt 512: ORT fp32 / torch eager (goal <= 0.8);
- time per token as the cache fills from 64 to ~1024 tokens: the static decoder reads a fixed-size
  cache, so its per-token time should stay flat (max/min window <= 1.5); torch's cat-grown cache
  for contrast;
- the perplexity increase of fp16 and int8 on validation text, from the demo run's benchmark
  (artifacts/tiny; `make demo` first), since it needs a trained model and real text.

    python benchmarks/llm_inference.py --flavors tiny,small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

# NOTE: lets `python benchmarks/llm_inference.py` run from a checkout without installing llmpipe.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe import device  # noqa: E402
from llmpipe.export.onnx import export_prefill, export_static_decoder, random_ids  # noqa: E402
from llmpipe.infer.decode import StaticEngine, TorchEngine, generate  # noqa: E402
from llmpipe.infer.ort import create_session, quantize_int8  # noqa: E402
from llmpipe.models.llama import FLAVORS, Transformer  # noqa: E402

WINDOWS = (64, 256, 512, 960)  # cache fill (tokens) at which per-token time is averaged over 32 steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", default="tiny,small", help="comma-separated model flavors")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (the demo's tokenizer has 4096)")
    p.add_argument("--cache", type=int, default=1024, help="static decoder cache slots")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads for both (default: all cores)")
    p.add_argument("--run", default="artifacts/tiny", help="a finished run whose benchmark gives the quality")
    return p.parse_args(argv)


def _median(values):
    return float(np.median([v for v in values if v is not None]))


def decode_rate(engine, prompt: np.ndarray, new: int, repeats: int) -> float:
    generate(engine, prompt, 4)
    return _median([generate(engine, prompt, new).decode_tokens_per_s() for _ in range(repeats)])


def ttft_ms(engine, prompt: np.ndarray, repeats: int) -> float:
    generate(engine, prompt, 1)
    return _median([generate(engine, prompt, 1).ttft_s * 1e3 for _ in range(repeats)])


def growth(engine, vocab: int, cache: int) -> dict[int, float]:
    """Mean ms per token over 32 steps starting at each cache fill in WINDOWS (one long generation)."""
    start = 32
    prompt = random_ids(1, start, vocab, 7)
    generate(engine, prompt, 48)  # warm-up: the first steps of a fresh shape pay for allocations
    gen = generate(engine, prompt, cache - start)
    steps = np.asarray(gen.step_s) * 1e3  # step i feeds token start + i + 1
    return {w: float(steps[w - start: w - start + 32].mean()) for w in WINDOWS if w - start + 32 <= len(steps)}


def measure(flavor: str, args: argparse.Namespace, folder: Path) -> dict:
    model_args = FLAVORS[flavor]
    model_args = type(model_args)(**{**model_args.to_dict(), "vocab_size": args.vocab,
                                     "max_seq_len": max(model_args.max_seq_len, args.cache)})
    model = Transformer(model_args)
    model.init_weights(seed=0)
    model.eval()
    cpu = device.ort_providers(["cpu"])[0]
    paths = {"prefill": folder / f"{flavor}-model.onnx", "decoder": folder / f"{flavor}-decoder_static.onnx"}
    export_prefill(model, paths["prefill"], opset=17)
    export_static_decoder(model, paths["decoder"], opset=17, length=args.cache)
    for name in ("prefill", "decoder"):
        paths[f"{name}-int8"] = paths[name].with_name(paths[name].stem + "-int8.onnx")
        quantize_int8(paths[name], paths[f"{name}-int8"])
    engines = {
        "torch": TorchEngine(model),
        "fp32": StaticEngine(create_session(paths["prefill"], cpu, args.threads),
                             create_session(paths["decoder"], cpu, args.threads), model_args, args.cache),
        "int8": StaticEngine(create_session(paths["prefill-int8"], cpu, args.threads),
                             create_session(paths["decoder-int8"], cpu, args.threads), model_args, args.cache),
    }
    prompt128, prompt512 = random_ids(1, 128, args.vocab, 1), random_ids(1, 512, args.vocab, 2)
    out = {"params": model_args.num_params()}
    for name, engine in engines.items():
        out[name] = {"decode_tokens_per_s": decode_rate(engine, prompt128, 128, args.repeats),
                     "ttft512_ms": ttft_ms(engine, prompt512, args.repeats)}
        if name != "int8":
            out[name]["growth_ms"] = growth(engine, args.vocab, args.cache)
        print(f"  {flavor} {name}: {out[name]}", file=sys.stderr)
    return out


def quality(run: Path) -> dict | None:
    path = run / "06_benchmark" / "results.json"
    if not path.is_file():
        return None
    q = json.loads(path.read_text()).get("quality")
    return q["variants"] if q else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(args.threads)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="llmpipe-llm-bench-") as tmp:
        for flavor in args.flavors.split(","):
            rows[flavor] = measure(flavor, args, Path(tmp))
    print(f"\nGeneration on {os.cpu_count()} CPU cores, {args.threads} intra-op threads for both, batch 1, "
          f"static cache {args.cache}; median of {args.repeats}\n")
    print(f"{'flavor':>7} {'params':>7} | {'decode tok/s torch':>18} {'ORT fp32':>9} {'fp32/torch':>10} "
          f"{'ORT int8':>9} {'int8/fp32':>9} | {'TTFT@512 torch ms':>17} {'ORT fp32':>9} {'fp32/torch':>10}")
    for flavor, r in rows.items():
        t, f, i = r["torch"], r["fp32"], r["int8"]
        print(f"{flavor:>7} {r['params'] / 1e6:>6.1f}M | {t['decode_tokens_per_s']:>18.1f} "
              f"{f['decode_tokens_per_s']:>9.1f} {f['decode_tokens_per_s'] / t['decode_tokens_per_s']:>9.2f}x "
              f"{i['decode_tokens_per_s']:>9.1f} {i['decode_tokens_per_s'] / f['decode_tokens_per_s']:>8.2f}x | "
              f"{t['ttft512_ms']:>17.1f} {f['ttft512_ms']:>9.1f} {f['ttft512_ms'] / t['ttft512_ms']:>9.2f}x")
    print("\nms per token as the cache fills (mean of 32 steps from each fill):")
    print(f"{'flavor':>7} {'engine':>6} " + " ".join(f"{w:>7}" for w in WINDOWS) + "  max/min")
    for flavor, r in rows.items():
        for name in ("torch", "fp32"):
            g = r[name]["growth_ms"]
            cells = " ".join(f"{g[w]:>7.3f}" if w in g else f"{'-':>7}" for w in WINDOWS)
            print(f"{flavor:>7} {name:>6} {cells}  {max(g.values()) / min(g.values()):.2f}x")
    q = quality(Path(args.run))
    if q is None:
        print(f"\nquality: no benchmark results in {args.run} (run `make demo` first)")
    else:
        print(f"\nquality on validation text ({args.run}), against torch fp32:")
        for name, v in q.items():
            print(f"  {name:>5}: perplexity {v['ppl']:.3f} ({100 * v['ppl_increase']:+.3f}%), KL {v['kl']:.2e}, "
                  f"top-1 {v['top1']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
