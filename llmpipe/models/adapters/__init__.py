"""One adapter per Hugging Face family (torchtitan's state_dict_adapter idea): its architecture class,
config.json <-> ModelArgs both ways, and what it refuses. A new family is one file here that defines
`ADAPTER` and one line in FAMILIES; the weight names are shared (llmpipe.models.adapters.base)."""

from __future__ import annotations

from llmpipe.models.adapters import llama, mistral, qwen2, qwen3
from llmpipe.models.adapters.base import Adapter, HFFolderError, from_hf_name, to_hf_name
from llmpipe.models.llama.model import ModelArgs

FAMILIES = (llama, mistral, qwen2, qwen3)
ADAPTERS: dict[str, Adapter] = {m.ADAPTER.architecture: m.ADAPTER for m in FAMILIES}


def for_architecture(name: str) -> Adapter:
    return ADAPTERS[name]


def for_args(args: ModelArgs) -> Adapter:
    """The family a model of `args` is written as when it has no source folder (llmpipe pre-trained it):
    the one whose fixed options it has; Llama (tied or not) for the original decoder."""
    if args.qk_norm and not args.attn_bias:
        return qwen3.ADAPTER
    if args.attn_bias and not args.qk_norm:
        return qwen2.ADAPTER
    if args.attn_bias or args.qk_norm:
        raise ValueError("no Hugging Face family has both q/k/v bias and qk-norm")
    return llama.ADAPTER


__all__ = ["ADAPTERS", "Adapter", "HFFolderError", "for_architecture", "for_args", "from_hf_name", "to_hf_name"]
