"""Qwen3ForCausalLM (dense): an RMSNorm over head_dim on each head of q and k before RoPE (q_norm,
k_norm), an explicit head_dim (128 by default, not hidden / heads: 0.6B has 16 heads of 128 on hidden 1024),
no bias unless attention_bias (then o_proj too: refused); 0.6B-4B tie their embeddings."""

from llmpipe.models.adapters.base import Adapter

ADAPTER = Adapter(architecture="Qwen3ForCausalLM", model_type="qwen3",
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                            "head_dim": 128, "max_window_layers": 28},
                  qk_norm=True, fixed={"hidden_act": "silu", "attention_bias": False}, window="flag")
