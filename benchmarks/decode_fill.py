"""Decode cost against cache fill: does a token cost what the cache holds, or what it could hold?

    python benchmarks/decode_fill.py [--flavors tiny,small] [--cache 1024] [--fills 16,256,1024] [--repeats 5]

For each flavor (random weights: timing does not depend on the values) llmpipe's exporter writes the prefill
graph, the portable decoder_static.onnx (a fixed cache of --cache slots, every step reads all of them: what
ATC needs) and decoder_ort.onnx (the same maths with the cache length dynamic, onnxruntime only). Two
engines of llmpipe.infer.decode run them on onnxruntime's CPU provider at batch 1:

- static: StaticEngine over decoder_static.onnx (what `generate` and the benchmark stage use today);
- growing: GrowingEngine over decoder_ort.onnx, its cache a power-of-two bucket (from --min-bucket) that
  doubles as it fills;
- fused: FusedEngine over onnxruntime-genai's builder graph of the same weights (export_onnx's ort/, what
  `generate` and the benchmark run for fp32 on the CPU): GroupQueryAttention reads the filled slots only,
  the buffer (sized to the prompt and its steps, as generate reserves it; at most --cache slots) bound in
  place as past and present.

Per-token time at fill f: a prompt of f - 8 tokens, then 8 timed steps (the cache holds f - 8 ... f - 1
tokens as they run; at f = --cache that is the last 8 slots), the median step of the 8. Engines and fills
take turns, `--repeats` times; the median over repeats is printed with the spread (min-max) and the ratios
fill max / fill min (goal <= 1.5) and growing / static, in wall-clock time and in the process's CPU time:
with one intra-op thread (the default) the CPU time is one core's work, which other processes on a shared
machine do not inflate. A whole generation (prompt 16 up to a full cache) is timed in the first
--whole-repeats repeats: its mean time per token includes the growing engine's moves from bucket to bucket.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe import device  # noqa: E402
from llmpipe.data.tokenizer import train_tokenizer  # noqa: E402
from llmpipe.export import fused  # noqa: E402
from llmpipe.export.onnx import export_ort_decoder, export_prefill, export_static_decoder, random_ids  # noqa: E402
from llmpipe.infer.decode import GrowingEngine, StaticEngine, generate  # noqa: E402
from llmpipe.infer.fused import FusedEngine, GraphConfig  # noqa: E402
from llmpipe.infer.ort import create_session  # noqa: E402
from llmpipe.models.llama import FLAVORS, Transformer  # noqa: E402

WINDOW = 8  # timed steps per fill
CLOCKS = ("wall", "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", default="tiny,small")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (the demo's tokenizer has 4096)")
    p.add_argument("--cache", type=int, default=1024, help="cache slots (decoder_static's fixed length)")
    p.add_argument("--fills", default="16,256,1024", help="cache fills to time, comma-separated")
    p.add_argument("--min-bucket", type=int, default=64, help="the growing engine's smallest bucket")
    p.add_argument("--engines", default="static,growing,fused", help="static, growing, fused (comma-separated)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: then CPU time is the "
                                                          "work of one core, whatever else the machine runs)")
    p.add_argument("--whole-repeats", type=int, default=2, help="repeats that also time a whole generation (0: none)")
    a = p.parse_args(argv)
    a.fills = [int(f) for f in a.fills.split(",")]
    a.engines = a.engines.split(",")
    bad = [f for f in a.fills if not WINDOW < f <= a.cache]
    if bad:
        p.error(f"--fills: {bad[0]} is not in ({WINDOW}, --cache={a.cache}]")
    return a


def engines(flavor: str, a: argparse.Namespace, folder: Path) -> tuple[dict, int]:
    base = FLAVORS[flavor]
    args = type(base)(**{**base.to_dict(), "vocab_size": a.vocab, "max_seq_len": max(base.max_seq_len, a.cache)})
    model = Transformer(args)
    model.init_weights(seed=0)
    model.eval()
    paths = {k: folder / f"{flavor}-{k}.onnx" for k in ("model", "decoder_static", "decoder_ort")}
    export_prefill(model, paths["model"], opset=17)
    export_static_decoder(model, paths["decoder_static"], opset=17, length=a.cache)
    export_ort_decoder(model, paths["decoder_ort"], opset=17, length=a.cache)
    cpu = device.ort_providers(["cpu"])[0]

    def session(name):
        return create_session(paths[name], cpu, a.threads)

    out = {"static": StaticEngine(session("model"), session("decoder_static"), args, a.cache),
           "growing": GrowingEngine(session("model"), session("decoder_ort"), args, a.cache, a.min_bucket)}
    if "fused" in a.engines:
        docs = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
        hf = fused.write_hf_folder(model, folder / f"{flavor}-hf", train_tokenizer(docs, 512))
        built = fused.build(hf, folder / f"{flavor}-ort", "fp32").parent
        out["fused"] = FusedEngine(create_session(built / "model.onnx", cpu, a.threads), GraphConfig.read(built),
                                   a.cache)
    return {k: v for k, v in out.items() if k in a.engines}, args.num_params()


def per_token_ms(engine, fill: int, vocab: int, seed: int) -> tuple[float, float]:
    """Median ms of the WINDOW steps run while the cache holds fill - WINDOW ... fill - 1 tokens: wall
    clock, and this process's CPU time (every thread's; other processes' load does not count in it)."""
    if hasattr(engine, "reserve"):  # as decode.generate does: the slots this prompt and its steps need
        engine.reserve(fill)
    engine.start(random_ids(1, fill - WINDOW, vocab, seed))
    token, wall, cpu = np.array([1]), [], []
    for _ in range(WINDOW):
        t0, c0 = time.perf_counter(), time.process_time()
        token = engine.step(token).argmax(-1)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def whole_ms(engine, cache: int, vocab: int) -> tuple[float, float]:
    """Mean ms per token of a generation from a 16-token prompt to a full cache (the first token
    excluded): wall clock, and CPU time (the prompt pass's included, over the same tokens)."""
    c0 = time.process_time()
    gen = generate(engine, random_ids(1, 16, vocab, 99), cache - 16 + 1)
    return 1e3 * gen.tpot_s(), 1e3 * (time.process_time() - c0) / (gen.tokens.shape[1] - 1)


def measure(flavor: str, a: argparse.Namespace, folder: Path) -> dict:
    eng, params = engines(flavor, a, folder)
    for e in eng.values():  # warm-up: each shape's first run plans its memory
        for fill in a.fills:
            per_token_ms(e, fill, a.vocab, 0)
    runs = {clock: {name: {f: [] for f in a.fills} for name in eng} for clock in CLOCKS}
    whole = {clock: {name: [] for name in eng} for clock in CLOCKS}
    for r in range(a.repeats):
        order = list(eng) if r % 2 == 0 else list(reversed(eng))
        for fill in a.fills:
            for name in order:
                for clock, ms in zip(CLOCKS, per_token_ms(eng[name], fill, a.vocab, r + 1)):
                    runs[clock][name][fill].append(ms)
        if r < a.whole_repeats:
            for name in order:
                for clock, ms in zip(CLOCKS, whole_ms(eng[name], a.cache, a.vocab)):
                    whole[clock][name].append(ms)
        wall = runs["wall"]
        print(f"  {flavor} repeat {r} (wall ms): " + ", ".join(
            f"{n} " + "/".join(f"{wall[n][f][-1]:.3f}" for f in a.fills) for n in eng), file=sys.stderr, flush=True)
    return {"params": params, "runs": runs, "whole": whole}


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]" if values else "-"


def report(results: dict, a: argparse.Namespace, clock: str) -> None:
    lo, hi = min(a.fills), max(a.fills)
    what = "wall clock" if clock == "wall" else "CPU time of the process"
    print(f"\nPer-token decode time (ms, {what}) by cache fill, onnxruntime CPU, batch 1, a {a.cache}-slot "
          f"cache, {a.threads} thread(s); median of {a.repeats} alternating runs [min-max], each the median of "
          f"{WINDOW} steps\n")
    print("| flavor | engine | " + " | ".join(f"fill {f}" for f in a.fills) + f" | fill {hi} / fill {lo} | "
          "whole generation, ms/token |")
    print("|---|---|" + "---|" * len(a.fills) + "---|---|")
    for flavor, res in results.items():
        for name, runs in res["runs"][clock].items():
            med = {f: statistics.median(v) for f, v in runs.items()}
            cells = " | ".join(_cell(v) for v in runs.values())
            print(f"| {flavor} ({res['params'] / 1e6:.1f}M) | {name} | {cells} | {med[hi] / med[lo]:.2f} | "
                  f"{_cell(res['whole'][clock][name])} |")
    for name in ("growing", "fused"):
        if name not in a.engines or "static" not in a.engines:
            continue
        print(f"\n{name} / static ({what}):")
        for flavor, res in results.items():
            s, g = res["runs"][clock]["static"], res["runs"][clock][name]
            ratios = ", ".join(f"fill {f} {statistics.median(g[f]) / statistics.median(s[f]):.2f}" for f in a.fills)
            ws, wg = res["whole"][clock]["static"], res["whole"][clock][name]
            whole = f"; whole generation {statistics.median(wg) / statistics.median(ws):.2f}" if ws else ""
            print(f"  {flavor}: {ratios}{whole}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmpipe-decode-fill-") as tmp:
        for flavor in a.flavors.split(","):
            results[flavor] = measure(flavor, a, Path(tmp))
    for clock in CLOCKS:
        report(results, a, clock)
    print(f"goal: fill {max(a.fills)} / fill {min(a.fills)} <= 1.5, and fill {min(a.fills)} not paying for "
          f"{max(a.fills)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
