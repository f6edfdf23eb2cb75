"""Bounds on a model's dimensions, for config overrides and an init_from config.json alike, so that an
absurd size is refused before anything is built (config.json with 10^6 layers of hidden 10^6 once
took 6 GB and minutes). Room above the largest real LLaMA (3.1 405B: 126 layers, hidden 16384, ffn
53248, 128 heads, vocab 128256, 131072 positions): 8x the layers, 4x the hidden size, ~5x the ffn,
8x the heads, 32x the vocabulary, 8x the context. No torch import: config.py reads it."""

MODEL_LIMITS = {"n_layers": 1024, "dim": 65536, "ffn_dim": 262144, "n_heads": 1024, "vocab_size": 1 << 22,
                "max_seq_len": 1 << 20}
