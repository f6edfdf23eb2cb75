"""MistralForCausalLM: Llama's layout with a sliding window on every layer when sliding_window is set,
read where the window is no shorter than the sequences the run uses (then it is full attention)."""

from llmpipe.models.adapters.base import Adapter

ADAPTER = Adapter(architecture="MistralForCausalLM", model_type="mistral",
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
                  fixed={"hidden_act": "silu"}, window="always")
