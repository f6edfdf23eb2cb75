"""The strategy interface: what the training loop drives, and nothing more.

A strategy owns one layout: how its model (built by llmpipe.parallel.builder), gradients and
optimizer (llmpipe.optim) are held, synchronised and stepped. Every strategy gets its `parts` (a list,
also without pipeline parallel), optimizers, schedules and scaler from one composer
(llmpipe.parallel.compose) and exposes them for checkpoints as a `TrainState`; llmpipe.checkpoint.state
writes and reads it. Strategies: MeshStrategy (dp x tp x pp with FSDP2 or `replicate` on dp; size-1
dimensions are no-ops, so FSDP2 alone is one), DDPStrategy (torch DDP and its knobs: buckets,
static_graph, comm hooks), ZeroStrategy (DeepSpeed ZeRO 1/2/3, which must own the module). Each is made by
`llmpipe.parallel.build_strategy(cfg, env, args)` and reads its settings from the config itself; the
loop writes nothing into it. What the loop uses:

    module, format                  the model to call; the checkpoint format ("full" | "dcp" | "deepspeed")
    state_format, train_state()     how its state is keyed in that format; the state itself
    data_rank, data_world           which share of each global batch this rank reads
    micro_context(sync)             around a micro-step's forward + backward (sync=False: no gradient sync)
    sync_first_step                 whether a process's first step must sync every micro-step
    forward_backward(x, y, doc_ids, scale)  one micro-batch; the loss, or None where it is not seen (pipelines)
    eval_loss_sum(x, y, doc_ids)    summed token losses without gradients, or None
                                    (doc_ids: packed conversations, passed to the model; scale: chat's loss
                                    normalisation, see forward_backward)
    step(number)                    clip, optimizer step, schedule step; the global gradient norm
    skipped                         whether that step dropped its update (train.debug.nan_guard=skip)
    lr(), loss_scale()              for the logs
    optimizers()                    (optimizer, schedule) pairs, re-tuned to the config on resume
    write_checkpoint / read_checkpoint, close()
    named_parameters(), replica_group(), supports_replica_checks   the troubleshooting checks
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.checkpoint import state as ckpt_state


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropies in fp64 (targets -100 count 0): (B, T, vocab), (B, T) -> ()."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").double().sum()


class Strategy:
    """Base class. Subclasses set `format` (the checkpoint format consolidate reads) and `module`."""

    format = "full"
    module: nn.Module  # what forward and eval call
    sync_first_step = False  # sync every micro-step of a process's first step (DDP static_graph)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Around each forward pass (autocast, where the strategy uses it)."""
        return contextlib.nullcontext()

    def micro_context(self, sync: bool) -> contextlib.AbstractContextManager:
        """Around a micro-step's forward+backward; `sync=False` may skip gradient communication."""
        return contextlib.nullcontext()

    # The data-parallel coordinates: which share of each global batch this rank reads. Ranks that
    # differ only in their tensor/pipeline coordinate read the same samples.
    @property
    def data_rank(self) -> int:
        return self.env.rank

    @property
    def data_world(self) -> int:
        return self.env.world

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None,
                         scale: float | None = None) -> torch.Tensor | None:
        """One micro-batch: forward, loss, backward. Returns the detached loss, or None on a rank that does
        not see it (an early pipeline stage). The loss is the mean token cross-entropy, or with `scale`
        (chat: targets -100 left out) the summed token losses x scale, where scale = data-parallel ranks x
        accumulation steps / the targets of the whole optimizer step: after the strategy's division by
        accumulation and the data-parallel mean, the gradient is that of the step's mean over its targets."""
        with self.forward_context():
            logits = self.module(x) if doc_ids is None else self.module(x, doc_ids=doc_ids)  # (B, T, vocab)
        if scale is None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        else:
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") * scale
        self.backward(loss)
        return loss.detach()

    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor,
                      doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Summed token cross-entropy of one batch (fp64; targets -100 left out), without gradients;
        None where not seen."""
        with torch.no_grad(), self.forward_context():
            logits = self.module(x) if doc_ids is None else self.module(x, doc_ids=doc_ids)
        return token_loss_sum(logits, y)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's mean loss (the strategy divides by accumulation)."""
        raise NotImplementedError

    def step(self, number: int) -> float:
        """Optimizer step `number` (1-based): clip, step, lr schedule step, zero grads; returns the global
        gradient norm."""
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    def loss_scale(self) -> float | None:
        return None

    def comm_bytes(self) -> int | None:
        """Gradient bytes this rank handed to all-reduce since the last call (DDP: counted in its
        communication hook, llmpipe.parallel.comm_hooks); None where not counted."""
        return None

    # -- state: what the composer made (llmpipe.parallel.compose), exposed for checkpoints --------------

    parts: list[nn.Module]  # the model, or this pipeline rank's stages
    opts: list[Any]  # one optimizer per part
    scheds: list[Any]  # one lr schedule per part
    scaler: Any = None  # fp16's GradScaler, else None
    state_format = "full"  # how the state is keyed in `format` (llmpipe.checkpoint.state)
    legacy_formats: tuple[str, ...] = ()  # state formats it wrote before, still read by its own reader

    def train_state(self) -> ckpt_state.TrainState:
        """What a checkpoint holds of this strategy (written and read by llmpipe.checkpoint.state)."""
        lora = self.cfg.train.lora
        return ckpt_state.TrainState(self.state_format, self.parts, self.opts, self.scheds, self.scaler,
                                     lora=lora.model_dump() if lora is not None else None)

    def write_checkpoint(self, folder: Path, trainer_state: dict[str, Any], asynchronous: bool = False,
                         group=None) -> Any:
        """Called on every rank with the same (temporary) folder; write this rank's part and return
        the paths written (or an io.Written), which this rank then hashes (io.Saver)."""
        return ckpt_state.write(folder, self.train_state(), trainer_state, self.env.rank, asynchronous, group)

    def read_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Restore from a verified checkpoint folder of this strategy's own format; returns the
        trainer state written with it."""
        return ckpt_state.read_own(folder, self.env, self.train_state, ckpt_state.format_of(folder))

    def optimizers(self) -> list[tuple[Any, Any]]:
        """(optimizer, LambdaLR) pairs this strategy steps; a resume re-tunes them to the config."""
        return list(zip(self.opts, self.scheds))

    def state_modules(self) -> list[tuple[nn.Module, Any]]:
        """(module, its optimizer) pairs whose state a checkpoint holds (not DDP's wrapper)."""
        return list(zip(self.parts, self.opts))

    def load_full(self, model: dict[str, torch.Tensor], optim: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load full tensors by llmpipe name (another layout's checkpoint, llmpipe.checkpoint.portable)
        into this rank's shards: parameters and AdamW states."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        for module, opt in self.state_modules():
            # by the name the checkpoint keeps each under: a pipeline's tied head copy reads the embedding
            names = {clean_name(n): ckpt_state.stored_name(module, clean_name(n)) for n, _ in module.named_parameters()}
            trained = [clean_name(n) for n, p in module.named_parameters() if p.requires_grad]  # LoRA: adapters
            missing = [s for s in names.values() if s not in model] + [names[n] for n in trained
                                                                        if names[n] not in optim]
            if missing:
                raise ValueError(f"train.checkpoint.resume: the checkpoint has no {missing[0]} (or its optimizer "
                                 "state); it is not this model")
            set_model_state_dict(module, {n: model[s] for n, s in names.items()}, options=full)
            osd = get_optimizer_state_dict(module, opt, options=full)  # this optimizer's groups, by name
            osd["state"] = {n: optim[names[n]] for n in trained}
            set_optimizer_state_dict(module, opt, osd, options=full)

    flat_param_groups = False  # param groups hold flattened partitions (ZeRO), not the model's shapes

    def close(self) -> None:
        """Drop references to model and optimizer before the process group is destroyed."""

    # -- troubleshooting (llmpipe.debug) ------------------------------------------------------

    step_number = 0  # the optimizer step being taken (for messages)
    skipped = False  # whether the last step() dropped its update (nan_guard=skip)

    @property
    def nan_guard(self) -> str:
        return self.cfg.train.debug.nan_guard
    supports_replica_checks = True  # parameters and .grad are the real tensors (not ZeRO's partitions)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(llmpipe name, parameter) of what this rank holds, wrapper prefixes removed."""
        return [(clean_name(n), p) for n, p in self.module.named_parameters()]

    def replica_group(self):
        """The process group of this rank's data-parallel replicas (None: every rank)."""
        return None

    def guard_nonfinite(self, norm: torch.Tensor, zero_grad) -> bool:
        """Apply nan_guard to a gradient norm; True when the update must be skipped (grads are then
        zeroed with `zero_grad`), raises under 'stop'."""
        self.skipped = False
        if self.nan_guard == "off" or bool(torch.isfinite(norm)):
            return False
        from llmpipe import debug

        names = debug.nonfinite([(n, p.grad) for n, p in self.named_parameters()])
        if self.nan_guard == "stop":
            raise debug.nonfinite_error(names or ["(another rank's shard)"], self.step_number, self.env.rank)
        debug.log.warning("step %d: non-finite gradients in %s: update skipped (train.debug.nan_guard=skip)",
                          self.step_number, ", ".join(names[:5]) or "another rank's shard")
        zero_grad()
        self.skipped = True
        return True


def clean_name(name: str) -> str:
    for prefix in ("module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


class TorchOptimizerStrategy(Strategy):
    """Shared by strategies that drive torch optimizers themselves (DDP, the mesh strategy): loss
    scaling for fp16, accumulation by dividing the loss, clip -> step -> schedule over every part.
    Subclasses set `parts`, `opts`, `scheds`, `scaler` (from compose), `accum`, `max_grad_norm`, and
    may override `grad_norm` and `clip` (DTensor gradients, pipeline stages)."""

    accum: int
    max_grad_norm: float | None

    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (no clipping)."""
        return torch.nn.utils.get_total_norm([p.grad for p in self.params() if p.grad is not None], foreach=True)

    def clip(self, norm: torch.Tensor) -> None:
        clip = self.max_grad_norm
        torch.nn.utils.clip_grads_with_norm_(self.params(), clip if clip else float("inf"), norm, foreach=True)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = loss / self.accum
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()

    def _zero_grad(self) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)

    def step(self, number: int) -> float:
        """The one step of every torch-optimizer layout: unscale (fp16), global norm, NaN guard, clip,
        each part's optimizer and schedule."""
        self.step_number = number
        if self.scaler is not None:
            for opt in self.opts:
                self.scaler.unscale_(opt)
        norm = self.grad_norm()
        # fp16 overflow is the scaler's to skip; anything else non-finite meets the NaN guard
        if self.scaler is None and self.guard_nonfinite(norm, self._zero_grad):
            for sched in self.scheds:
                sched.step()
            return float(norm)
        self.clip(norm)
        for opt in self.opts:
            if self.scaler is not None:
                self.scaler.step(opt)  # skipped when the unscaled gradients hold inf/nan
            else:
                opt.step()
        if self.scaler is not None:
            self.scaler.update()
        for opt, sched in zip(self.opts, self.scheds):
            opt.zero_grad(set_to_none=True)
            sched.step()
        return float(norm)

    def lr(self) -> float:
        return self.opts[0].param_groups[0]["lr"]

    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None
