"""Apply training-time wrappers to a LLaMA model from outside, in a fixed order.

Order (torchtitan's): tensor parallel -> activation checkpointing -> compile -> data parallel.
Activation checkpointing and FSDP2 live here; the data-parallel strategies are in llmpipe.parallel.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from llmpipe.models.llama.model import Transformer, init_tensor


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> Transformer:
    """Tensor parallel (torchtitan's LLaMA plan) over the 1-D `tp_mesh`, in place.

    q/k/v and w1/w3 are split column-wise (each rank holds n_heads/tp heads, ffn_dim/tp columns), wo
    and w2 row-wise, so each block needs one all-reduce after attention and one after the MLP. The
    embedding is split row-wise (by vocabulary) and the head column-wise with replicated logits (no
    loss parallel). With `sequence_parallel` the norms and residual stream are sharded on the
    sequence dim (B, T/tp, d) and the all-reduces become reduce-scatter + all-gather.
    Works on a pipeline stage: missing embedding / norm / head are skipped.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    # NOTE: with sequence parallel the residual stays a DTensor (use_local_output=False) so that
    # h.shape[1] in Transformer.forward is the global T that slices the RoPE tables.
    keep = not sequence_parallel
    root: dict = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                 use_local_output=keep)
    if model.norm is not None and sequence_parallel:
        root["norm"] = SequenceParallel()
    if model.output is not None:
        root["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if root:
        parallelize_module(model, tp_mesh, root)
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # NOTE: each style above distributes its own module's weight, which unties the head. Both are the
        # [vocab, dim] matrix sharded on dim 0 (Shard(0): the embedding's rows by vocabulary, the head's
        # output columns), so the one DTensor serves both: each rank holds the same vocab slice for the
        # lookup and for its slice of the logits, and their gradients meet in one Shard(0) tensor.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    return model


def _block_plan(sequence_parallel: bool) -> dict:
    """One TransformerBlock's plan; the attention/MLP inputs are gathered when sequence parallel."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        return {**plan, "attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))
    return {
        **plan,
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "attention": gather,
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def apply_activation_checkpointing(model: Transformer) -> None:
    """Recompute every transformer block in backward (non-reentrant), trading compute for memory."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer, backend) -> None:
    """torch.compile each transformer block's forward (torchtitan's per-block compile): every block
    has the same code and shapes, so one graph is compiled and reused, and the module tree, parameter
    names and the hooks data parallel adds around blocks stay as they are. After tensor parallel and
    activation checkpointing (the wrapper's checkpoint is traced with the block), before data
    parallel. `backend` comes from llmpipe.device.compile_backend."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend=backend)


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype | None,
               reduce_dtype: torch.dtype | None, reshard_after_forward: bool) -> Transformer:
    """FSDP2 (torchtitan style): `fully_shard` each block, then the root (embeddings, norm, output).

    Each block becomes one all-gather / reduce-scatter unit. Parameters become DTensors sharded on
    dim 0 over `mesh`; a materialised model is sharded in place (each rank keeps its slice of its
    own, identical, initialisation). `reshard_after_forward` applies to the blocks; the root keeps
    FSDP2's default (None: not resharded), since backward needs the output head at once.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():  # a checkpoint_wrapper, when activation checkpointing is on
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=None)
    return model


def apply_replicate(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype | None,
                    reduce_dtype: torch.dtype | None) -> Transformer:
    """DDP on `mesh` built on FSDP2's machinery (`replicate`): full replicas, gradients all-reduced,
    one unit per block then the root, like `apply_fsdp`. Unlike torch's DDP class it takes DTensor
    (tensor-parallel) parameters and a sub-mesh, and pipelining knows how to drive it."""
    from torch.distributed._composable.replicate_with_fsdp import replicate  # NOTE: private in torch 2.13

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        replicate(block, mesh=mesh, mp_policy=mp)
    replicate(model, mesh=mesh, mp_policy=mp)
    return model


def unwrap_state_dict(model: nn.Module) -> dict:
    """State dict with wrapper prefixes removed (DDP's `module.`, checkpoint_wrapper's)."""
    inner = getattr(model, "module", model)
    prefix = "_checkpoint_wrapped_module."
    return {k.replace(prefix, ""): v for k, v in inner.state_dict().items()}


def _assign_local_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank slices its own (identical) full tensor, no communication
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_weights(model: Transformer, seed: int, source=None) -> None:
    """Initialise a (possibly tensor-parallel, FSDP-sharded, pipeline-cut) model after `to_empty`:
    each rank fills its shards of the same full tensors a single process would draw, or that
    `source(name)` reads (pretrained weights, one tensor at a time). A pipeline's last stage holding
    a tied head without the embedding starts its copy from the embedding's value."""
    model.init_weights(seed, assign=_assign_local_shard, source=tied_source(model, seed, source))


def tied_source(model: Transformer, seed: int | None, source=None):
    """`source`, or for a last pipeline stage whose head is tied (its copy of the embedding, which the
    first stage holds) a source that reads `tok_embeddings.weight` for `output.weight`."""
    if not (model.args.tie_embeddings and model.tok_embeddings is None and model.output is not None):
        return source
    shapes = {n.replace("_checkpoint_wrapped_module.", ""): tuple(p.shape) for n, p in model.named_parameters()}
    shapes["tok_embeddings.weight"] = shapes["output.weight"]  # [vocab, dim] both
    base = source or (lambda name: init_tensor(model.args, name, shapes[name], seed))
    return lambda name: base("tok_embeddings.weight" if name == "output.weight" else name)
