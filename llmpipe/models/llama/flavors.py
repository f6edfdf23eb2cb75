"""Named architectures, from a CPU-sized toy to the 70B, the published Qwen3, Qwen2.5, Llama 3.2 and SmolLM2
sizes, plus config overrides."""

from __future__ import annotations

from dataclasses import replace

from llmpipe.errors import UserError
from llmpipe.models.llama.model import ModelArgs


class FlavorError(UserError, ValueError):
    """The config's model section names no known flavor, or overrides or an init_from folder that do not
    fit; the message names the field."""


# Llama 3.1/3.2's RoPE frequency scaling (their config.json's rope_scaling)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

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
    # The published models people fine-tune, as their config.json says (sizes, vocabulary, RoPE, tying), so
    # that `llmpipe plan` and `dryrun` size them without the folder. model.init_from reads the folder itself.
    **{f"qwen3-{name}": ModelArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=8, head_dim=128, ffn_dim=f,
                                  vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                                  tie_embeddings=tied, qk_norm=True)
       for name, d, n, h, f, tied in (("0.6b", 1024, 28, 16, 3072, True), ("1.7b", 2048, 28, 16, 6144, True),
                                      ("4b", 2560, 36, 32, 9728, True), ("8b", 4096, 36, 32, 12288, False))},
    **{f"qwen2.5-{name}": ModelArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, ffn_dim=f, vocab_size=v,
                                    max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=tied,
                                    attn_bias=True)
       for name, d, n, h, kv, f, v, tied in (("0.5b", 896, 24, 14, 2, 4864, 151936, True),
                                            ("1.5b", 1536, 28, 12, 2, 8960, 151936, True),
                                            ("3b", 2048, 36, 16, 2, 11008, 151936, True),
                                            ("7b", 3584, 28, 28, 4, 18944, 152064, False))},
    **{f"llama3.2-{name}": ModelArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                                     max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                                     rope_scaling=dict(LLAMA3_ROPE))
       for name, d, n, h in (("1b", 2048, 16, 32), ("3b", 3072, 28, 24))},
    **{f"smollm2-{name}": ModelArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, ffn_dim=f, vocab_size=49152,
                                    max_seq_len=8192, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True)
       for name, d, n, h, kv, f in (("135m", 576, 30, 9, 3, 1536), ("360m", 960, 32, 15, 5, 2560))},
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
    base = FLAVORS[section.flavor]
    if ("dim" in changes or "n_heads" in changes) and not base.explicit_head_dim():
        changes["head_dim"] = None  # derived from dim / n_heads again (a Qwen3 flavor's own head_dim stays)
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    return replace(base, **changes)
