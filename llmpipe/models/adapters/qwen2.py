"""Qwen2ForCausalLM (Qwen2, Qwen2.5): q/k/v projections always carry a bias, o_proj none; the smaller
models tie their embeddings. Its shipped configs carry sliding_window with use_sliding_window: false,
which takes no effect and is read."""

from llmpipe.models.adapters.base import Adapter

ADAPTER = Adapter(architecture="Qwen2ForCausalLM", model_type="qwen2",
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                            "max_window_layers": 28},
                  attn_bias=True, fixed={"hidden_act": "silu"}, window="flag", write_head_dim=False)
