"""llmpipe's deployment engines against onnxruntime-genai's own, on the same weights.

    python benchmarks/deploy_vs_peers.py [--flavors tiny,small] [--hf FOLDER] [--threads 1] [--repeats 3]

For each flavor (random weights, seeded: timing does not depend on the values; or `--hf`, a run's
consolidated hf/ folder) the weights are written as consolidate writes hf/, then:

- genai fp32 / genai int4: onnxruntime-genai's model builder (`python -m onnxruntime_genai.models.builder
  -i hf/ -p fp32|int4 -e cpu`, its defaults) and onnxruntime-genai's own runtime (og.Generator), greedy;
- llmpipe fused fp32 / fused int4 / fused int8w: what the pipeline deploys on the CPU for fp32, int4 and
  int8w (export_onnx's ort/, the benchmark's variants/<name>/ort/): the builder's graphs at
  benchmark.quantize's default settings (the ones the demo gates: int4 asymmetric, blocks of 128 in its
  ORT graph; int8w 8 bits, blocks of 32), driven by llmpipe.infer.fused.FusedEngine through a plain
  onnxruntime session (the cache one buffer bound in place, sized to the generation);
- llmpipe static fp32 / static int8: export_onnx's portable graphs (model.onnx + decoder_static.onnx, a
  --cache slot cache) in StaticEngine, int8 the benchmark stage's dynamic-int8 variant of both;
- torch: PyTorch eager with its KV cache (TorchEngine), fp32;
- llamacpp-f16 / llamacpp-q8_0 / llamacpp-q4_0: llama.cpp (llama-cpp-python, when installed: an optional extra)
  on export.gguf's file of the same hf/ folder (llmpipe.export.gguf), batch 1 only (one sequence per context).

Which of these hold on a real model is a question of quality, not of speed: benchmarks/quant_recipes.py runs
each llmpipe recipe and each llama.cpp file of SmolLM2-135M-Instruct through the same default gates and prints
the speed ratio of the fastest passing on each side (docs/measurements/quantisation.md).

Measured, as llmpipe.infer.decode.generate defines them: decode tokens/s (batch * (n - 1) / time after
the first token: the first token excluded) at batch 1 and 8 from a --decode-prompt prompt, --new-tokens
tokens; time to first token at prompt 128 and 512 (batch 1). The same prompt ids for every engine, the
same intra-op threads (--threads; torch.set_num_threads too), greedy. The physical bound beside each
onnxruntime engine: the weight bytes a decode step reads (every initializer but those only gathered from,
the embedding table) / the memory bandwidth measured here on --threads threads (numpy reading a 1 GiB
array, best of 5): the tokens/s at batch 1 no engine can beat on this machine. Engines take turns within each
repeat (the order reversed every other repeat), and the best of --repeats is kept. Greedy tokens are
compared with PyTorch's at batch 1 (a check that every engine decodes the same model; fp32 engines must
agree, int8/int4 may drift on random weights, whose logits are close together).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe import device  # noqa: E402
from llmpipe.bench import gguf_variants  # noqa: E402
from llmpipe.config import QuantizeSection  # noqa: E402
from llmpipe.export import fused  # noqa: E402
from llmpipe.export.onnx import export_prefill, export_static_decoder  # noqa: E402
from llmpipe.infer.decode import StaticEngine, TorchEngine, generate  # noqa: E402
from llmpipe.infer.fused import FusedEngine, GraphConfig  # noqa: E402
from llmpipe.infer.ort import create_session, quantize_int8  # noqa: E402
from llmpipe.models.llama import FLAVORS, Transformer  # noqa: E402
from llmpipe.models.llama.io import load_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", default="tiny,small", help="random-weight flavors, comma-separated")
    p.add_argument("--hf", type=Path, help="a run's consolidated hf/ folder instead of --flavors")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of the random-weight flavors (the demo's)")
    p.add_argument("--cache", type=int, default=1024, help="cache slots of the static and fused engines")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every engine")
    p.add_argument("--repeats", type=int, default=3, help="best of this many, engines taking turns")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--ttft-prompts", default="128,512")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--engines", default="torch,static-fp32,static-int8,fused-fp32,fused-int4,fused-int8w,genai-fp32,"
                   "genai-int4", help="comma-separated; add llamacpp (or llamacpp-f16, -q8_0, -q4_0) for llama.cpp")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args(argv)
    a.ttft_prompts = [int(x) for x in a.ttft_prompts.split(",")]
    a.batches = [int(x) for x in a.batches.split(",")]
    a.engines = a.engines.split(",")
    if "llamacpp" in a.engines:  # shorthand: every llama.cpp type export.gguf writes
        i = a.engines.index("llamacpp")
        a.engines[i:i + 1] = ["llamacpp-f16", "llamacpp-q8_0", "llamacpp-q4_0"]
    if any(e.startswith("llamacpp-") for e in a.engines):
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            p.error("the llamacpp engines need llama-cpp-python (pip install 'llmpipe[llamacpp]')")
    if max(a.ttft_prompts + [a.decode_prompt]) + a.new_tokens > a.cache:
        p.error(f"--cache {a.cache}: too small for the longest prompt + --new-tokens")
    return a


class GenaiRunner:
    """onnxruntime-genai's runtime over a builder folder, timed as decode.generate times an engine."""

    def __init__(self, folder: Path, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model, self.graph = og.Model(config), None

    def generate(self, ids: np.ndarray, n: int) -> tuple[np.ndarray, float, float | None]:
        """(tokens (B, n), TTFT s, decode tokens/s with the first token excluded)."""
        B, T = ids.shape
        params = self.og.GeneratorParams(self.model)
        # NOTE: min_length: eos is never picked, so every engine decodes the same n tokens (genai would stop
        # at eos, which random weights pick now and then, and time nothing after it)
        params.set_search_options(do_sample=False, max_length=T + n, min_length=T + n, batch_size=B)
        gen = self.og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids.astype(np.int32))  # the prompt pass
        gen.generate_next_token()  # picks the first token
        out = [gen.get_next_tokens()]
        ttft = time.perf_counter() - t0
        for _ in range(n - 1):
            if gen.is_done():
                raise RuntimeError("onnxruntime-genai stopped before max_length")
            gen.generate_next_token()  # one step over the last token, then the pick
            out.append(gen.get_next_tokens())
        spent = time.perf_counter() - t0 - ttft
        return np.stack(out, axis=1), ttft, (B * (n - 1) / spent if n > 1 else None)


class LlamaCppRunner:
    """llama.cpp on a GGUF file, greedy, timed as decode.generate times an engine; one sequence (batch 1)."""

    batch1_only = True

    def __init__(self, path: Path, threads: int, cache: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=cache, n_batch=cache, n_ubatch=cache, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.graph = None

    def generate(self, ids: np.ndarray, n: int) -> tuple[np.ndarray, float, float | None]:
        if ids.shape[0] != 1:
            raise ValueError("llama.cpp runs batch 1 here")
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids[0].tolist())
        out = [int(np.argmax(gguf_variants.last_logits(self.llm)))]
        ttft = time.perf_counter() - t0
        for _ in range(n - 1):
            self.llm.eval([out[-1]])
            out.append(int(np.argmax(gguf_variants.last_logits(self.llm))))
        spent = time.perf_counter() - t0 - ttft
        return np.array([out]), ttft, ((n - 1) / spent if n > 1 else None)


class EngineRunner:
    """An llmpipe engine (start/step) timed by decode.generate, greedy."""

    def __init__(self, make: Callable[[], object]):
        self.engine, self.graph = make(), None  # graph: the decode step's ONNX file, for its weight bytes

    def generate(self, ids: np.ndarray, n: int) -> tuple[np.ndarray, float, float | None]:
        g = generate(self.engine, ids, n)
        return g.tokens, g.ttft_s, g.decode_tokens_per_s()


def model_for(flavor: str, a: argparse.Namespace, folder: Path) -> tuple[Transformer, Path]:
    """(fp32 model, its hf/ folder)."""
    if a.hf:
        return load_model(a.hf.parent, dtype=torch.float32), a.hf
    from llmpipe.data.tokenizer import train_tokenizer

    base = FLAVORS[flavor]
    args = replace(base, vocab_size=a.vocab, max_seq_len=max(base.max_seq_len, a.cache))
    model = Transformer(args)
    model.init_weights(seed=0)
    docs = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    return model.eval(), fused.write_hf_folder(model, folder / "hf", train_tokenizer(docs, 512))


def runners(model: Transformer, hf: Path, a: argparse.Namespace, folder: Path) -> dict[str, object]:
    cpu = device.ort_providers(["cpu"])[0]
    out: dict[str, object] = {}
    if "torch" in a.engines:
        out["torch"] = EngineRunner(lambda: TorchEngine(model))
    static = [e for e in a.engines if e.startswith("static-")]
    if static:
        export_prefill(model, folder / "model.onnx", opset=17)
        export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=a.cache)
        for name in static:
            prefill, decoder = folder / "model.onnx", folder / "decoder_static.onnx"
            if name == "static-int8":
                (folder / "int8").mkdir(exist_ok=True)
                quantize_int8(prefill, folder / "int8" / "model.onnx")
                quantize_int8(decoder, folder / "int8" / "decoder_static.onnx")
                prefill, decoder = folder / "int8" / "model.onnx", folder / "int8" / "decoder_static.onnx"
            out[name] = EngineRunner(lambda p=prefill, d=decoder: StaticEngine(
                create_session(p, cpu, a.threads), create_session(d, cpu, a.threads), model.args, a.cache))
    quantize = QuantizeSection()  # the pipeline's defaults: what its int4 / int8w variants are built with
    builds = {"genai-fp32": ("fp32", None), "genai-int4": ("int4", None), "fused-fp32": ("fp32", None),
              "fused-int4": quantize.int4, "fused-int8w": quantize.int8w}
    for name in [e for e in a.engines if e in builds]:
        t0 = time.perf_counter()
        if name in ("fused-int4", "fused-int8w"):  # as the benchmark stage builds them (rtn or hqq, head_bits)
            built = fused.build_weight_only(hf, folder / name, builds[name]).parent
        else:
            built = fused.build(hf, folder / name, *builds[name]).parent
        print(f"  builder {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        if name.startswith("genai-"):
            out[name] = GenaiRunner(built, a.threads)
        else:
            out[name] = EngineRunner(lambda b=built: FusedEngine(
                create_session(b / "model.onnx", cpu, a.threads), GraphConfig.read(b), a.cache))
        out[name].graph = built / "model.onnx"
    for name in [e for e in a.engines if e.startswith("llamacpp-")]:
        from llmpipe.export import gguf

        path = gguf.write(hf, folder / f"{name}.gguf", name.removeprefix("llamacpp-"))
        out[name] = LlamaCppRunner(path, a.threads, a.cache)
    if "static-fp32" in out:
        out["static-fp32"].graph = folder / "decoder_static.onnx"
    if "static-int8" in out:
        out["static-int8"].graph = folder / "int8" / "decoder_static.onnx"
    return {name: out[name] for name in a.engines if name in out}


def step_weight_bytes(path: Path) -> int:
    """Bytes of the initializers a decode step reads: all of them but those only gathered from (the embedding
    table, of which a step reads one row per token)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    users: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, set()).add(node.op_type)
    total = 0
    for init in graph.initializer:
        if users.get(init.name) == {"Gather"}:
            continue
        count = int(np.prod(init.dims)) if init.dims else 1
        bits = {onnx.TensorProto.FLOAT: 32, onnx.TensorProto.FLOAT16: 16, onnx.TensorProto.INT8: 8,
                onnx.TensorProto.UINT8: 8, onnx.TensorProto.INT64: 64, onnx.TensorProto.INT32: 32,
                onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}.get(init.data_type, 32)
        total += count * bits // 8
    return total


def memory_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s numpy reads from memory on `threads` threads (a sum over a `gib` GiB float32 array, split over the
    threads; best of `repeats`): what a bandwidth-bound decode step can get."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(int(gib * 2**30) // 4, np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))  # numpy releases the GIL in the reduction
            best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


def measure(flavor: str, a: argparse.Namespace, folder: Path) -> dict:
    model, hf = model_for(flavor, a, folder)
    eng = runners(model, hf, a, folder)
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    decode_ids = {b: rng.integers(0, vocab, (b, a.decode_prompt)) for b in a.batches}
    ttft_ids = {t: rng.integers(0, vocab, (1, t)) for t in a.ttft_prompts}
    reference = eng["torch"].generate(decode_ids[1], a.new_tokens)[0] if "torch" in eng else None
    for r in eng.values():  # warm-up: every shape once
        for b in a.batches:
            if b == 1 or not getattr(r, "batch1_only", False):
                r.generate(decode_ids[b], 4)
        for t in a.ttft_prompts:
            r.generate(ttft_ids[t], 1)
    best = {name: {**{f"decode_b{b}": 0.0 for b in a.batches}, **{f"ttft_{t}": float("inf") for t in a.ttft_prompts}}
            for name in eng}
    samples = {name: {key: [] for key in best[name]} for name in eng}  # every repeat's value, in repeat order
    agree = {}
    for rep in range(a.repeats):
        order = list(eng) if rep % 2 == 0 else list(reversed(eng))
        for b in a.batches:
            for name in order:
                if b > 1 and getattr(eng[name], "batch1_only", False):
                    continue
                tokens, _, tps = eng[name].generate(decode_ids[b], a.new_tokens)
                best[name][f"decode_b{b}"] = max(best[name][f"decode_b{b}"], tps)
                samples[name][f"decode_b{b}"].append(tps)
                if b == 1 and reference is not None:
                    agree[name] = float((tokens == reference).mean())
        for t in a.ttft_prompts:
            for name in order:
                ttft = eng[name].generate(ttft_ids[t], 1)[1]
                best[name][f"ttft_{t}"] = min(best[name][f"ttft_{t}"], ttft)
                samples[name][f"ttft_{t}"].append(ttft)
        print(f"  {flavor} repeat {rep}: " + ", ".join(f"{n} {best[n]['decode_b1']:.0f} tok/s" for n in eng),
              file=sys.stderr, flush=True)
    weights = {name: step_weight_bytes(r.graph) for name, r in eng.items() if getattr(r, "graph", None)}
    return {"params": model.args.num_params(), "best": best, "samples": samples, "greedy_agreement_with_torch": agree,
            "step_weight_bytes": weights}


def _ratio(res: dict, num: str, den: str, key: str) -> str:
    """num / den: the ratio of the bests, then the median and range of the repeats' paired ratios (the two
    engines ran one after the other in each repeat, so each pair saw the same machine)."""
    b = res["best"]
    if num not in b or den not in b:
        return "-"
    paired = sorted(x / y for x, y in zip(res["samples"][num][key], res["samples"][den][key]))
    if not paired:
        return "-"
    return (f"{b[num][key] / b[den][key]:.2f} (paired: median {float(np.median(paired)):.2f}, "
            f"{paired[0]:.2f}-{paired[-1]:.2f})")


GATED = ("fused-int4", "fused-int8w", "fused-fp32")  # what the pipeline deploys for int4 / int8w / fp32 on the CPU


def report(results: dict, a: argparse.Namespace, bandwidth: float) -> None:
    keys = [f"decode_b{b}" for b in a.batches] + [f"ttft_{t}" for t in a.ttft_prompts]
    print(f"\nonnxruntime CPU, {a.threads} thread(s), greedy, best of {a.repeats} (engines taking turns); decode: "
          f"tokens/s after the first token, prompt {a.decode_prompt}, {a.new_tokens} new tokens; TTFT: ms, batch 1; "
          f"bound: weight bytes per step / {bandwidth / 1e9:.1f} GB/s (numpy reading 1 GiB on {a.threads} "
          "thread(s)), tokens/s at batch 1\n")
    print("| flavor | engine | " + " | ".join(k.replace("decode_b", "decode tok/s b").replace("ttft_", "TTFT ms p")
                                          for k in keys) + " | weights MB/step | bound tok/s | b1 / bound "
                                                           "| greedy = torch |")
    print("|---|---|" + "---|" * len(keys) + "---|---|---|---|")
    for flavor, res in results.items():
        for name, best in res["best"].items():
            cells = " | ".join(("-" if not best[k] else f"{best[k]:.1f}") if k.startswith("decode")
                               else f"{1e3 * best[k]:.1f}" for k in keys)
            agree = res["greedy_agreement_with_torch"].get(name)
            w = res["step_weight_bytes"].get(name)
            bound = bandwidth / w if w else None
            first = best.get(f"decode_b{a.batches[0]}")
            print(f"| {flavor} ({res['params'] / 1e6:.1f}M) | {name} | {cells} | "
                  f"{'-' if not w else f'{w / 1e6:.1f}'} | {'-' if not bound else f'{bound:.1f}'} | "
                  f"{'-' if not bound or not first else f'{first / bound:.2f}'} | "
                  f"{'-' if agree is None else f'{agree:.0%}'} |")
    print("\nratios (decode: llmpipe / peer, higher is better; TTFT: llmpipe / peer, lower is better); best of "
          f"{a.repeats} / best of {a.repeats}, then the median and range of the {a.repeats} paired ratios:")
    for flavor, res in results.items():
        parts = []
        for b in a.batches:
            key = f"decode_b{b}"
            gated = [g for g in GATED if g in res["best"]]
            if gated and "genai-int4" in res["best"]:
                top = max(gated, key=lambda g: res["best"][g][key])
                parts.append(f"fastest gated variant ({top})/genai-int4 b{b} {_ratio(res, top, 'genai-int4', key)}")
            for num, den in (("fused-int4", "genai-int4"), ("fused-int8w", "genai-int4"), ("static-int8", "genai-int4"),
                             ("fused-int4", "llamacpp-q8_0"), ("fused-int4", "llamacpp-q4_0"),
                             ("fused-int8w", "llamacpp-q8_0"),
                             ("fused-fp32", "genai-fp32"), ("static-fp32", "genai-fp32"), ("fused-fp32", "torch"),
                             ("static-fp32", "torch")):
                parts.append(f"{num}/{den} b{b} {_ratio(res, num, den, key)}")
        for t in a.ttft_prompts:
            for num, den in (("fused-fp32", "genai-fp32"), ("fused-int4", "genai-int4"), ("static-fp32", "genai-fp32")):
                parts.append(f"TTFT p{t} {num}/{den} {_ratio(res, num, den, f'ttft_{t}')}")
        print(f"  {flavor}:\n    " + "\n    ".join(parts))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    reason = fused.unavailable_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    bandwidth = memory_bandwidth(a.threads)
    print(f"  memory bandwidth ({a.threads} thread(s)): {bandwidth / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmpipe-deploy-peers-") as tmp:
        for flavor in ([a.hf.name] if a.hf else a.flavors.split(",")):
            folder = Path(tmp) / flavor
            folder.mkdir()
            results[flavor] = measure(flavor, a, folder)
    report(results, a, bandwidth)
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "memory_bandwidth": bandwidth,
                                      "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
