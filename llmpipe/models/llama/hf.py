"""A Hugging Face folder in and out: llmpipe's names <-> transformers', config.json <-> ModelArgs, the
safetensors of a model.init_from folder. Each family's config translation and refusals live in its adapter
(llmpipe.models.adapters: Llama, Mistral, Qwen2, Qwen3); this module picks the adapter by the folder's
architecture and keeps the functions the stages call.

Every family uses the rotate-half RoPE convention, so the mapping is a pure rename (no q/k permutation).
"""

from __future__ import annotations

import re
from pathlib import Path

from llmpipe.models.adapters import ADAPTERS, HFFolderError, for_args, from_hf_name, to_hf_name
from llmpipe.models.adapters.base import read_json as _read_json
from llmpipe.models.llama.model import ModelArgs

__all__ = ["ARCHITECTURES", "HFFolderError", "HFWeights", "from_hf_name", "hf_config", "param_shapes", "pretrained",
           "read_config", "read_source_config", "source_hf_config", "to_hf_name", "weights_identity"]


def hf_config(args: ModelArgs, dtype: str, eos_id: int | None = None) -> dict:
    """config.json for a model llmpipe made itself (no source folder): LlamaForCausalLM for the original
    decoder (tied or not), the family whose options it has otherwise; bos = eos = the run's eos id."""
    cfg = for_args(args).write(args, dtype)
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
        cfg["bos_token_id"] = eos_id
    return cfg


def source_hf_config(folder: str | Path, args: ModelArgs, dtype: str) -> dict:
    """config.json for a model fine-tuned from `folder` (model.init_from): the source's architecture
    class and model_type, its special-token ids, RoPE and window fields as they are; the sizes of `args`."""
    c = read_source_config(folder)
    return ADAPTERS[c["architectures"][0]].write(args, dtype, source=c)


# -- reading a Hugging Face folder (model.init_from) --------------------------------------------------

ARCHITECTURES = tuple(ADAPTERS)
CONFIG_JSON, INDEX_JSON, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # old checkpoints' buffers


def read_source_config(folder: str | Path) -> dict:
    """config.json of `folder`, its architecture one llmpipe has an adapter for."""
    where = Path(folder) / CONFIG_JSON
    c = _read_json(where)
    archs = c.get("architectures") or []
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ADAPTERS):
        raise HFFolderError(f"{where}: architectures: {archs!r:.80} is not supported ({', '.join(ARCHITECTURES)})")
    return c


def read_config(folder: str | Path, max_seq_len: int | None = None) -> tuple[ModelArgs, dict]:
    """ModelArgs for an HF folder of a family llmpipe reads (llmpipe.models.adapters), and facts the
    loader needs (tie_word_embeddings, sliding_window). Anything llmpipe's model does not compute the same
    way, or any size beyond llmpipe.models.limits.MODEL_LIMITS, is refused with one line naming the field."""
    c = read_source_config(folder)
    return ADAPTERS[c["architectures"][0]].read(c, Path(folder) / CONFIG_JSON, max_seq_len)


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of llmpipe's Transformer(args), name -> shape, by arithmetic (what building it on
    meta would give; tests/unit/test_hf_bounds.py holds the two equal). A tied head is the embedding:
    no output.weight of its own."""
    d, hd, kv = args.dim, args.head_dim, args.n_kv_heads * args.head_dim
    q = args.n_heads * hd
    layer = {"attention.wq.weight": (q, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d),
             "attention.wo.weight": (d, q), "feed_forward.w1.weight": (args.ffn_dim, d),
             "feed_forward.w2.weight": (d, args.ffn_dim), "feed_forward.w3.weight": (args.ffn_dim, d),
             "attention_norm.weight": (d,), "ffn_norm.weight": (d,)}
    if args.attn_bias:
        layer.update({"attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,)})
    if args.qk_norm:
        layer.update({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)})
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["norm.weight"] = (d,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


class HFWeights:
    """The safetensors of an HF folder (one file, or shards listed by model.safetensors.index.json),
    opened memory-mapped; `tensor(name)` reads one llmpipe-named parameter as fp32 on CPU.

    Tied embeddings (tie_word_embeddings, ModelArgs.tie_embeddings) stay tied: the model's head is its
    embedding, read from model.embed_tokens.weight; an lm_head.weight the file holds anyway is not read
    (transformers ties it over as well). `tied` is kept for callers; args.tie_embeddings decides."""

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
        return to_hf_name(name)

    def _check_names(self) -> None:
        expected = param_shapes(self.args)  # by arithmetic: nothing is built before the shapes agree
        wanted = {self.hf_name(n) for n in expected} | ({"lm_head.weight"} if self.args.tie_embeddings else set())
        extra = sorted(set(self._where) - wanted)
        if extra:
            raise HFFolderError(f"{self.folder}: weights llmpipe's {self._family()} has no place for: "
                                f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
        for name, shape in expected.items():
            hf = self.hf_name(name)
            if hf not in self._where:
                raise HFFolderError(f"{self.folder}: weight {hf} is missing")
            got = tuple(self._open[self._where[hf]].get_slice(hf).get_shape())
            if got != shape:
                raise HFFolderError(f"{self.folder / self._where[hf]}: {hf} has shape {list(got)}, config.json "
                                    f"implies {list(shape)}")

    def _family(self) -> str:
        return "LLaMA" if not (self.args.attn_bias or self.args.qk_norm) else for_args(self.args).architecture

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
