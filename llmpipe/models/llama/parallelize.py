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

from llmpipe.models.llama.model import Transformer


def apply_activation_checkpointing(model: Transformer) -> None:
    """Recompute every transformer block in backward (non-reentrant), trading compute for memory."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


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


def unwrap_state_dict(model: nn.Module) -> dict:
    """State dict with wrapper prefixes removed (DDP's `module.`, checkpoint_wrapper's)."""
    inner = getattr(model, "module", model)
    prefix = "_checkpoint_wrapped_module."
    return {k.replace(prefix, ""): v for k, v in inner.state_dict().items()}
