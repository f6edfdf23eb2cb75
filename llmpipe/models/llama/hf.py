"""State-dict adapter between llmpipe's LLaMA names and Hugging Face's LlamaForCausalLM.

Both use the rotate-half RoPE convention, so the mapping is a pure rename (no q/k permutation).
"""

from __future__ import annotations

import re

from llmpipe.models.llama.model import ModelArgs

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
          "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
          "ffn_norm": "post_attention_layernorm"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")


def to_hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"


def from_hf_name(name: str) -> str:
    inverse_top = {v: k for k, v in _TOP.items()}
    if name in inverse_top:
        return inverse_top[name]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.weight$", name)
    inverse = {v: k for k, v in _LAYER.items()}
    if not m or m.group(2) not in inverse:
        raise KeyError(f"unknown Hugging Face Llama parameter {name!r}")
    return f"layers.{m.group(1)}.{inverse[m.group(2)]}.weight"


def hf_config(args: ModelArgs, dtype: str, eos_id: int | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
    }
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
        cfg["bos_token_id"] = eos_id
    return cfg
