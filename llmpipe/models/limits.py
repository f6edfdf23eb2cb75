"""Bounds on a model's dimensions, for config overrides and an init_from config.json alike, so that an
absurd size is refused before anything is built (config.json with 10^6 layers of hidden 10^6 once
took 6 GB and minutes). Room above the largest real LLaMA (3.1 405B: 126 layers, hidden 16384, ffn
53248, 128 heads, vocab 128256, 131072 positions): 8x the layers, 4x the hidden size, ~5x the ffn,
8x the heads, 32x the vocabulary, 8x the context. No torch import: config.py reads it."""

MODEL_LIMITS = {"n_layers": 1024, "dim": 65536, "ffn_dim": 262144, "n_heads": 1024, "vocab_size": 1 << 22,
                "max_seq_len": 1 << 20}


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def numeric_problem(fields: dict) -> str | None:
    """The first of a model's numeric settings that the maths cannot use, as "field: value must be ...", or
    None. `fields` maps the name to show (config.json's or the config's) to its value, by kind: a name ending
    in theta or eps is a RoPE base / norm epsilon (finite, > 0); one ending in factor a llama3 RoPE scaling
    factor (finite, > 0: a factor of 0 divides by zero in the frequency bands); one ending in
    original_max_position_embeddings a length (>= 1). A NaN or an infinity here turns every logit into NaN,
    which greedy decoding reads as token 0 everywhere: never let one reach training or parity. Shared by
    config.py (the model overrides, LoRA's alpha) and every init_from reader (config.json)."""
    import math

    for name, value in fields.items():
        if value is None:
            continue
        x = _number(value)
        if name.endswith("original_max_position_embeddings"):
            if x is None or not math.isfinite(x) or x < 1:
                return f"{name}: {value!r} must be a whole number >= 1"
        elif x is None or not math.isfinite(x) or x <= 0:
            return f"{name}: {value!r} must be a finite number > 0"
    return None
