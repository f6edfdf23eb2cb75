"""The training loop: build on meta, wrap, materialise, then step / accumulate / clip / scale.

Runs in every rank (under torchrun) or in-process with world size 1. Rank 0 writes metrics.jsonl,
TensorBoard events, checkpoints and summary.json into `out_dir`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llmpipe import debug, mfu
from llmpipe import device as dev
from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint import state as ckpt_state
from llmpipe.config import RunConfig
from llmpipe.data.chat import ChatShard
from llmpipe.data.sampler import GlobalBatchSampler
from llmpipe.data.shards import TokenShard
from llmpipe.device import Env
from llmpipe.errors import UserError
from llmpipe.models.llama import model_args
from llmpipe.optim import peak_lr, stable_until
from llmpipe.parallel import build_strategy
from llmpipe.train import faults, profile
from llmpipe.train.meter import Meter, compile_seconds
from llmpipe.train.metrics import MetricsWriter

log = logging.getLogger("llmpipe.train")


class TrainError(UserError, ValueError):
    """A training input the user can fix (seq_len against the shards or the model, the resume folder,
    an empty validation shard); one line, still a ValueError for the callers that catch one."""


def _env(cfg: RunConfig) -> Env:
    return dev.env(cfg.run.device, cfg.train.precision.dtype)


def _reported_mean(local: torch.Tensor | None, env: Env) -> torch.Tensor:
    """Mean over the ranks that saw a loss (all, or the last pipeline stage's); NaN when none did."""
    pair = torch.zeros(2, device=env.device, dtype=torch.float64)
    if local is not None:
        pair[0], pair[1] = local.double(), 1.0
    if env.world > 1:
        dist.all_reduce(pair, op=dist.ReduceOp.SUM)
    return pair[0] / pair[1] if pair[1] > 0 else torch.tensor(float("nan"))


def _batch(shard: TokenShard | ChatShard, indices: np.ndarray, seq_len: int, device: torch.device):
    """(inputs, targets, doc_ids) (B, T) each; doc_ids None but for packed conversations."""
    if isinstance(shard, ChatShard):
        return shard.batch(indices, device)
    rows = np.stack([shard.sample(int(i), seq_len) for i in indices])  # (B, T+1)
    t = torch.from_numpy(rows.astype(np.int64)).to(device, non_blocking=True)
    return t[:, :-1], t[:, 1:], None  # inputs (B, T), targets (B, T)


def _shards(data_dir: Path, data_meta: dict, cfg: RunConfig) -> tuple[TokenShard | ChatShard, TokenShard | ChatShard]:
    """The train and val shards: token windows, or conversations (data_meta's format chat: packed or
    padded per data.packing, padding with EOS whose targets are ignored)."""
    if data_meta.get("format", "text") != cfg.data.format:
        raise TrainError(f"data.format={cfg.data.format} but the data folder {data_dir} holds "
                         f"{data_meta.get('format', 'text')} shards")
    if cfg.data.format == "chat":
        return tuple(ChatShard(Path(data_dir) / name, cfg.data.seq_len, cfg.data.packing, data_meta["eos_id"])
                     for name in ("train.bin", "val.bin"))
    return TokenShard(Path(data_dir) / "train.bin"), TokenShard(Path(data_dir) / "val.bin")


IGNORE = -100  # a target F.cross_entropy leaves out: the padding of the last validation batches


def eval_indices(n: int, data_world: int, data_rank: int, mb: int) -> tuple[np.ndarray, np.ndarray]:
    """This data-parallel rank's share of validation samples 0..n-1 (every data_world-th), padded to
    whole micro-batches of `mb` so that every rank runs the same number of equal forwards (pipelines
    and FSDP need that): (sample indices, real mask). Padding repeats sample 0 and is masked out."""
    per_rank = -(-n // data_world)  # ceil
    slots = -(-per_rank // mb) * mb
    mine = np.arange(data_rank, n, data_world)
    real = np.zeros(slots, dtype=bool)
    real[:len(mine)] = True
    return np.concatenate([mine, np.zeros(slots - len(mine), dtype=mine.dtype)]), real


@torch.no_grad()
def evaluate(strategy, shard: TokenShard, cfg: RunConfig, env: Env) -> float:
    """Mean token loss over a fixed validation set (train.eval.samples, or batches x micro_batch_size:
    the first sequences of the val shard), whatever the layout: split across the data-parallel ranks,
    summed per token and divided by the tokens counted, so any split gives the same value up to
    summation order."""
    model = strategy.module
    model.eval()
    mb, T, e = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.train.eval
    n = min(shard.num_samples(T), e.samples or e.batches * mb)
    if n == 0:
        raise TrainError(f"the validation shard holds no sample of seq_len {T}")
    indices, real = eval_indices(n, strategy.data_world, strategy.data_rank, mb)
    total = torch.zeros(2, device=env.device, dtype=torch.float64)  # (sum of token losses, tokens)
    for i in range(0, len(indices), mb):
        x, y, doc_ids = _batch(shard, indices[i:i + mb], T, env.device)
        y = y.clone()  # a view of the same rows as x
        y[torch.from_numpy(~real[i:i + mb]).to(y.device)] = IGNORE
        loss_sum = strategy.eval_loss_sum(x, y) if doc_ids is None else strategy.eval_loss_sum(x, y, doc_ids)
        if loss_sum is not None:  # None on a pipeline stage without the loss
            total[0] += loss_sum.double()
            total[1] += int((y != IGNORE).sum())
    if env.world > 1:
        dist.all_reduce(total)  # tp ranks count the same samples alike: the mean is unchanged
    model.train()
    return float(total[0] / total[1].clamp(min=1))


def _resume_folder(cfg: RunConfig, ckpt_root: Path) -> Path | None:
    r = cfg.train.checkpoint.resume
    if r is False or r in ("false", "never"):
        return None
    if r is True or r == "auto":
        return ckpt.latest_valid(ckpt_root)
    folder = Path(r)
    problem = ckpt.verify(folder)
    if problem:
        raise TrainError(f"train.checkpoint.resume: {problem}")
    step = ckpt.read_meta(folder).get("step")
    if isinstance(step, int) and step > cfg.train.max_steps:
        raise TrainError(f"train.checkpoint.resume: {folder} is at step {step}, past train.max_steps="
                         f"{cfg.train.max_steps}")
    return folder


def _restore(folder: Path, strategy, cfg: RunConfig) -> tuple[int, int]:
    state = ckpt_state.restore(folder, strategy, dist_world())  # own format or resharded, per meta.json
    retune(strategy, cfg)
    log.info("resumed from %s (step %d)", folder, state["step"])
    return int(state["step"]), int(state["consumed_samples"])


def dist_world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def retune(strategy, cfg: RunConfig) -> None:
    """After loading a checkpoint, the optimizer's hyperparameters and the lr schedule are this run's
    config's, not the checkpoint's: a warm start may have changed lr, betas, weight decay or the
    horizon (max_steps). For an unchanged config this recomputes the very values the checkpoint
    holds (the same expression LambdaLR uses), so an exact resume stays exact."""
    o = cfg.train.optim
    peak = peak_lr(cfg, dist.get_world_size() if dist.is_initialized() else 1)
    for opt, sched in strategy.optimizers():
        sched.base_lrs = [peak] * len(opt.param_groups)
        for group, factor in zip(opt.param_groups, sched.lr_lambdas):
            # decay groups: matrices (llmpipe's rule); ZeRO's flat partitions keep what they had
            decays = (group["weight_decay"] > 0 if strategy.flat_param_groups
                      else any(p.ndim >= 2 for p in group["params"]))
            group.update(betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay if decays else 0.0,
                         initial_lr=peak, lr=peak * factor(sched.last_epoch))
        sched._last_lr = [g["lr"] for g in opt.param_groups]


def _saver(cfg: RunConfig, env: Env, strategy, out_dir: Path, data_dir: Path | None = None) -> ckpt.Saver:
    """Every rank's checkpoint saver (collective: makes the asynchronous saves' process group); each
    step folder carries the resolved config and data_dir's tokenizer (ckpt_state.describe)."""
    c = cfg.train.checkpoint
    asynchronous = c.async_save and strategy.format == "dcp" and dist.is_initialized()
    if c.async_save and not asynchronous and env.main:
        log.info("train.checkpoint.async_save: format %r (train.parallel.data=%s%s) saves synchronously; "
                 "asynchronous saves need format 'dcp' (every layout but ZeRO) under torchrun",
                 strategy.format, cfg.train.parallel.data, "" if dist.is_initialized() else ", in-process")
    return ckpt.Saver(out_dir / "checkpoints", env.rank, env.world, c.keep_last, asynchronous,
                      protect=stable_until(cfg), describe=ckpt_state.describe(cfg, data_dir))


def _save(saver: ckpt.Saver, step: int, consumed: int, strategy, args, env: Env, writer: MetricsWriter) -> None:
    """Checkpoint `step`; metrics.jsonl gets the seconds the step loop was blocked by it."""
    meta = ckpt_state.meta(strategy.train_state(), env.world, args, consumed, type(strategy).__name__)
    kw = {"asynchronous": True, "group": saver.group} if saver.asynchronous else {}
    stall = saver.save(step, lambda f: strategy.write_checkpoint(f, ckpt_state.counters(step, consumed), **kw), meta)
    writer.step({"step": step, "checkpoint_stall_s": stall, "checkpoint_async": int(saver.asynchronous)})


def _build(cfg: RunConfig, env: Env, vocab_size: int):
    """The layout's strategy with its model, optimizer and schedule (llmpipe.parallel.build_strategy:
    one builder, one order, every layout)."""
    args = model_args(cfg.model, vocab_size=vocab_size)
    if cfg.data.seq_len > args.max_seq_len:
        raise TrainError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len={args.max_seq_len}")
    return build_strategy(cfg, env, args), args


def _start_checks(cfg: RunConfig, env: Env, strategy) -> None:
    """train.debug at start: replicas' parameters compared (the NaN guard is the strategies' own)."""
    d = cfg.train.debug
    faults.install()  # test-only fault injection, armed by its environment variables (llmpipe.debug)
    if not strategy.supports_replica_checks:
        if d.check_init_params or d.check_grad_consistency_every:
            log.warning("train.debug replica checks are not available with data=zero (DeepSpeed partitions); skipped")
        return
    faults.after_build(strategy, env.rank)  # test-only: nothing unless installed
    if d.check_init_params:
        n = debug.check_replicas(strategy.named_parameters(), strategy.replica_group(), "initial parameters", 0)
        if env.main:
            log.info("check_init_params: %d replicated parameter tensors equal on every data-parallel rank", n)


def _set_threads(cfg: RunConfig, env: Env) -> None:
    if env.device.type != "cpu":
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world))
    torch.set_num_threads(cfg.train.threads_per_proc or max(1, (os.cpu_count() or 1) // local))


def train(cfg: RunConfig, data_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Train per cfg.train on the shards in `data_dir`; outputs go to `out_dir`. Returns a summary."""
    env = _env(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev.set_current(env.device)
    _set_threads(cfg, env)
    torch.manual_seed(cfg.run.seed)
    data_meta = json.loads((Path(data_dir) / "data_meta.json").read_text())
    if data_meta["seq_len"] != cfg.data.seq_len:
        raise TrainError(f"data.seq_len={cfg.data.seq_len} but the shards were packed for {data_meta['seq_len']}")
    train_shard, val_shard = _shards(Path(data_dir), data_meta, cfg)
    strategy, args = _build(cfg, env, data_meta["vocab_size"])
    _start_checks(cfg, env, strategy)
    t = cfg.train
    sampler = GlobalBatchSampler(train_shard.num_samples(cfg.data.seq_len), t.micro_batch_size,
                                 t.grad_accum_steps, strategy.data_world, cfg.run.seed)
    start, consumed = 0, 0
    folder = _resume_folder(cfg, Path(out_dir) / "checkpoints")
    if folder is not None:
        start, consumed = _restore(folder, strategy, cfg)
    # Nothing left to train (max_steps 0, or a checkpoint at max_steps resumed): what was loaded is the
    # result, saved as this folder's final checkpoint unless it is that one already (a resumed attempt).
    final = ckpt.step_dir(Path(out_dir) / "checkpoints", start)
    save_start = start == t.max_steps and (folder is None or Path(folder).resolve() != final.resolve())
    if save_start and folder is not None and env.main:
        log.info("%s is at train.max_steps=%d: nothing left to train; saved as %s", folder, start, final)
    if env.main:
        (Path(out_dir) / "model_config.json").write_text(json.dumps({"model": args.to_dict()}, indent=2) + "\n")
    writer = MetricsWriter(Path(out_dir), enabled=env.main, resume_step=start)
    loop = _Loop(cfg, env, args, strategy, sampler, train_shard, val_shard, writer)
    try:
        summary = loop.run(start, consumed, Path(out_dir), save_start)
    finally:
        writer.close()
        strategy.close()
    summary["restarts"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's in-place restarts
    if env.main:
        (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def nan_policy(rec: dict[str, Any], d) -> None:
    """train.debug's policy for a step that went non-finite, after it (the part before the update,
    gradients with a NaN or Inf under nan_guard, is the strategies' Strategy.guard_nonfinite): an fp16
    loss scale below 1 warns, below loss_scale_stop_below stops; a non-finite loss stops unless
    nan_guard=skip (which dropped that update)."""
    scale, step, loss = rec.get("loss_scale"), rec["step"], rec["loss"]
    if scale is not None and scale < 1.0:
        log.warning("fp16 loss scale fell to %g (< 1): gradients keep overflowing; consider bf16 or a lower lr", scale)
    if scale is not None and d.loss_scale_stop_below is not None and scale < d.loss_scale_stop_below:
        raise debug.Diverged(f"step {step}: fp16 loss scale {scale:g} fell below "
                             f"train.debug.loss_scale_stop_below={d.loss_scale_stop_below:g}")
    if not math.isfinite(loss) and d.nan_guard != "skip":
        raise debug.Diverged(f"loss is {loss} at step {step}")


class _Loop:
    """The step loop: `train_step` (the micro-steps and the optimizer step), timed by a Meter, then
    `after_step` (metrics, log, NaN policy, eval, checkpoint, profiler); their shared state in one place."""

    def __init__(self, cfg, env, args, strategy, sampler, train_shard, val_shard, writer):
        self.cfg, self.env, self.args, self.strategy = cfg, env, args, strategy
        self.sampler, self.train_shard, self.val_shard, self.writer = sampler, train_shard, val_shard, writer
        t = cfg.train
        self.tokens_per_step = sampler.global_batch * cfg.data.seq_len
        # one device's peak (a CPU's is measured once per machine, or read from the stage's measurement)
        self.peak = mfu.resolve_peak(env.device, env.precision, t.peak_tflops,
                                     mfu.calibration_dir(cfg.run.artifacts_dir))
        self.peak_flops = self.peak.tflops * 1e12 * env.world if self.peak.tflops else None  # the job's
        self.flops_per_token = mfu.flops_per_token(args, cfg.data.seq_len)
        if env.main:
            log.info("MFU against %s", f"{self.peak.tflops:.4g} TFLOPS per device x {env.world}: {self.peak.source}"
                     if self.peak.tflops else f"nothing (mfu n/a): {self.peak.source}")
        self.first_step, self.saver, self.meter, self.prof = 0, None, None, None  # set by run()

    def train_step(self, step: int, consumed: int) -> dict[str, Any]:
        """Optimizer step `step + 1`: grad_accum_steps micro-steps (forward + backward), then clip /
        scale / step; returns its record: loss (mean over the ranks that saw one), lr, gradient norm."""
        t, env, strategy = self.cfg.train, self.env, self.strategy
        lr = strategy.lr()
        total, seen = torch.zeros((), device=env.device), False
        scale = self._loss_scale(consumed)
        for micro in range(t.grad_accum_steps):
            with profile.mark(profile.DATA):
                x, y, doc_ids = _batch(self.train_shard,
                                       self.sampler.micro_batch_indices(consumed, micro, strategy.data_rank),
                                       self.cfg.data.seq_len, env.device)
            # Gradient sync is skipped on all but the last micro-step, except where the strategy
            # needs the first step of a process synchronous (DDP static_graph).
            sync = micro == t.grad_accum_steps - 1 or (strategy.sync_first_step and step == self.first_step)
            with strategy.micro_context(sync), profile.mark(profile.FORWARD_BACKWARD):
                loss = strategy.forward_backward(x, y) if scale is None else \
                    strategy.forward_backward(x, y, doc_ids=doc_ids, scale=scale)
            if loss is not None:  # None on a pipeline stage without the loss
                total, seen = total + loss, True
        local = total / t.grad_accum_steps if seen else None
        faults.before_optimizer_step(strategy, step + 1, env.rank)  # test-only: nothing unless installed
        self._check_grads(step + 1)
        with profile.mark(profile.OPTIMIZER):
            grad_norm = strategy.step(step + 1)
        return {"step": step + 1, "loss": float(_reported_mean(local, env)), "lr": lr, "grad_norm": grad_norm}

    def _loss_scale(self, consumed: int) -> float | None:
        """Chat: data-parallel ranks x accumulation steps / the targets of the whole step (every rank counts
        them from the sampler alone, no communication), so the step's loss is the mean over its targets;
        None for text, whose every micro-batch has the same number of targets (its mean loss as before)."""
        if not isinstance(self.train_shard, ChatShard):
            return None
        targets = int(self.train_shard.targets[self.sampler.positions(consumed, self.sampler.global_batch)].sum())
        return self.strategy.data_world * self.cfg.train.grad_accum_steps / max(targets, 1)

    def _check_grads(self, done: int) -> None:
        """train.debug.check_grad_consistency_every: the replicas' synchronised gradients compared."""
        every, strategy = self.cfg.train.debug.check_grad_consistency_every, self.strategy
        if strategy.supports_replica_checks and every and done % every == 0:
            grads = [(n, p.grad) for n, p in strategy.named_parameters()]
            debug.check_replicas(grads, strategy.replica_group(), "synchronised gradients", done)

    def after_step(self, rec: dict[str, Any], timing: dict[str, Any], extra: dict[str, Any], consumed: int) -> None:
        """Between two steps: the metrics record (the step's, its timing and extras), the log line, the
        NaN policy, eval and checkpoint at their cadences, the profiler's step."""
        t, done = self.cfg.train, rec["step"]
        rec.update(timing)
        scale = self.strategy.loss_scale()
        if scale is not None:
            rec["loss_scale"] = scale
        rec.update(extra)
        if self.strategy.skipped:
            rec["skipped"] = True
        self.writer.step(rec)
        if self.env.main and (done % t.log_every == 0 or done == t.max_steps or done == self.first_step + 1):
            log.info("step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  mfu %s", done, t.max_steps,
                     rec["loss"], rec["lr"], rec["grad_norm"], rec["tokens_per_s"],
                     "n/a" if rec["mfu"] is None else f"{100 * rec['mfu']:.2f}%")
        nan_policy(rec, t.debug)
        if done % t.eval.every_steps == 0 and done != t.max_steps:
            self._eval(done)
        if done % t.checkpoint.every_steps == 0 or done == t.max_steps:
            _save(self.saver, done, consumed, self.strategy, self.args, self.env, self.writer)
        self.prof.step()

    def _eval(self, step: int) -> float:
        val = evaluate(self.strategy, self.val_shard, self.cfg, self.env)
        self.writer.eval(step, val)
        if self.env.main:
            log.info("step %d: val_loss %.4f  val_ppl %.2f", step, val, math.exp(min(val, 50)))
        return val

    def run(self, start: int, consumed: int, out_dir: Path, save_start: bool = False) -> dict[str, Any]:
        """Train steps start+1 ... max_steps; `save_start`: checkpoint the state at `start` (= max_steps) as is."""
        t = self.cfg.train
        self.first_step = start
        self.saver = _saver(self.cfg, self.env, self.strategy, out_dir, self.train_shard.bin_path.parent)
        val0 = self._eval(start)
        self.meter = Meter(self.env, self.tokens_per_step, self.flops_per_token, self.peak_flops)
        rec = {"loss": float("nan")}
        with profile.StepProfiler(self.cfg, self.env, out_dir, self.tokens_per_step, self.flops_per_token,
                                  self.peak_flops, first_step=start) as self.prof:
            for step in range(start, t.max_steps):
                self.meter.start()
                rec = self.train_step(step, consumed)
                consumed += self.sampler.global_batch
                self.after_step(rec, *self.meter.stop(self.strategy, step + 1), consumed)
            if save_start:  # max_steps 0: the initial (e.g. pretrained) weights; or the resumed final checkpoint
                _save(self.saver, start, consumed, self.strategy, self.args, self.env, self.writer)
        self.saver.wait()  # the last asynchronous save
        val = self._eval(t.max_steps) if t.max_steps > start else val0
        return self._summary(start, rec["loss"], val0, val)

    def _summary(self, start: int, loss: float, val0: float, val: float) -> dict[str, Any]:
        t, env, m = self.cfg.train, self.env, self.meter.summary()
        return {"steps": t.max_steps, "resumed_from": start, "final_loss": loss, "val_loss_start": val0,
                "val_loss": val, "val_ppl": math.exp(min(val, 50)), "world_size": env.world,
                "global_batch": self.sampler.global_batch, "tokens_per_step": self.tokens_per_step,
                "tokens_per_s": m["tokens_per_s"], "mfu": m["mfu"],
                "peak_tflops": self.peak.tflops, "peak_source": self.peak.source,  # per device
                "wall_s": m["wall_s"], "params": self.args.num_params(),
                "peak_memory_bytes": dev.peak_memory_bytes(env.device),
                "compile_time_s": compile_seconds() if t.compile else None}
