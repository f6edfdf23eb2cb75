"""Training tokens/s of llmpipe's train loop against a plain loop over transformers' LlamaForCausalLM
of the same shape, initial weights, dtype (fp32, CPU), batches, AdamW settings and thread count.

    python benchmarks/train_vs_hf.py [--flavors tiny small] [--steps N] [--threads N]

llmpipe: `llmpipe.train.loop.train` in-process (world size 1: DDPStrategy's plain module, as the
train stage runs one rank) on memory-mapped shards, with metrics, clipping, AdamW and the lr schedule
on; evaluation and the final checkpoint fall outside the measured steps. Its step times are its own
(metrics.jsonl). HF: LlamaForCausalLM(attn_implementation="sdpa") holding the same initial weights
(llmpipe.models.llama.hf names), the loop's micro-batches pre-made as tensors, a token-mean
cross-entropy on the logits, clip_grad_norm_ and torch AdamW with the same hyperparameters and
parameter groups (decay on matrices only), torch's defaults otherwise (on CPU: the single-tensor
AdamW loop; --hf-adamw fused gives it the fused AdamW llmpipe uses on CPU, which leaves the model and
the loop as the only difference).

The two run in pairs: each time llmpipe's loop logs a step, one HF step runs on the same batch
(a metrics-writer hook), so load from other work on a shared machine hits both alike. Steady state:
the first --warmup pairs are dropped. Reported per flavor: median tokens/s of each, their ratio, the
spread of the per-pair ratios (quartiles: the noise), and the same ratio in process CPU time (less
sensitive to other processes taking the cores). The first-step losses must agree (same weights, same
batch), or the run stops. Goal: llmpipe / HF >= 1.0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe.data.sampler import GlobalBatchSampler  # noqa: E402
from llmpipe.data.shards import TokenShard  # noqa: E402
from llmpipe.models.llama import Transformer, model_args  # noqa: E402
from llmpipe.models.llama.hf import hf_config, to_hf_name  # noqa: E402
from llmpipe.train import loop, metrics  # noqa: E402
from tests.conftest import make_cfg, make_data_dir  # noqa: E402

SEQ, VOCAB = 256, 8192
# micro-batch and default steps per flavor: about a minute per flavor on 2 free cores
SHAPES = {"tiny": (8, 24), "small": (2, 12)}


def config(tmp: Path, flavor: str, steps: int, threads: int):
    never = 10 ** 6
    return make_cfg(tmp, data={"seq_len": SEQ}, model={"flavor": flavor},
                    train={"micro_batch_size": SHAPES[flavor][0], "grad_accum_steps": 1, "max_steps": steps,
                           "threads_per_proc": threads, "log_every": never, "schedule": {"warmup_steps": 2},
                           "checkpoint": {"every_steps": never}, "eval": {"every_steps": never, "batches": 1}})


def batches(cfg, data_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, targets) micro-batches llmpipe's loop reads, in its order (its sampler and shard)."""
    t, seq = cfg.train, cfg.data.seq_len
    shard = TokenShard(data_dir / "train.bin")
    sampler = GlobalBatchSampler(shard.num_samples(seq), t.micro_batch_size, t.grad_accum_steps, 1, cfg.run.seed)
    out = []
    for step in range(t.max_steps):
        idx = sampler.micro_batch_indices(step * sampler.global_batch, 0, 0)
        rows = torch.from_numpy(np.stack([shard.sample(int(i), seq) for i in idx]).astype(np.int64))
        out.append((rows[:, :-1], rows[:, 1:]))  # (B, T) each
    return out


class HFLoop:
    """A plain training loop over LlamaForCausalLM holding llmpipe's initial weights for cfg.run.seed."""

    def __init__(self, cfg, data: list, vocab: int, adamw: str = "default"):
        from transformers import LlamaConfig, LlamaForCausalLM

        args = model_args(cfg.model, vocab_size=vocab)
        ours = Transformer(args)
        ours.init_weights(seed=cfg.run.seed)
        conf = LlamaConfig(**{k: v for k, v in hf_config(args, "fp32").items() if k != "architectures"},
                           attn_implementation="sdpa")
        self.model = LlamaForCausalLM(conf)
        self.model.load_state_dict({to_hf_name(k): v for k, v in ours.state_dict().items()}, strict=True)
        self.model.train()
        o = cfg.train.optim
        self.params, self.clip = list(self.model.parameters()), o.clip_grad_norm
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=True if adamw == "fused" else None)
        self.data, self.wall, self.cpu, self.first_loss = data, [], [], None

    def step(self, i: int) -> None:
        x, y = self.data[i]
        w0, c0 = time.perf_counter(), time.process_time()
        logits = self.model(input_ids=x).logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.wall.append(time.perf_counter() - w0)
        self.cpu.append(time.process_time() - c0)
        if self.first_loss is None:
            self.first_loss = loss.item()


def paired_run(cfg, data_dir: Path, out: Path, hf: HFLoop) -> tuple[list[float], list[float], float]:
    """llmpipe's train() with one HF step after each of its steps: llmpipe's (wall, CPU) seconds per
    step and its first loss. llmpipe's CPU time of a step: from the end of the HF step before it to
    the metrics record of its own (the loop's bookkeeping between steps included)."""
    cpu, mark = [], [time.process_time()]

    class Paired(metrics.MetricsWriter):
        def step(self, rec):
            super().step(rec)
            if "loss" in rec:  # a training step (checkpoint stalls are logged too)
                cpu.append(time.process_time() - mark[0])
                hf.step(rec["step"] - 1)
                mark[0] = time.process_time()

    # NOTE: the hook runs after the loop has taken its step time, so llmpipe's numbers exclude HF's step.
    with mock.patch.object(loop, "MetricsWriter", Paired):
        loop.train(cfg, data_dir, out)
    recs = [r for r in metrics.read(out / metrics.METRICS) if "loss" in r]
    return [r["step_time_s"] for r in recs], cpu, recs[0]["loss"]


def _q(values: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{q1:.3f}-{q3:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=None, help="pairs per flavor (default: per flavor)")
    p.add_argument("--warmup", type=int, default=3, help="pairs dropped at the start")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--hf-adamw", choices=["default", "fused"], default="default",
                   help="the HF loop's AdamW: torch's default for CPU (the per-tensor loop), or the fused one "
                        "llmpipe uses on CPU (isolates the model and loop from the optimizer)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for flavor in a.flavors:
            mb, steps = SHAPES[flavor][0], a.steps or SHAPES[flavor][1]
            cfg = config(tmp / flavor, flavor, steps, a.threads)
            data_dir = make_data_dir(tmp / flavor / "data", seq_len=SEQ, vocab=VOCAB, n_docs=1000)
            hf = HFLoop(cfg, batches(cfg, data_dir), VOCAB, a.hf_adamw)
            wall, cpu, loss = paired_run(cfg, data_dir, tmp / flavor / "out", hf)
            if abs(loss - hf.first_loss) > 1e-4:
                raise SystemExit(f"{flavor}: first-step losses differ (llmpipe {loss}, HF {hf.first_loss}): "
                                 "not the same model or batch")
            w = a.warmup
            tokens = mb * SEQ
            ours, theirs = tokens / statistics.median(wall[w:]), tokens / statistics.median(hf.wall[w:])
            pairs = [h / o for o, h in zip(wall[w:], hf.wall[w:])]
            cpu_ratio = statistics.median(hf.cpu[w:]) / statistics.median(cpu[w:])
            rows.append((flavor, mb, ours, theirs, ours / theirs, _q(pairs), cpu_ratio))
            print(f"{flavor}: first-step loss llmpipe {loss:.6f}, HF {hf.first_loss:.6f}; step s llmpipe "
                  f"{' '.join(f'{t:.2f}' for t in wall)}; HF {' '.join(f'{t:.2f}' for t in hf.wall)}", flush=True)
    print(f"\nCPU fp32, {a.threads} threads, 1 process, seq_len {SEQ}, vocab {VOCAB}; median of the steady "
          f"pairs (first {a.warmup} dropped); HF's AdamW: {a.hf_adamw}\n")
    print("| flavor | micro-batch | llmpipe tok/s | HF tok/s | ratio | per-pair ratio, quartiles | "
          "ratio in CPU time | goal |")
    print("|---|---|---|---|---|---|---|---|")
    for flavor, mb, ours, theirs, ratio, quartiles, cpu_ratio in rows:
        print(f"| {flavor} | {mb} | {ours:.0f} | {theirs:.0f} | {ratio:.3f} | {quartiles} | {cpu_ratio:.3f} | >= 1.0 |")


if __name__ == "__main__":
    main()
