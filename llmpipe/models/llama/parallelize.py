"""Apply training-time wrappers to a LLaMA model from outside, in a fixed order.

Order (torchtitan's): tensor parallel -> activation checkpointing -> compile -> data parallel.
Only activation checkpointing lives here for now; data parallel is in llmpipe.parallel.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from llmpipe.models.llama.model import Transformer


def apply_activation_checkpointing(model: Transformer) -> None:
    """Recompute every transformer block in backward (non-reentrant), trading compute for memory."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def unwrap_state_dict(model: nn.Module) -> dict:
    """State dict with wrapper prefixes removed (DDP's `module.`, checkpoint_wrapper's)."""
    inner = getattr(model, "module", model)
    prefix = "_checkpoint_wrapped_module."
    return {k.replace(prefix, ""): v for k, v in inner.state_dict().items()}
