"""Dry run of a dp x tp x pp layout at full world size, without hardware.

For each simulated rank: a process group on torch's "fake" backend (collectives are no-ops), the
("pp", "dp", "tp") DeviceMesh, the model on the meta device (no memory), the TP plan on the tp
sub-mesh, the pipeline stage(s) cut out and the schedule built. What is printed per rank is read from
the local shapes of the resulting (D)Tensors, so it is what the real run would hold.

Model-state memory is 16 bytes per local parameter: fp32 weights (4) + fp32 grads (4) + AdamW's two
fp32 moments (8), which is how llmpipe trains (fp32 master weights, bf16/fp16 autocast); it equals
the mixed-precision accounting bf16 weights (2) + bf16 grads (2) + fp32 master (4) + moments (8).
With data=fsdp the 16 bytes are further divided by dp. Activations are not included.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmpipe.config import RunConfig
from llmpipe.models.llama.flavors import model_args
from llmpipe.models.llama.model import ModelArgs, Transformer
from llmpipe.parallel import mesh as mesh_mod
from llmpipe.parallel import pipeline, tensor_parallel

STATE_BYTES_PER_PARAM = 16


@dataclass
class RankReport:
    rank: int
    pp: int
    dp: int
    tp: int
    stages: list[int]
    layers: list[int]
    params: int
    replicated: int  # of `params`, those every tp rank holds whole (norm weights)
    state_bytes: int
    schedule: str


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """A process group on torch's fake backend for `rank`; destroyed on exit so the next rank can start."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _stage_module(args: ModelArgs, stage: int, n_stages: int, layer_ids: list[int], device_mesh,
                  sequence_parallel: bool) -> Transformer:
    """One pipeline stage on the meta device: built whole, cut, then tensor-parallelised."""
    with torch.device("meta"):
        model = Transformer(args)
    pipeline.build_stage_module(model, stage, n_stages, layer_ids)
    return tensor_parallel.apply(model, device_mesh, sequence_parallel)


def rank_report(cfg: RunConfig, args: ModelArgs, dims: mesh_mod.ParallelDims, rank: int) -> RankReport:
    """Build this rank's share of the model under an initialised (fake) process group and describe it."""
    par = cfg.train.parallel
    device_mesh = mesh_mod.build_mesh(dims, "cpu")
    c = dims.coords(rank)
    if tuple(device_mesh.get_coordinate()) != (c["pp"], c["dp"], c["tp"]):  # the table's coordinates are the mesh's
        raise AssertionError(f"rank {rank}: mesh coordinate {device_mesh.get_coordinate()} != {c}")
    n_stages = dims.pp * par.virtual_stages
    splits = pipeline.split_layers(args.n_layers, n_stages, par.split_points)
    ids = pipeline.stage_ids(c["pp"], dims.pp, par.virtual_stages)
    modules = [_stage_module(args, s, n_stages, splits[s], device_mesh, par.sequence_parallel) for s in ids]
    schedule = "-"
    if dims.pp > 1:
        stages = pipeline.make_stages(modules, ids, n_stages, torch.device("cpu"), group=device_mesh["pp"].get_group())
        schedule = type(pipeline.make_schedule(par.pp_schedule, stages, par.microbatches, loss_fn=None)).__name__
    params = sum(tensor_parallel.local_numel(m) for m in modules)
    replicated = sum(tensor_parallel.replicated_numel(m) for m in modules)
    shard = dims.dp if par.data == "fsdp" else 1
    return RankReport(rank, c["pp"], c["dp"], c["tp"], ids, [i for s in ids for i in splits[s]], params, replicated,
                      params * STATE_BYTES_PER_PARAM // shard, schedule)


def simulate(cfg: RunConfig, world_size: int, ranks: list[int] | None = None) -> list[RankReport]:
    """Reports for `ranks` (default: all) at `world_size`, one fake process group after another."""
    args = model_args(cfg.model, cfg.data.tokenizer.vocab_size if cfg.data.tokenizer.path is None else None)
    dims = mesh_mod.validate(cfg.train.parallel, args, world_size, cfg.train.micro_batch_size)
    from llmpipe.parallel.mesh import check_supported

    check_supported(cfg, cfg.train.precision.dtype)  # what training would refuse, the dry run refuses too
    reports = []
    for rank in (range(world_size) if ranks is None else ranks):
        with fake_process_group(rank, world_size):
            reports.append(rank_report(cfg, args, dims, rank))
    return reports


def _layers(ids: list[int]) -> str:
    runs, start = [], ids[0] if ids else None
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{start}")
            start = b
    return ",".join(runs)


def format_table(reports: list[RankReport]) -> str:
    """One line per rank: mesh coordinates, pipeline stage(s), layers held, local parameters (of which
    `replicated` are held whole on every tp rank), model-state memory."""
    head = (f"{'rank':>4} {'pp':>2} {'dp':>2} {'tp':>2}  {'stage':<6} {'layers':<12} {'params':>14} "
            f"{'replicated':>10} {'states GiB':>10}")
    lines = [head, "-" * len(head)]
    for r in reports:
        lines.append(f"{r.rank:>4} {r.pp:>2} {r.dp:>2} {r.tp:>2}  {','.join(map(str, r.stages)):<6} "
                     f"{_layers(r.layers):<12} {r.params:>14,} {r.replicated:>10,} {r.state_bytes / 2**30:>10.2f}")
    return "\n".join(lines)


def unique_params(reports: list[RankReport], tp: int) -> int:
    """Distinct parameters across dp replica 0: replicated weights appear on all tp ranks, count them once."""
    rep0 = [r for r in reports if r.dp == 0]
    return sum(r.params for r in rep0) - sum(r.replicated for r in rep0) * (tp - 1) // tp


def summary(cfg: RunConfig, reports: list[RankReport], world_size: int) -> str:
    """The layout, batch and pipeline numbers, and the check that one dp replica holds the whole model."""
    t, par = cfg.train, cfg.train.parallel
    args = model_args(cfg.model, cfg.data.tokenizer.vocab_size if cfg.data.tokenizer.path is None else None)
    dims = mesh_mod.validate(par, args, world_size)
    replica = unique_params(reports, dims.tp)
    seqs = t.micro_batch_size * t.grad_accum_steps * dims.dp
    v = par.virtual_stages
    return "\n".join([
        f"layout: dp={dims.dp} x tp={dims.tp} x pp={dims.pp} = {world_size} ranks; data={par.data}, "
        f"schedule={par.pp_schedule} (built: {reports[0].schedule}), sequence_parallel={par.sequence_parallel}",
        f"model: {cfg.model.shown()}, {args.num_params():,} parameters; dp replica 0 holds {replica:,} distinct "
        f"({'complete' if replica == args.num_params() else 'MISMATCH'}; norm weights are replicated on each "
        f"tp rank and counted once)",
        f"global batch: micro {t.micro_batch_size} x accum {t.grad_accum_steps} x dp {dims.dp} = {seqs} sequences "
        f"x {cfg.data.seq_len} tokens = {seqs * cfg.data.seq_len:,} tokens per optimizer step",
        f"pipeline: {par.microbatches} micro-batches of {t.micro_batch_size // par.microbatches} per micro-step; "
        f"bubble (p-1)/(v*m+p-1) = {pipeline.bubble_fraction(dims.pp, par.microbatches, v):.3f}",
        f"model states: {STATE_BYTES_PER_PARAM} B/param (fp32 weights + grads + 2 AdamW moments"
        f"{', / dp for fsdp' if par.data == 'fsdp' else ''}); activations not included",
    ])


def default_world_size(cfg: RunConfig) -> int:
    """dp * tp * pp when the config names dp, else one node's nproc_per_node."""
    par = cfg.train.parallel
    return par.dp * par.tp * par.pp if par.dp is not None else cfg.train.nproc_per_node


def run(cfg: RunConfig, world_size: int, all_ranks: bool = False) -> str:
    """Simulate every rank; print the dp-replica-0 ranks (or all) and the summary."""
    reports = simulate(cfg, world_size)
    replica0 = {(r.pp, r.tp): (r.params, r.layers) for r in reports if r.dp == 0}
    same = all(replica0[(r.pp, r.tp)] == (r.params, r.layers) for r in reports)
    shown = reports if all_ranks else [r for r in reports if r.dp == 0]
    note = f"\n(every dp replica holds the same shards as replica 0: {same})"
    return f"{format_table(shown)}{note}\n{summary(cfg, reports, world_size)}"
