"""What every Hugging Face family shares: the parameter names (Llama's, which Mistral, Qwen2 and Qwen3
keep, plus the bias and qk-norm weights) and the reading of config.json into ModelArgs, with the checks
that refuse what llmpipe's decoder does not compute the same way (one line naming the field and value).

A family is an `Adapter`: its architecture class and model_type, transformers' defaults for the fields
its config.json may leave out, which of the decoder's options it fixes (attn_bias, qk_norm), and the
fields it refuses. llmpipe.models.adapters registers one per architecture name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.errors import UserError
from llmpipe.models.llama.model import ModelArgs


class HFFolderError(UserError, ValueError):
    """A model.init_from folder that llmpipe cannot or will not load; one line naming file and field."""


_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
          "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
          "ffn_norm": "post_attention_layernorm"}
_INVERSE = {v: k for k, v in _LAYER.items()}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def to_hf_name(name: str) -> str:
    """llmpipe's parameter name -> transformers' (every family here: Llama's names)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def from_hf_name(name: str) -> str:
    inverse_top = {v: k for k, v in _TOP.items()}
    if name in inverse_top:
        return inverse_top[name]
    m = _HF_LAYER_RE.match(name)
    if not m or m.group(2) not in _INVERSE:
        raise KeyError(f"unknown Hugging Face Llama parameter {name!r}")
    return f"layers.{m.group(1)}.{_INVERSE[m.group(2)]}.{m.group(3)}"


def _rope(c: dict, where: Path) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling parameters or None), from either config.json generation:
    top-level rope_theta + rope_scaling (transformers 4) or rope_parameters (transformers 5)."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise HFFolderError(f"{where}: {key}: expected an object")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = c.get("rope_theta", params.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise HFFolderError(f"{where}: rope_theta: expected a positive number, got {theta!r:.40}")
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFFolderError(f"{where}: partial_rotary_factor: {partial!r:.40} is not supported (llmpipe rotates "
                            "the whole head, 1.0)")
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFFolderError(f"{where}: {key}.rope_type: {kind!r:.40} is not supported (default or llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if isinstance(params.get(k), bool) or not isinstance(params.get(k), (int, float))]
    if missing:
        raise HFFolderError(f"{where}: {key}: llama3 scaling needs {', '.join(missing)}")
    return float(theta), {"rope_type": "llama3", **{k: float(params[k]) for k in keys[:3]},
                          keys[3]: int(params[keys[3]])}


# config.json's sizes and the ModelArgs field each becomes (whose bound, llmpipe.models.limits.MODEL_LIMITS, it gets)
_SIZES = (("num_hidden_layers", "n_layers"), ("hidden_size", "dim"), ("intermediate_size", "ffn_dim"),
          ("num_attention_heads", "n_heads"), ("num_key_value_heads", "n_heads"), ("vocab_size", "vocab_size"),
          ("max_position_embeddings", "max_seq_len"), ("head_dim", "dim"))


def _sizes(c: dict, where: Path, max_seq_len: int | None, defaults: dict) -> dict[str, int | None]:
    """config.json's sizes, each an integer within llmpipe's bounds, checked before anything is
    computed from them (a config.json with 10^6 layers of hidden 10^6 is refused here, in a line)."""
    from llmpipe.models.limits import MODEL_LIMITS

    defaults = {"num_key_value_heads": c.get("num_attention_heads"), "max_position_embeddings": 2048, **defaults}
    out: dict[str, int | None] = {}
    for key, target in _SIZES:
        if key == "max_position_embeddings" and max_seq_len is not None:
            out[key] = max_seq_len  # model.max_seq_len (bounded by the config) sizes the RoPE table instead
            continue
        value = c.get(key) if c.get(key) is not None else defaults.get(key)
        if value is None and key == "head_dim":
            out[key] = None  # hidden_size / num_attention_heads
            continue
        if value is None:
            raise HFFolderError(f"{where}: {key}: required field is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise HFFolderError(f"{where}: {key}: expected an integer, got {value!r:.40}")
        limit = MODEL_LIMITS[target]
        if not 1 <= value <= limit:
            hint = "; set model.max_seq_len to train shorter" if target == "max_seq_len" else ""
            raise HFFolderError(f"{where}: {key}: {value} is outside 1..{limit}, llmpipe's bound on model.{target} "
                                f"(far above the largest LLaMA){hint}")
        out[key] = value
    return out


# config.json fields the written hf/config.json carries from the source as they are (after the checks):
# the special-token ids, the RoPE fields in the source's own spelling, the window fields (inert where
# reading accepted them) and the context the source was made for.
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "rope_theta", "rope_scaling", "rope_parameters",
           "max_position_embeddings", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
           "transformers_version")


@dataclass(frozen=True)
class Adapter:
    """One Hugging Face family: how its config.json becomes ModelArgs and back. The weight names are
    the shared ones above (`to_hf_name`)."""

    architecture: str  # config.json's architectures[0], e.g. Qwen3ForCausalLM
    model_type: str
    # transformers' config-class defaults for the fields this family's config.json may leave out
    defaults: dict[str, Any] = field(default_factory=dict)
    attn_bias: bool = False  # q/k/v projections with bias (Qwen2's fixed layout)
    qk_norm: bool = False  # q_norm / k_norm (Qwen3)
    # fields that must hold this value (anything else computes differently): field -> llmpipe's value
    fixed: dict[str, Any] = field(default_factory=lambda: {"hidden_act": "silu", "mlp_bias": False,
                                                           "attention_bias": False})
    # the sliding window: "always" (Mistral: set means every layer), "flag" (Qwen: use_sliding_window), None
    window: str | None = None
    write_head_dim: bool = True  # whether config.json spells head_dim out (Qwen2's config class has none)

    def read(self, c: dict, where: Path, max_seq_len: int | None) -> tuple[ModelArgs, dict]:
        """ModelArgs of config.json `c`, and facts the loader needs (tie_word_embeddings)."""
        for key, want in self.fixed.items():
            got = c.get(key, want)
            if got != want:
                raise HFFolderError(f"{where}: {key}: {got!r:.40} is not supported (llmpipe's {self.architecture} "
                                    f"has {want!r})")
        n = _sizes(c, where, max_seq_len, self.defaults)
        tied = c.get("tie_word_embeddings", self.defaults.get("tie_word_embeddings", False))
        if not isinstance(tied, bool):
            raise HFFolderError(f"{where}: tie_word_embeddings: expected true or false, got {tied!r:.40}")
        eps = c.get("rms_norm_eps", self.defaults.get("rms_norm_eps", 1e-6))
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise HFFolderError(f"{where}: rms_norm_eps: expected a positive number, got {eps!r:.40}")
        theta, scaling = _rope(self._with_default_theta(c), where)
        _check_token_ids(c, where, n["vocab_size"])
        try:
            args = ModelArgs(dim=n["hidden_size"], n_layers=n["num_hidden_layers"], n_heads=n["num_attention_heads"],
                             n_kv_heads=n["num_key_value_heads"], vocab_size=n["vocab_size"],
                             ffn_dim=n["intermediate_size"], max_seq_len=n["max_position_embeddings"],
                             rope_theta=theta, norm_eps=float(eps), rope_scaling=scaling, head_dim=n["head_dim"],
                             tie_embeddings=tied, attn_bias=self.attn_bias, qk_norm=self.qk_norm)
        except (TypeError, ValueError, OverflowError) as err:
            raise HFFolderError(f"{where}: {err}") from None
        self._check_window(c, where, args)
        return args, {"tie_word_embeddings": tied, "sliding_window": c.get("sliding_window")}

    def _with_default_theta(self, c: dict) -> dict:
        """config.json with the family's default rope_theta where neither spelling gives one."""
        params = c.get("rope_parameters")
        if "rope_theta" in c or (isinstance(params, dict) and "rope_theta" in params):
            return c
        return {**c, "rope_theta": self.defaults.get("rope_theta", 10000.0)}

    def _check_window(self, c: dict, where: Path, args: ModelArgs) -> None:
        """A sliding window is refused only where it takes effect: some layer slides (Mistral: any window;
        Qwen: use_sliding_window and a layer at or past max_window_layers, or transformers 5's layer_types)
        and the window is shorter than the longest sequence the run uses (model.max_seq_len, else the
        folder's max_position_embeddings): below it, windowed and full attention are the same."""
        window = c.get("sliding_window")
        if self.window is None or window is None:
            return
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise HFFolderError(f"{where}: sliding_window: expected a positive integer or null, got {window!r:.40}")
        types = c.get("layer_types")
        if isinstance(types, list):
            slides = "sliding_attention" in types
        elif self.window == "flag":
            first = c.get("max_window_layers", self.defaults.get("max_window_layers", 0))
            slides = c.get("use_sliding_window", False) is True and (not isinstance(first, int)
                                                                     or first < args.n_layers)
        else:
            slides = True
        if slides and window < args.max_seq_len:
            flag = " (use_sliding_window: true)" if self.window == "flag" else ""
            raise HFFolderError(f"{where}: sliding_window: {window}{flag} is shorter than the model's max_seq_len "
                                f"{args.max_seq_len}, and llmpipe's attention is full; set model.max_seq_len to at "
                                f"most {window}")

    def write(self, args: ModelArgs, dtype: str, source: dict | None = None) -> dict:
        """config.json of this family for a model of `args` (weights in `dtype`, fp32 or bf16). `source`: the
        init_from folder's config.json, whose special-token ids, RoPE and window fields are kept as they are."""
        torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        cfg: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads, "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "hidden_act": "silu", "tie_word_embeddings": args.tie_embeddings,
        }
        if self.write_head_dim or args.explicit_head_dim():
            cfg["head_dim"] = args.head_dim
        cfg.update({k: v for k, v in self.fixed.items() if k != "hidden_act"})
        if args.rope_scaling:
            cfg["rope_scaling"] = dict(args.rope_scaling)
        if source is not None:
            cfg.update({k: source[k] for k in CARRIED if k in source})
            if "rope_parameters" in source:  # transformers 5's spelling holds theta and type itself
                cfg.pop("rope_theta", None)
                cfg.pop("rope_scaling", None)
        dtype_key = "dtype" if source is not None and "dtype" in source and "torch_dtype" not in source \
            else "torch_dtype"
        cfg[dtype_key] = torch_dtype
        return cfg


def _check_token_ids(c: dict, where: Path, vocab_size: int) -> None:
    """bos/pad_token_id: null or one id in the vocabulary; eos_token_id also a list of them (Llama 3's
    [128001, 128008, 128009]); hf/config.json carries them as they are."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = c.get(key)
        if value is None:
            continue
        values = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if not values or len(values) > 64 or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise HFFolderError(f"{where}: {key}: expected a token id{' or a list of them' if key[0] == 'e' else ''}"
                                f", got {value!r:.60}")
        bad = [v for v in values if not 0 <= v < vocab_size]
        if bad:
            raise HFFolderError(f"{where}: {key}: {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFFolderError(f"{path}: not found") from None
    except (OSError, ValueError) as err:
        raise HFFolderError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise HFFolderError(f"{path}: expected a JSON object")
    return data
