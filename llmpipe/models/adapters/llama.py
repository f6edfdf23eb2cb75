"""LlamaForCausalLM: Llama 2/3/3.1/3.2, SmolLM2, and llmpipe's own pre-trained models. Tied embeddings
(Llama 3.2 1B/3B, SmolLM2) and llama3 RoPE scaling are read; attention_bias is refused (Llama's puts a
bias on o_proj too, which llmpipe's decoder does not have)."""

from llmpipe.models.adapters.base import Adapter

ADAPTER = Adapter(architecture="LlamaForCausalLM", model_type="llama",
                  defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False})
