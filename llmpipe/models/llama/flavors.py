"""Named LLaMA architectures, from a CPU-sized toy to the 70B, plus config overrides."""

from __future__ import annotations

from dataclasses import replace

from llmpipe.errors import UserError
from llmpipe.models.llama.model import ModelArgs


class FlavorError(UserError, ValueError):
    """The config's model section names no known flavor, or overrides or an init_from folder that do not
    fit; the message names the field."""


FLAVORS: dict[str, ModelArgs] = {
    # debug: a few hundred thousand parameters, for unit tests.
    "debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=512),
    # tiny: the CPU demo (about 3M parameters with an 4k vocabulary).
    "tiny": ModelArgs(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512, max_seq_len=1024),
    "small": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=2048),
    "llama-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=4096,
                          vocab_size=128256, rope_theta=500000.0),
    # The seed's 7B: hidden 4096, 32 heads, 32 layers, intermediate 11008 (LLaMA-2 7B).
    "llama-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_seq_len=4096,
                          vocab_size=32000),
    "llama-13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, max_seq_len=4096,
                           vocab_size=32000),
    "llama-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq_len=4096,
                           vocab_size=32000),
}

_OVERRIDABLE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "rope_theta", "norm_eps")


def model_args(section, vocab_size: int | None = None) -> ModelArgs:
    """ModelArgs for a config `model` section (flavor + overrides; vocab from the tokenizer), or the
    architecture of the Hugging Face folder `model.init_from` (its own vocabulary, which the tokenizer
    must fit in; only max_seq_len may be overridden)."""
    if getattr(section, "init_from", None):
        from llmpipe.models.llama import hf

        set_ = [k for k in _OVERRIDABLE if k != "max_seq_len" and getattr(section, k) is not None]
        if set_:
            raise FlavorError(f"model.{set_[0]}: not with model.init_from (the folder's config.json defines the "
                              "architecture; only model.max_seq_len may be set)")
        try:
            args, _ = hf.read_config(section.init_from, section.max_seq_len)
        except hf.HFFolderError as err:
            raise FlavorError(f"model.init_from: {err}") from None
        if vocab_size is not None and vocab_size > args.vocab_size:
            raise FlavorError(f"model.init_from: the tokenizer has {vocab_size} tokens, more than the model's "
                              f"vocab_size {args.vocab_size} ({section.init_from}/config.json)")
        return args
    if section.flavor not in FLAVORS:
        raise FlavorError(f"model.flavor: unknown flavor {section.flavor!r} (known: {', '.join(FLAVORS)})")
    changes = {k: getattr(section, k) for k in _OVERRIDABLE if getattr(section, k) is not None}
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    return replace(FLAVORS[section.flavor], **changes)
