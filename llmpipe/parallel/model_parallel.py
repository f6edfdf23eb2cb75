"""The mesh strategy: dp x tp x pp on one DeviceMesh, FSDP2 or DDP (`replicate`) on the dp axis, tensor
and pipeline parallel composed; a dimension of size 1 is a no-op, so FSDP2 alone is dp=world x 1 x 1.

Each rank builds its pipeline stage(s) on the meta device, then per stage: tensor parallel on the
"tp" sub-mesh -> activation checkpointing -> data parallel on the "dp" sub-mesh (FSDP2's
`fully_shard` for data=fsdp; for data=ddp the DDP built on the same machinery, `replicate`, which
composes with DTensor parameters and with torch.distributed.pipelining) -> `to_empty` -> init, where
each rank fills its shards of the same full tensors one process would draw (bitwise the same start).
Mixed precision is FSDP2's policy (no autocast); fp16's GradScaler runs where tp = pp = 1.

With pp > 1 a torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved 1F1B) runs each
micro-batch as `microbatches` pipeline micro-batches; the loss lives on the last stage. Checkpoints
are DCP (format "dcp"): model and optimizer under llmpipe's parameter names, so `consolidate`
assembles FSDP shards, TP shards and PP stages into the same model folder as every other layout,
and a checkpoint resumes on the same layout or (DCP reshards) another. DCP's .metadata plus one
.distcp file per rank sit in `dcp/`, trainer_state.pt (step, data position, RNG, scheduler, loss
scaler) beside it.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from llmpipe.checkpoint.state import TrainState
from llmpipe.models.llama.model import ModelArgs
from llmpipe.parallel import mesh as mesh_mod
from llmpipe.parallel import pipeline, tensor_parallel
from llmpipe.parallel.base import TorchOptimizerStrategy, clean_name, token_loss_sum
from llmpipe.parallel.compose import compose
from llmpipe.parallel.grad_norm import clip_, total_grad_norm
from llmpipe.parallel.mesh import check_supported
from llmpipe.parallel.tied import TiedHead

log = logging.getLogger("llmpipe.train")


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds for `t` (the local shard of a DTensor)."""
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Model-state bytes on this rank from the local shards (plain tensors count whole, so DDP works
    too): parameters, gradients (one per trainable parameter, its size: what the reduce-scatter
    leaves) and optimizer states. NOTE: while accumulating without sync, FSDP2 also holds
    unsharded fp32 gradients (full size) until the last micro-step; they are not counted here."""
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {"params": sum(local_bytes(p) for p in params),
           "grads": sum(local_bytes(p) for p in params if p.requires_grad),
           "optimizer": sum(local_bytes(v) for v in states)}
    out["total"] = sum(out.values())
    return out


class _StageLoss:
    """The pipeline's loss_fn: a pipeline micro-batch's mean token cross-entropy divided by the number
    of pipeline micro-batches and accumulation steps, so the gradients summed over one optimizer step
    are those of the mean loss (the schedule runs with scale_grads=False)."""

    def __init__(self, divisor: int):
        self.divisor = divisor
        self.summed = False  # evaluation: the summed token losses instead (targets -100 left out)
        self.scale: float | None = None  # chat: summed token losses x scale (Strategy.forward_backward)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.summed:
            return token_loss_sum(logits, targets)
        if self.scale is not None:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") * self.scale
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / self.divisor


class MeshStrategy(TorchOptimizerStrategy):
    """dp x tp x pp with FSDP2 or DDP (`replicate`) on the dp axis; fp32, bf16 (by FSDP's policy) or, at
    tp = pp = 1, fp16 with a GradScaler."""

    format = "dcp"

    def __init__(self, cfg, env, args: ModelArgs):
        par, t = cfg.train.parallel, cfg.train
        if not dist.is_initialized():
            raise ValueError(f"train.parallel (data={par.data}, tp={par.tp}, pp={par.pp}) needs a process group: "
                             "launch with torchrun (train.nproc_per_node >= 1), not in-process")
        if par.tp > 1 or par.pp > 1:
            check_supported(cfg, env.precision)
        self.cfg, self.env, self.args = cfg, env, args
        self.dims = mesh_mod.validate(par, args, env.world, t.micro_batch_size)
        self.mesh = mesh_mod.build_mesh(self.dims, env.device.type)
        coords = self.dims.coords(env.rank)
        self.pp_rank, self.dp_rank = coords["pp"], coords["dp"]
        n_stages = self.dims.pp * par.virtual_stages
        self.stage_ids = pipeline.stage_ids(self.pp_rank, self.dims.pp, par.virtual_stages)
        splits = pipeline.split_layers(args.n_layers, n_stages, par.split_points)
        # built on meta, sharded, then each rank allocates and initialises only its shards. data=ddp is
        # `replicate` here, also at dp=1, where it does no communication but applies the precision policy
        c = compose(cfg, env, args, mesh=self.mesh, data="fsdp" if par.data == "fsdp" else "replicate",
                    stages=[(s, n_stages, splits[s]) for s in self.stage_ids])
        self.parts, self.opts, self.scheds, self.scaler = c.parts, c.optimizers, c.schedulers, c.scaler
        # for train()/eval(); the loop's forward goes through the parts (a pipeline's through its schedule)
        self.module = self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)
        self.accum, self.max_grad_norm = t.grad_accum_steps, t.optim.clip_grad_norm
        self.has_loss = self.dims.pp == 1 or (n_stages - 1) in self.stage_ids
        self.schedule = self._schedule(par, n_stages) if self.dims.pp > 1 else None
        # a tied head cut by the pipeline: a copy on the last stage, kept equal to the first's (parallel.tied)
        self.tied = TiedHead(self.parts, self.stage_ids, n_stages, self.dims, env.rank) \
            if self.dims.pp > 1 and args.tie_embeddings else None
        if self.tied is not None:
            self.tied.check_equal("step 0")
        if env.main:
            log.info("layout dp=%d x tp=%d x pp=%d (%s, data=%s): rank 0 holds stage(s) %s, %s local parameters",
                     self.dims.dp, self.dims.tp, self.dims.pp, par.pp_schedule if self.dims.pp > 1 else "no pipeline",
                     par.data, self.stage_ids, f"{sum(tensor_parallel.local_numel(p) for p in self.parts):,}")

    def _schedule(self, par, n_stages: int):
        """The pipeline schedule over this rank's stages (pp > 1), its loss divided as _StageLoss says."""
        stages = pipeline.make_stages(self.parts, self.stage_ids, n_stages, self.env.device,
                                      group=self.mesh["pp"].get_group())
        self.loss_divisor = par.microbatches * self.accum
        self.stage_loss = _StageLoss(self.loss_divisor)
        return pipeline.make_schedule(par.pp_schedule, stages, par.microbatches, loss_fn=self.stage_loss,
                                      scale_grads=False)

    @property
    def state_format(self) -> str:
        """How the optimizer state is keyed in DCP. With tp or pp it is flattened by name, so the parts
        merge into one state; FSDP2 alone (tp = pp = 1) keeps torch's nested keying, which is what
        FSDP2 runs always wrote: their checkpoints, old and new, are the same files read by the same
        reader."""
        return "dcp-nested" if self.dims.tp == self.dims.pp == 1 else "dcp-flat"

    # -- data -----------------------------------------------------------------------------------------

    @property
    def data_rank(self) -> int:
        return self.dp_rank

    @property
    def data_world(self) -> int:
        return self.dims.dp

    # -- stepping -------------------------------------------------------------------------------------

    def micro_context(self, sync: bool):
        if self.schedule is None:  # with a pipeline the schedule syncs at the end of each step
            for part in self.parts:
                part.set_requires_gradient_sync(sync)
        return super().micro_context(sync)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None,
                         scale: float | None = None) -> torch.Tensor | None:
        if self.schedule is None:
            logits = self.parts[0](x) if doc_ids is None else self.parts[0](x, doc_ids=doc_ids)
            if scale is None:
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            else:
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") * scale
            self.backward(loss)
            return loss.detach()
        if doc_ids is not None:  # config load refuses data.packing with pp > 1
            raise ValueError("packed sequences (doc_ids) cannot go through pipeline stages")
        losses: list[torch.Tensor] = []
        self.stage_loss.scale = scale
        try:
            self.schedule.step(x, target=y, losses=losses if self.has_loss else None, return_outputs=False)
        finally:
            self.stage_loss.scale = None
        if not self.has_loss:
            return None
        # each entry is one pipeline micro-batch's mean loss / (microbatches x accum), or its summed loss x scale
        return torch.stack(losses).sum().detach() * (self.accum if scale is None else 1)

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor,
                      doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.schedule is None:
            return token_loss_sum(self.parts[0](x) if doc_ids is None else self.parts[0](x, doc_ids=doc_ids), y)
        losses: list[torch.Tensor] = []
        self.stage_loss.summed = True  # per pipeline micro-batch: summed token losses
        try:
            self.schedule.eval(x, target=y, losses=losses if self.has_loss else None)
        finally:
            self.stage_loss.summed = False
        return torch.stack(losses).sum() if self.has_loss else None

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(clean_name(n), p) for part in self.parts for n, p in part.named_parameters()]

    def replica_group(self):
        return self.mesh["dp"].get_group()

    def step(self, number: int) -> float:
        if self.tied is not None:  # the two copies' gradients summed first (Megatron's embedding group)
            self.tied.sync_grads()
        return super().step(number)

    def grad_norm(self) -> torch.Tensor:
        # NOTE: the norm is global (reduced over tp, dp and pp), so every rank skips or stops together; a tied
        # head's pipeline copy counts once
        params = self.params() if self.tied is None else self.tied.norm_params(self.params())
        return total_grad_norm(params, self.mesh["pp"].get_group() if self.dims.pp > 1 else None)

    def clip(self, norm: torch.Tensor) -> None:
        clip_(self.params(), norm, self.max_grad_norm)

    def memory_stats(self) -> dict[str, int]:
        """Model-state bytes this rank holds over its parts (model_state_bytes)."""
        stats = [model_state_bytes(part, opt) for part, opt in zip(self.parts, self.opts)]
        return {k: sum(s[k] for s in stats) for k in stats[0]}

    def train_state(self) -> TrainState:
        ts = super().train_state()
        ts.extra = {"layout": {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp}}
        return ts

    def write_checkpoint(self, folder, trainer_state, asynchronous: bool = False, group=None):
        if self.tied is not None:  # one tensor is stored for both copies (checkpoint.state): they must be one
            self.tied.check_equal(f"step {trainer_state['step']}")
        return super().write_checkpoint(folder, trainer_state, asynchronous, group)

    def read_checkpoint(self, folder):
        state = super().read_checkpoint(folder)
        if self.tied is not None:
            self.tied.check_equal(f"resumed at step {state['step']}")
        return state

    def load_full(self, model, optim) -> None:
        super().load_full(model, optim)
        if self.tied is not None:
            self.tied.check_equal("resharded from another layout")

    def close(self) -> None:
        del self.schedule, self.parts, self.module, self.opts, self.scheds, self.mesh
