"""Serving under concurrent load: `llmpipe serve` with continuous batching vs the same server with batching
off (--max-batch 1: one request at a time), and the server over HTTP vs `llmpipe generate`'s engine in
process, side by side in one run, as ratios.

It builds a run of the given flavor with random-init weights (speed does not depend on the values;
the output rows of eos give logit 0, so every request generates exactly --new tokens): consolidate's and
export_onnx's folders (prefill + static decoder), a tokenizer trained on this checkout's docs/. A fixed,
seeded set of prompts (--prompt-tokens each, cut from docs/) is sent by C client threads at
concurrency C (each sends its next request when the last one ended), streamed (SSE) with usage:

    output tokens/s   completion tokens of all requests / wall time from the first send to the last end
    TTFT              from a request's send to its first streamed text chunk (p50, p99)
    TPOT              (end - first chunk) / (tokens - 1), per request (p50)

The in-process baseline runs the same prompts one after another through open_run's engine and
llmpipe.infer.decode.generate (what `llmpipe generate` does, without printing). Both servers stay up and
the measurements are repeated in turn (medians), so a machine whose load drifts shifts them alike.

    python benchmarks/serve.py --flavor small --requests 8 --new 32
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

# NOTE: lets `python benchmarks/serve.py` run from a checkout without installing llmpipe.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from llmpipe.bench.serving import LocalServer, one_request, run_load  # noqa: E402
from llmpipe.data.tokenizer import train_tokenizer  # noqa: E402
from llmpipe.export import onnx as export  # noqa: E402
from llmpipe.manifest import Manifest, file_entry  # noqa: E402
from llmpipe.models.llama import FLAVORS, Transformer  # noqa: E402
from llmpipe.models.llama import io as model_io  # noqa: E402
from llmpipe.stages import stage_dir  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="small")
    p.add_argument("--cache", type=int, default=512, help="static decoder cache slots")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=16, help="requests per measurement")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new", type=int, default=64, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians reported)")
    return p.parse_args(argv)


def _publish(folder: Path, stage: str, outputs: dict[str, str], **metrics) -> None:
    Manifest(stage, "completed", "bench", {k: file_entry(folder, v) for k, v in outputs.items()},
             metrics=metrics).write(folder)


def build_run(run: Path, flavor: str, cache: int, text: str) -> None:
    tok = train_tokenizer([text], vocab_size=4096)
    args = replace(FLAVORS[flavor], vocab_size=tok.get_vocab_size(), max_seq_len=max(cache, 64))
    model = Transformer(args)
    model.init_weights(seed=0)
    with torch.no_grad():
        model.output.weight[tok.token_to_id("<|endoftext|>")] = 0.0  # never the argmax: no early end
    model.eval()
    folder = stage_dir(run, "consolidate")
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if "freqs" not in k},
              str(folder / model_io.WEIGHTS))
    model_io.write_args(folder, args, "float32")
    tok.save(str(folder / model_io.TOKENIZER))
    _publish(folder, "consolidate", {"model": model_io.WEIGHTS, "model_config": model_io.CONFIG,
                                     "tokenizer": model_io.TOKENIZER})
    folder = stage_dir(run, "export_onnx")
    folder.mkdir(parents=True)
    export.export_prefill(model, folder / "model.onnx", opset=17)
    export.export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=cache)
    _publish(folder, "export_onnx", {"model": "model.onnx", "decoder_static": "decoder_static.onnx"},
             static_decoder_cache_len=cache)


def prompts(tok, text: str, n: int, length: int, seed: int) -> list[str]:
    ids = tok.encode(text).ids
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, n)
    return [tok.decode(ids[s:s + length]) for s in starts]


def load(url: str, model: str, texts: list[str], concurrency: int, new: int) -> dict:
    """llmpipe.bench.serving's closed-loop load (what `llmpipe bench serve` runs), after one warm-up request."""
    with httpx.Client(base_url=url, timeout=600) as http:
        one_request(http, model, texts[0], 4)
    r = run_load(url, model, texts, concurrency, new)
    return {"tokens_per_s": r.output_tokens_per_s, "ttft_p50": r.ttft_ms["p50"] / 1e3,
            "ttft_p99": r.ttft_ms["p99"] / 1e3, "tpot_p50": r.tpot_ms["p50"] / 1e3}


class InProcess:
    """The same prompts one after another through open_run's engine (what `llmpipe generate` runs)."""

    def __init__(self, run: Path, texts: list[str]):
        from llmpipe.tools.generate import open_run

        self.loaded = open_run(run, "fp32")
        self.ids = [np.array([self.loaded.tokenizer.encode(t).ids]) for t in texts]

    def measure(self, new: int) -> dict:
        from llmpipe.infer.decode import generate
        from llmpipe.tools.generate import pick_greedy

        generate(self.loaded.engine, self.ids[0], 4, pick_greedy)
        t0, tokens, ttft = time.perf_counter(), 0, []
        for x in self.ids:
            g = generate(self.loaded.engine, x, new, pick_greedy, stop_id=self.loaded.eos_ids)
            tokens += g.tokens.shape[1]
            ttft.append(g.ttft_s)
        return {"tokens_per_s": tokens / (time.perf_counter() - t0), "ttft_p50": float(np.median(ttft))}


def _median_rows(samples: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in samples])) for k in samples[0]}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))  # (the README's text moved here)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "bench"
        t = time.perf_counter()
        build_run(run, a.flavor, a.cache, text)
        from llmpipe.data.tokenizer import load_tokenizer

        tok = load_tokenizer(stage_dir(run, "consolidate") / model_io.TOKENIZER)
        texts = prompts(tok, text, a.requests, a.prompt_tokens, a.seed)
        print(f"flavor {a.flavor}, cache {a.cache}, {a.requests} requests of {a.prompt_tokens} prompt tokens, "
              f"{a.new} new tokens each, greedy; medians of {a.repeats} interleaved repeats "
              f"(built in {time.perf_counter() - t:.0f} s)", flush=True)
        # NOTE: both servers stay up (an idle one waits on a condition, using no CPU) and every measurement
        # is repeated in turn, so a machine whose load drifts shifts all of them alike.
        with contextlib.ExitStack() as stack:
            servers = {mode: stack.enter_context(LocalServer(run, "fp32", batch, Path(tmp) / f"{batch}.log",
                                                             ["--allow-ungated"]))
                       for mode, batch in (("batching", max(levels)), ("one at a time", 1))}
            local = InProcess(run, texts)
            samples: dict = {}
            for _ in range(a.repeats):
                for c in levels:
                    for mode, server in servers.items():
                        samples.setdefault((mode, c), []).append(load(server.url, "bench/fp32", texts, c, a.new))
                samples.setdefault("local", []).append(local.measure(a.new))
    rows = {k: _median_rows(v) for k, v in samples.items()}
    for mode in servers:
        for c in levels:
            r = rows[mode, c]
            print(f"  {mode:>13} c={c}: {r['tokens_per_s']:7.1f} tokens/s  TTFT p50 {1e3 * r['ttft_p50']:7.1f} ms "
                  f"p99 {1e3 * r['ttft_p99']:7.1f} ms  TPOT p50 {1e3 * r['tpot_p50']:6.2f} ms")
    local = rows["local"]
    print(f"  in-process generate c=1: {local['tokens_per_s']:7.1f} tokens/s  TTFT p50 "
          f"{1e3 * local['ttft_p50']:.1f} ms")
    lo, hi = min(levels), max(levels)
    b = lambda c: rows["batching", c]
    print(f"tokens/s at c={hi} / c={lo}, continuous batching: {b(hi)['tokens_per_s'] / b(lo)['tokens_per_s']:.2f}x "
          "(goal >= 4)")
    print(f"tokens/s at c={hi}, batching / one at a time: "
          f"{b(hi)['tokens_per_s'] / rows['one at a time', hi]['tokens_per_s']:.2f}x")
    print(f"TTFT p99 at c={hi} / TTFT p50 at c={lo}: {b(hi)['ttft_p99'] / b(lo)['ttft_p50']:.2f}x (goal <= 3)")
    print(f"tokens/s over HTTP streaming / in-process generate, c={lo}: "
          f"{b(lo)['tokens_per_s'] / local['tokens_per_s']:.2f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
