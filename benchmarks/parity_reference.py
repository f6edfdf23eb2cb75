"""Export parity's PyTorch reference: greedy decoding with the KV cache (llmpipe.infer.decode.greedy_reference,
what export_onnx compares every engine with) against the full-sequence re-run per token it replaced.

    python benchmarks/parity_reference.py [--flavors tiny,smollm2-135m] [--new-tokens 64] [--prompt 16]

Random weights (time does not depend on the values); batch 1 and 2 as engine_parity runs them. Both ways
run in the same process, taking turns; printed: each one's wall and CPU seconds, the ratio full / cached, and
whether the two chose the same tokens (they must: the same model, two ways of running it).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe.infer.decode import greedy_reference  # noqa: E402
from llmpipe.models.llama.flavors import FLAVORS  # noqa: E402
from llmpipe.models.llama.model import Transformer  # noqa: E402


def full_reference(model: Transformer, ids: np.ndarray, n: int) -> np.ndarray:
    """The former reference: the whole sequence re-run for every generated token."""
    seq = torch.from_numpy(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    return seq[:, ids.shape[1]:].numpy()


def timed(fn, *fn_args):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*fn_args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavors", default="tiny,smollm2-135m")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for flavor in a.flavors.split(","):
        args = replace(FLAVORS[flavor], max_seq_len=a.prompt + a.new_tokens + 8)
        model = Transformer(args)
        model.init_weights(seed=0)
        model.eval()
        rows = {"cached": [0.0, 0.0], "full": [0.0, 0.0]}
        same = True
        for batch in (1, 2):
            ids = np.random.default_rng(batch).integers(0, args.vocab_size, (batch, a.prompt))
            (cached, _), w1, c1 = timed(greedy_reference, model, ids, a.new_tokens)
            full, w2, c2 = timed(full_reference, model, ids, a.new_tokens)
            rows["cached"][0] += w1
            rows["cached"][1] += c1
            rows["full"][0] += w2
            rows["full"][1] += c2
            same &= bool((cached == full).all())
        print(f"{flavor} ({args.num_params() / 1e6:.1f}M), prompt {a.prompt}, {a.new_tokens} new tokens, batch 1+2: "
              f"cached {rows['cached'][0]:.2f}s wall / {rows['cached'][1]:.2f}s cpu, full re-run "
              f"{rows['full'][0]:.2f}s wall / {rows['full'][1]:.2f}s cpu, ratio full/cached "
              f"{rows['full'][0] / rows['cached'][0]:.1f}x wall, {rows['full'][1] / rows['cached'][1]:.1f}x cpu, "
              f"same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
