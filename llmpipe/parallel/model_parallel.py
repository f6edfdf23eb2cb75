"""dp x tp x pp on one DeviceMesh: tensor parallel, pipeline parallel and DDP or FSDP2 composed.

Each rank builds its pipeline stage(s) on the meta device, then per stage: tensor parallel on the
"tp" sub-mesh -> activation checkpointing -> data parallel on the "dp" sub-mesh (FSDP2's
`fully_shard` for data=fsdp; for data=ddp the DDP built on the same machinery, `replicate`, which
composes with DTensor parameters and with torch.distributed.pipelining) -> `to_empty` -> init, where
each rank fills its shards of the same full tensors one process would draw (bitwise the same start).

With pp > 1 a torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved 1F1B) runs each
micro-batch as `microbatches` pipeline micro-batches; the loss lives on the last stage. Checkpoints
are DCP (format "dcp", as FSDP2 writes them): model and optimizer under llmpipe's parameter names,
so `consolidate` assembles TP shards and PP stages into the same model folder as every other layout,
and a checkpoint resumes on the same layout or (DCP reshards) another.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmpipe.checkpoint.state import TrainState
from llmpipe.models.llama.model import ModelArgs
from llmpipe.parallel import mesh as mesh_mod
from llmpipe.parallel import pipeline, tensor_parallel
from llmpipe.parallel.base import TorchOptimizerStrategy, token_loss_sum
from llmpipe.parallel.compose import compose
from llmpipe.parallel.grad_norm import clip_, total_grad_norm
from llmpipe.parallel.mesh import check_supported

log = logging.getLogger("llmpipe.train")


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


class ModelParallelStrategy(TorchOptimizerStrategy):
    """dp x tp x pp with DDP (`replicate`) or FSDP2 on the dp axis; fp32 or bf16 (by FSDP's policy)."""

    format, state_format = "dcp", "dcp-flat"  # optimizer state flattened by name: parts merge into one

    def __init__(self, cfg, env, args: ModelArgs):
        if not dist.is_initialized():
            raise ValueError("train.parallel: tp/pp > 1 needs a process group: launch with torchrun")
        check_supported(cfg, env.precision)
        self.cfg, self.env, self.args = cfg, env, args
        par, t = cfg.train.parallel, cfg.train
        self.dims = mesh_mod.validate(par, args, env.world, t.micro_batch_size)
        self.mesh = mesh_mod.build_mesh(self.dims, env.device.type)
        coords = self.dims.coords(env.rank)
        self.pp_rank, self.dp_rank = coords["pp"], coords["dp"]
        n_stages = self.dims.pp * par.virtual_stages
        self.stage_ids = pipeline.stage_ids(self.pp_rank, self.dims.pp, par.virtual_stages)
        splits = pipeline.split_layers(args.n_layers, n_stages, par.split_points)
        # data=ddp is `replicate` here, also at dp=1, where it does no communication but applies
        # the precision policy
        c = compose(cfg, env, args, mesh=self.mesh, data="fsdp" if par.data == "fsdp" else "replicate",
                    stages=[(s, n_stages, splits[s]) for s in self.stage_ids])
        self.parts, self.opts, self.scheds, self.scaler = c.parts, c.optimizers, c.schedulers, c.scaler
        self.module = nn.ModuleList(self.parts)  # for train()/eval(); forward goes through the parts
        self.accum, self.max_grad_norm = t.grad_accum_steps, t.optim.clip_grad_norm
        self.has_loss = self.dims.pp == 1 or (n_stages - 1) in self.stage_ids
        self.schedule = None
        if self.dims.pp > 1:
            stages = pipeline.make_stages(self.parts, self.stage_ids, n_stages, env.device,
                                          group=self.mesh["pp"].get_group())
            self.loss_divisor = par.microbatches * self.accum
            self.stage_loss = _StageLoss(self.loss_divisor)
            self.schedule = pipeline.make_schedule(par.pp_schedule, stages, par.microbatches,
                                                   loss_fn=self.stage_loss, scale_grads=False)
        if env.main:
            log.info("layout dp=%d x tp=%d x pp=%d (%s, data=%s): rank 0 holds stage(s) %s, %s local parameters",
                     self.dims.dp, self.dims.tp, self.dims.pp, par.pp_schedule if self.dims.pp > 1 else "no pipeline",
                     par.data, self.stage_ids, f"{sum(tensor_parallel.local_numel(p) for p in self.parts):,}")

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
        return [(n.replace("_checkpoint_wrapped_module.", ""), p) for part in self.parts
                for n, p in part.named_parameters()]

    def replica_group(self):
        return self.mesh["dp"].get_group()

    def grad_norm(self) -> torch.Tensor:
        # NOTE: the norm is global (reduced over tp, dp and pp), so every rank skips or stops together
        return total_grad_norm(self.params(), self.mesh["pp"].get_group() if self.dims.pp > 1 else None)

    def clip(self, norm: torch.Tensor) -> None:
        clip_(self.params(), norm, self.max_grad_norm)

    def train_state(self) -> TrainState:
        ts = super().train_state()
        ts.extra = {"layout": {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp}}
        return ts

    def close(self) -> None:
        del self.schedule, self.parts, self.module, self.opts, self.scheds, self.mesh
