"""The quantised onnxruntime variants side by side in one run: int8 (dynamic), int4 and int8w (weight-only
MatMulNBits), int8s (static, calibrated) against fp32.

For each flavor it takes the demo run's exported graphs and validation text where a run of that flavor
exists (`--run tiny=artifacts/tiny`, made by `make demo`), else the flavor with random-init weights
(speed does not depend on the values; quality is then not meaningful and not shown). The variants are
made by the benchmark stage's own code (llmpipe.infer.ort.make_variants, llmpipe.bench.calibrate) with
benchmark.quantize's defaults, and measured:

- perplexity increase and top-1 agreement of each against fp32 onnxruntime, on a seeded sample of
  validation windows (16 x 128 tokens);
- decode tokens/s at batch 1 (prompt 128 tokens, 64 new, first token excluded), every variant and fp32
  taking turns in each repetition, the median of the repetitions, and the ratio to fp32 of the same run.

    python benchmarks/quantize.py --flavors tiny,small --run tiny=artifacts/tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

# NOTE: lets `python benchmarks/quantize.py` run from a checkout without installing llmpipe.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe import device  # noqa: E402
from llmpipe.bench import calibrate, quality  # noqa: E402
from llmpipe.config import QuantizeSection  # noqa: E402
from llmpipe.export.onnx import export_prefill, export_static_decoder  # noqa: E402
from llmpipe.infer.decode import StaticEngine  # noqa: E402
from llmpipe.infer.ort import create_session, make_variants  # noqa: E402
from llmpipe.models.llama import FLAVORS, Transformer  # noqa: E402
from llmpipe.models.llama.io import read_args  # noqa: E402

VARIANTS = ["int8", "int4", "int8w", "int8s"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", default="tiny,small", help="comma-separated model flavors")
    p.add_argument("--run", action="append", default=["tiny=artifacts/tiny"],
                   help="FLAVOR=RUN_FOLDER: a finished run of that flavor (its graphs and validation text)")
    p.add_argument("--val", default="artifacts/tiny/01_prepare_data/val.bin",
                   help="validation shard calibrating a random-init flavor's int8s")
    p.add_argument("--cache", type=int, default=1024, help="static decoder cache slots (random-init flavors)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of a random-init flavor")
    p.add_argument("--samples", type=int, default=16, help="validation windows scored")
    p.add_argument("--prompt", type=int, default=128, help="decode prompt length")
    p.add_argument("--new", type=int, default=64, help="tokens decoded per measurement")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def _graphs(flavor: str, runs: dict[str, Path], work: Path, args) -> tuple[Path, Path, object, int, Path, bool]:
    """(prefill, decoder, ModelArgs, cache slots, validation shard, trained?) of a flavor."""
    run = runs.get(flavor)
    if run is not None and (run / "04_export_onnx" / "decoder_static.onnx").is_file():
        export = run / "04_export_onnx"
        cache = json.loads((export / "manifest.json").read_text())["metrics"]["static_decoder_cache_len"]
        return (export / "model.onnx", export / "decoder_static.onnx", read_args(run / "03_consolidate"), cache,
                run / "01_prepare_data" / "val.bin", True)
    margs = type(FLAVORS[flavor])(**{**FLAVORS[flavor].to_dict(), "vocab_size": args.vocab})
    model = Transformer(margs)
    model.init_weights(seed=0)
    model.eval()
    folder = work / flavor
    folder.mkdir(parents=True)
    export_prefill(model, folder / "model.onnx", opset=17)
    export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=args.cache)
    return folder / "model.onnx", folder / "decoder_static.onnx", margs, args.cache, Path(args.val), False


def _logits(path: Path, ids: np.ndarray, threads: int) -> np.ndarray:
    s = create_session(path, device.ort_providers(["cpu"])[0], threads)
    return np.concatenate([s.run(["logits"], {"input_ids": ids[i:i + 4]})[0] for i in range(0, len(ids), 4)])


def _decode_rate(engine: StaticEngine, prompt: np.ndarray, new: int) -> float:
    tok = engine.start(prompt).argmax(-1)  # the first token (prefill) is not timed
    t0 = time.perf_counter()
    for _ in range(new):
        tok = engine.step(tok).argmax(-1)
    return new / (time.perf_counter() - t0)


def measure(flavor: str, runs: dict[str, Path], work: Path, args, threads: int) -> dict:
    prefill, decoder, margs, cache, val, trained = _graphs(flavor, runs, work, args)
    cpu = device.ort_providers(["cpu"])[0]
    q = QuantizeSection()
    seq = min(128, margs.max_seq_len)
    calib = calibrate.windows(val, q.calibration_samples, seq, 1235)
    made = {}
    for graph, reader in ((prefill, partial(calibrate.prefill_reader, calib)),
                          (decoder, partial(calibrate.decoder_reader, prefill, decoder, margs, cache, calib,
                                            q.calibration_decode_steps, cpu, threads))):
        t0 = time.perf_counter()
        made[graph.name] = make_variants(graph, VARIANTS, work / f"{flavor}-variants", filename=graph.name,
                                         quantize=q, calibration=reader)
        print(f"{flavor}: variants of {graph.name} made in {time.perf_counter() - t0:.0f} s", flush=True)
    names = ["fp32", *VARIANTS]
    rows = {n: {"bytes": made["model.onnx"][n].nbytes(), "error": made["model.onnx"][n].error
                or made[decoder.name][n].error} for n in names}
    if trained:
        ids = quality.val_sample(val, args.samples, seq, 1234)
        ref = _logits(prefill, ids, threads)
        for n in VARIANTS:
            if not rows[n]["error"]:
                m = quality.text_metrics(ids, ref, _logits(made["model.onnx"][n].path, ids, threads))
                rows[n].update(ppl_increase=m["ppl_increase"], top1=m["top1"], kl=m["kl"])
    engines = {n: StaticEngine(create_session(made["model.onnx"][n].path, cpu, threads),
                               create_session(made[decoder.name][n].path, cpu, threads), margs, cache)
               for n in names if not rows[n]["error"]}
    prompt = np.random.default_rng(0).integers(1, margs.vocab_size, (1, args.prompt))
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for e in engines.values():  # one untimed round
        _decode_rate(e, prompt, 4)
    for _ in range(args.repeats):
        for n, e in engines.items():  # taking turns
            rates[n].append(_decode_rate(e, prompt, args.new))
    for n, r in rates.items():
        rows[n]["decode_tokens_per_s"] = float(np.median(r))
        rows[n]["vs_fp32"] = rows[n]["decode_tokens_per_s"] / float(np.median(rates["fp32"]))
    return {"flavor": flavor, "trained": trained, "cache": cache, "rows": rows}


def table(results: list[dict]) -> str:
    lines = ["| flavor | variant | ppl increase | top-1 vs fp32 | decode tokens/s (batch 1) | vs fp32 | prefill MB |",
             "|---|---|--:|--:|--:|--:|--:|"]
    for r in results:
        for n, row in r["rows"].items():
            if row.get("error"):
                lines.append(f"| {r['flavor']} | {n} | {row['error']} | | | | |")
                continue
            ppl = f"{100 * row['ppl_increase']:+.2f}%" if "ppl_increase" in row else ("0" if n == "fp32" and
                                                                                      r["trained"] else "-")
            top1 = f"{row['top1']:.4f}" if "top1" in row else ("1" if n == "fp32" and r["trained"] else "-")
            lines.append(f"| {r['flavor']}{'' if r['trained'] else ' (random init)'} | {n} | {ppl} | {top1} | "
                         f"{row['decode_tokens_per_s']:,.0f} | {row['vs_fp32']:.2f}x | {row['bytes'] / 1e6:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    runs = {k: Path(v) for k, _, v in (r.partition("=") for r in args.run)}
    results = []
    with tempfile.TemporaryDirectory(prefix="llmpipe-quantize-") as tmp:
        for flavor in args.flavors.split(","):
            results.append(measure(flavor, runs, Path(tmp), args, threads))
    print(f"\n{threads} threads; decode: prompt {args.prompt}, {args.new} new tokens, batch 1, median of "
          f"{args.repeats} (engines taking turns); quality: {args.samples} validation windows of 128 tokens\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
