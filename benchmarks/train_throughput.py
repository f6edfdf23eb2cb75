"""Train-stage tokens/s against a bare PyTorch loop of the same model and batch, in the same run.

    python benchmarks/train_throughput.py [--flavor tiny] [--steps 30] [--repeats 3]

The bare loop does the same maths (AdamW, clipping, the same micro-batch and accumulation) on
pre-made tensors, with no data loading, metrics, evaluation or checkpointing. llmpipe's loop runs
in-process (world size 1) on memory-mapped shards with everything on, except that evaluation and
checkpoints fall outside the measured steps. Runs alternate to share the machine's noise; the
ratio of medians is printed. Goal: >= 0.97.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe.models.llama import Transformer, model_args  # noqa: E402
from llmpipe.optim import build_optimizer  # noqa: E402
from llmpipe.train import metrics  # noqa: E402
from llmpipe.train.loop import train  # noqa: E402
from tests.conftest import make_cfg, make_data_dir  # noqa: E402


def bare_loop(cfg, vocab: int, steps: int) -> float:
    """tokens/s of a plain forward/backward/clip/step loop (steady state: first step excluded)."""
    torch.manual_seed(cfg.run.seed)
    model = Transformer(model_args(cfg.model, vocab_size=vocab))
    model.init_weights(seed=cfg.run.seed)
    opt, sched = build_optimizer(model, cfg)
    t = cfg.train
    x = torch.randint(0, vocab, (t.grad_accum_steps, t.micro_batch_size, cfg.data.seq_len + 1))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for micro in range(t.grad_accum_steps):
            logits = model(x[micro, :, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[micro, :, 1:].flatten())
            (loss / t.grad_accum_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.optim.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        times.append(time.perf_counter() - t0)
    tokens = t.micro_batch_size * t.grad_accum_steps * cfg.data.seq_len
    return tokens / statistics.median(times[1:])


def llmpipe_loop(cfg, data_dir: Path, out: Path) -> float:
    train(cfg, data_dir, out)
    recs = [r for r in metrics.read(out / "metrics.jsonl") if "loss" in r]
    return statistics.median(r["tokens_per_s"] for r in recs[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocab, seq = 4096, 128
        data_dir = make_data_dir(tmp / "data", seq_len=seq, vocab=vocab, n_docs=2000)
        cfg = make_cfg(tmp, data={"seq_len": seq}, model={"flavor": a.flavor},
                       train={"micro_batch_size": 8, "grad_accum_steps": 2, "max_steps": a.steps,
                              "threads_per_proc": a.threads, "log_every": 10 ** 6,
                              "checkpoint": {"every_steps": 10 ** 6}, "eval": {"every_steps": 10 ** 6, "batches": 1}})
        ours, bare = [], []
        for i in range(a.repeats):
            bare.append(bare_loop(cfg, vocab, a.steps))
            ours.append(llmpipe_loop(cfg, data_dir, tmp / f"out{i}"))
            print(f"repeat {i}: bare {bare[-1]:.0f} tok/s, llmpipe {ours[-1]:.0f} tok/s")
    b, o = statistics.median(bare), statistics.median(ours)
    print(f"\n| loop | tokens/s (median of {a.repeats}) |\n|---|---|\n| bare PyTorch | {b:.0f} |\n"
          f"| llmpipe train | {o:.0f} |\n\nratio llmpipe / bare = {o / b:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
