"""The dp x tp x pp layout: validation against the world size and the model, and the DeviceMesh.

Every check raises `LayoutError` with the numbers ("dp=8 x tp=4 x pp=2 = 64, but world size is 32"),
so a bad layout fails at start, before any process group or weight exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmpipe.errors import UserError
from llmpipe.models.llama.model import ModelArgs

MESH_DIMS = ("pp", "dp", "tp")  # outermost first: tp ranks are adjacent (same node), pp the farthest apart


class LayoutError(UserError, ValueError):
    """A parallel layout that cannot run this model at this world size; one line for the user (still a
    ValueError for the callers that catch one)."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, tensor and pipeline parallelism; `validate` checks them against a world size."""

    dp: int
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "world_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dp * self.tp * self.pp != self.world_size:
            raise LayoutError(f"dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.dp * self.tp * self.pp}, "
                              f"but world size is {self.world_size}")

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int) -> ParallelDims:
        """dp inferred as world_size / (tp * pp), with an error when it does not divide."""
        if world_size % (tp * pp):
            raise LayoutError(f"tp={tp} x pp={pp} = {tp * pp} does not divide world size {world_size}")
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp, world_size=world_size)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's (pp, dp, tp) coordinates in the row-major mesh of shape (pp, dp, tp)."""
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}


def check_tp(tp: int, args: ModelArgs) -> None:
    """tp must divide every dimension the TP plan shards."""
    for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "dim"):
        value = getattr(args, name)
        if value % tp:
            raise LayoutError(f"tp={tp} does not divide model.{name}={value}")


def check_pp(pp: int, args: ModelArgs, schedule: str, microbatches: int, virtual_stages: int,
             split_points: list[int] | None) -> None:
    """pp against the layer count, the schedule's needs and explicit split points."""
    stages = pp * virtual_stages
    if pp > args.n_layers:
        raise LayoutError(f"pp={pp} exceeds the model's {args.n_layers} layers")
    if schedule == "interleaved_1f1b":
        if virtual_stages < 2:
            raise LayoutError(f"pp_schedule=interleaved_1f1b needs virtual_stages >= 2 (got {virtual_stages})")
        if split_points is None and args.n_layers % stages:
            raise LayoutError(f"interleaved_1f1b: the model's {args.n_layers} layers do not divide into "
                              f"pp={pp} x virtual_stages={virtual_stages} = {stages} equal stages")
    if pp > 1 and schedule in ("1f1b", "interleaved_1f1b") and microbatches < pp:
        raise LayoutError(f"pp_schedule={schedule} needs microbatches >= pp, so every stage has work in the "
                          f"steady state (got microbatches={microbatches}, pp={pp})")
    if split_points is not None:
        check_split_points(split_points, args.n_layers, stages)


def check_split_points(points: list[int], n_layers: int, n_stages: int) -> None:
    """`points` are the first layer of stages 1..n-1: n_stages - 1 of them, strictly increasing, in (0, n)."""
    if len(points) != n_stages - 1:
        raise LayoutError(f"split_points needs {n_stages - 1} entries for {n_stages} stages (got {len(points)}: "
                          f"{points})")
    bounds = [0, *points, n_layers]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise LayoutError(f"split_points {points} must be strictly increasing within 1..{n_layers - 1} "
                          f"(the model has {n_layers} layers)")


def validate(parallel, args: ModelArgs, world_size: int, micro_batch_size: int | None = None) -> ParallelDims:
    """Validate a config's `train.parallel` section against the model and world size; returns the dims."""
    if micro_batch_size is not None and parallel.pp > 1 and micro_batch_size % parallel.microbatches:
        raise LayoutError(f"pp: micro_batch_size={micro_batch_size} does not split into "
                          f"microbatches={parallel.microbatches} equal pipeline micro-batches")
    if parallel.dp is not None:
        dims = ParallelDims(dp=parallel.dp, tp=parallel.tp, pp=parallel.pp, world_size=world_size)
    else:
        dims = ParallelDims.from_world(world_size, parallel.tp, parallel.pp)
    check_tp(dims.tp, args)
    check_pp(dims.pp, args, parallel.pp_schedule, parallel.microbatches, parallel.virtual_stages,
             parallel.split_points)
    return dims


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The 3-D mesh ("pp", "dp", "tp"); dimensions of size 1 are kept so sub-meshes always exist."""
    return init_device_mesh(device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=MESH_DIMS)


def check_supported(cfg, precision: str) -> None:
    """What the composed layout does not do (yet) with tp or pp > 1, as one clear line each; nothing at
    tp = pp = 1 (DDP, ZeRO and FSDP2 alone each do all of it)."""
    p = cfg.train.parallel
    if p.tp * p.pp == 1:
        return
    if p.data == "zero":
        raise LayoutError(f"train.parallel.data=zero cannot be combined with tp={p.tp} / pp={p.pp}: "
                                   "use data=fsdp (ZeRO-3 equivalent) or data=ddp")
    if precision == "fp16":
        raise LayoutError("train.precision.dtype=fp16 is not supported with tp/pp > 1 (loss scaling "
                                   "across pipeline stages is not implemented): use bf16")
    if p.pp > 1 and p.sequence_parallel:
        raise LayoutError("train.parallel.sequence_parallel with pp > 1 is not supported (stages would "
                                   "pass sequence-sharded DTensors): set sequence_parallel: false")
