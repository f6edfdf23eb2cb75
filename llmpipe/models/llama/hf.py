"""State-dict adapter between llmpipe's LLaMA names and Hugging Face's LlamaForCausalLM.

Both use the rotate-half RoPE convention, so the mapping is a pure rename (no q/k permutation).
"""

from __future__ import annotations

import re
from pathlib import Path

from llmpipe.errors import UserError
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
    if args.rope_scaling:
        cfg["rope_scaling"] = dict(args.rope_scaling)
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
        cfg["bos_token_id"] = eos_id
    return cfg


# -- reading a Hugging Face LLaMA-family folder (model.init_from) ------------------------------------

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
CONFIG_JSON, INDEX_JSON, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # old checkpoints' buffers


class HFFolderError(UserError, ValueError):
    """A model.init_from folder that llmpipe cannot or will not load; one line naming file and field."""


def _read_json(path: Path) -> dict:
    from llmpipe.manifest import read_json_file

    return read_json_file(path, HFFolderError)


def _rope(c: dict, where: Path) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling parameters or None), from either config.json generation:
    top-level rope_theta + rope_scaling (transformers 4) or rope_parameters (transformers 5)."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    field = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise HFFolderError(f"{where}: {field}: expected an object")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(c.get("rope_theta", params.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFFolderError(f"{where}: partial_rotary_factor: only 1.0 (full rotary) is supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFFolderError(f"{where}: {field}.rope_type: {kind!r} is not supported (default or llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if not isinstance(params.get(k), (int, float))]
    if missing:
        raise HFFolderError(f"{where}: {field}: llama3 scaling needs {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: float(params[k]) for k in keys[:3]},
                   keys[3]: int(params[keys[3]])}


# config.json's sizes and the ModelArgs field each becomes (whose bound, llmpipe.models.limits.MODEL_LIMITS, it gets)
_SIZES = (("num_hidden_layers", "n_layers"), ("hidden_size", "dim"), ("intermediate_size", "ffn_dim"),
          ("num_attention_heads", "n_heads"), ("num_key_value_heads", "n_heads"), ("vocab_size", "vocab_size"),
          ("max_position_embeddings", "max_seq_len"))


def _sizes(c: dict, where: Path, max_seq_len: int | None) -> dict[str, int]:
    """config.json's sizes, each an integer within llmpipe's bounds, checked before anything is
    computed from them (a config.json with 10^6 layers of hidden 10^6 is refused here, in a line)."""
    from llmpipe.models.limits import MODEL_LIMITS

    defaults = {"num_key_value_heads": c.get("num_attention_heads"), "max_position_embeddings": 2048}
    out = {}
    for key, field in _SIZES:
        if key == "max_position_embeddings" and max_seq_len is not None:
            out[key] = max_seq_len  # model.max_seq_len (bounded by the config) sizes the RoPE table instead
            continue
        value = c.get(key) if c.get(key) is not None else defaults.get(key)
        if value is None:
            raise HFFolderError(f"{where}: {key}: required field is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise HFFolderError(f"{where}: {key}: expected an integer, got {value!r:.40}")
        limit = MODEL_LIMITS[field]
        if not 1 <= value <= limit:
            hint = "; set model.max_seq_len to train shorter" if field == "max_seq_len" else ""
            raise HFFolderError(f"{where}: {key}: {value} is outside 1..{limit}, llmpipe's bound on model.{field} "
                                f"(far above the largest LLaMA){hint}")
        out[key] = value
    return out


def read_config(folder: str | Path, max_seq_len: int | None = None) -> tuple[ModelArgs, dict]:
    """ModelArgs for an HF LlamaForCausalLM / MistralForCausalLM folder, and facts the loader needs
    (tie_word_embeddings, sliding_window). Anything llmpipe's model does not compute the same way, or
    any size beyond llmpipe.models.limits.MODEL_LIMITS, is refused with one line naming the field."""
    from llmpipe.models.limits import numeric_problem

    where = Path(folder) / CONFIG_JSON
    c = _read_json(where)
    archs = c.get("architectures") or []
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
        raise HFFolderError(f"{where}: architectures: {archs!r} is not supported ({' or '.join(ARCHITECTURES)})")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if c.get(key, want) != want:
            raise HFFolderError(f"{where}: {key}: {c[key]!r} is not supported (llmpipe's LLaMA has {want!r})")
    n = _sizes(c, where, max_seq_len)
    try:
        theta, scaling = _rope(c, where)
        args = ModelArgs(dim=n["hidden_size"], n_layers=n["num_hidden_layers"], n_heads=n["num_attention_heads"],
                         n_kv_heads=n["num_key_value_heads"], vocab_size=n["vocab_size"],
                         ffn_dim=n["intermediate_size"], max_seq_len=n["max_position_embeddings"],
                         rope_theta=theta, norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_scaling=scaling)
    except (TypeError, ValueError, OverflowError) as err:
        raise HFFolderError(f"{where}: {err}") from None
    problem = numeric_problem({"rope_theta": theta, "rms_norm_eps": args.norm_eps,
                               **{f"rope_scaling.{k}": v for k, v in (scaling or {}).items() if k != "rope_type"}})
    if problem:
        raise HFFolderError(f"{where}: {problem}")
    if c.get("head_dim") not in (None, args.head_dim):
        raise HFFolderError(f"{where}: head_dim: {c['head_dim']} differs from hidden_size / num_attention_heads "
                            f"= {args.head_dim}, which llmpipe's LLaMA assumes")
    return args, {"tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
                  "sliding_window": c.get("sliding_window")}


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of llmpipe's Transformer(args), name -> shape, by arithmetic (what building it on
    meta would give; tests/unit/test_hf_bounds.py holds the two equal)."""
    d, hd, kv = args.dim, args.head_dim, args.n_kv_heads * args.head_dim
    layer = {"attention.wq": (args.n_heads * hd, d), "attention.wk": (kv, d), "attention.wv": (kv, d),
             "attention.wo": (d, args.n_heads * hd), "feed_forward.w1": (args.ffn_dim, d),
             "feed_forward.w2": (d, args.ffn_dim), "feed_forward.w3": (args.ffn_dim, d),
             "attention_norm": (d,), "ffn_norm": (d,)}
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    return {**shapes, "norm.weight": (d,), "output.weight": (args.vocab_size, d)}


class HFWeights:
    """The safetensors of an HF folder (one file, or shards listed by model.safetensors.index.json),
    opened memory-mapped; `tensor(name)` reads one llmpipe-named parameter as fp32 on CPU.

    Tied embeddings (tie_word_embeddings) are untied on load: the output head starts as a copy of
    the embedding and the two are trained (and written by consolidate) separately."""

    def __init__(self, folder: str | Path, args: ModelArgs, tied: bool):
        from safetensors import safe_open

        self.folder, self.args, self.tied = Path(folder), args, tied
        files = self._files()
        self._open = {f: safe_open(str(self.folder / f), framework="pt") for f in sorted(set(files.values()))}
        self._where = {name: files[name] for name in files if not _IGNORED.match(name)}
        self._check_names()

    def _files(self) -> dict[str, str]:
        """HF tensor name -> the file holding it (inside the folder)."""
        index = self.folder / INDEX_JSON
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFFolderError(f"{index}: weight_map: expected a non-empty object")
            for f in set(weight_map.values()):
                p = Path(str(f))
                if p.is_absolute() or ".." in p.parts or not (self.folder / p).resolve().is_relative_to(
                        self.folder.resolve()):
                    raise HFFolderError(f"{index}: weight_map: {f!r} is outside the folder")
                if not (self.folder / p).is_file():
                    raise HFFolderError(f"{self.folder / p}: listed in {INDEX_JSON} but missing")
            return {str(k): str(v) for k, v in weight_map.items()}
        if not (self.folder / SINGLE).is_file():
            raise HFFolderError(f"{self.folder}: neither {SINGLE} nor {INDEX_JSON}")
        from safetensors import safe_open

        try:
            with safe_open(str(self.folder / SINGLE), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE)
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise HFFolderError(f"{self.folder / SINGLE}: not a valid safetensors file ({err})") from None

    def hf_name(self, name: str) -> str:
        hf = to_hf_name(name)
        return "model.embed_tokens.weight" if hf == "lm_head.weight" and self.tied and hf not in self._where else hf

    def _check_names(self) -> None:
        expected = param_shapes(self.args)  # by arithmetic: nothing is built before the shapes agree
        wanted = {self.hf_name(n) for n in expected}
        extra = sorted(set(self._where) - wanted)
        if extra:
            raise HFFolderError(f"{self.folder}: weights llmpipe's LLaMA has no place for: {', '.join(extra[:5])}"
                                f"{' ...' if len(extra) > 5 else ''}")
        for name, shape in expected.items():
            hf = self.hf_name(name)
            if hf not in self._where:
                raise HFFolderError(f"{self.folder}: weight {hf} is missing")
            got = tuple(self._open[self._where[hf]].get_slice(hf).get_shape())
            if got != shape:
                raise HFFolderError(f"{self.folder / self._where[hf]}: {hf} has shape {list(got)}, config.json "
                                    f"implies {list(shape)}")

    def tensor(self, name: str):
        """Parameter `name` (llmpipe naming, wrapper prefixes removed) as fp32 on CPU."""
        hf = self.hf_name(name)
        return self._open[self._where[hf]].get_tensor(hf).float()


def pretrained(section, args: ModelArgs):
    """`source` for Transformer.init_weights reading model.init_from's weights (None without it)."""
    if not getattr(section, "init_from", None):
        return None
    _, facts = read_config(section.init_from, section.max_seq_len)
    return HFWeights(section.init_from, args, facts["tie_word_embeddings"]).tensor


def weights_identity(folder: str | Path) -> dict:
    """What the train fingerprint records of an init_from folder: config.json, the index and every
    safetensors file's header and size (not a hash of every byte: the header lists every tensor's
    name, dtype, shape and offsets)."""
    import hashlib

    folder = Path(folder)
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
        h.update(p.name.encode())
        try:
            with open(p, "rb") as f:
                if p.suffix == ".safetensors":
                    head = f.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else 0
                    h.update(head + f.read(min(n, 100 << 20)))
                    h.update(str(p.stat().st_size).encode())
                else:
                    h.update(f.read())
        except OSError as err:
            h.update(str(err).encode())
    return {"init_from": str(folder.resolve()), "identity": h.hexdigest()}
