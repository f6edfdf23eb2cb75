"""GGUF file (what llama.cpp and Ollama users hold) -> a Hugging Face folder that `model.init_from` takes.

    llmpipe import-gguf SmolLM2-135M-Instruct.Q4_1.gguf artifacts/smollm2-135m-instruct

The file is read with the `gguf` package (GGUFReader, memory-mapped) and checked in full before anything is
written: the architecture, every size against llmpipe.models.limits, every tensor's name, type, shape and
byte range. Then the weights are dequantised (gguf.quants.dequantize) to fp32 and written as safetensors,
one shard of at most SHARD_BYTES at a time (so memory stays at a shard, whatever the model's size), with
llama.cpp's q/k row permutation undone (convert_hf_to_gguf.py `permute` interleaves the two rotary halves
of each head; transformers' GGUF loader reverses it the same way). The tokenizer comes from transformers'
own GGUF tokenizer conversion (AutoTokenizer.from_pretrained(..., gguf_file=...)); its tokenizer.json is
kept and tokenizer_config.json (special tokens, the file's chat template) and generation_config.json are
written here from the file's metadata. transformers' save_pretrained refuses a GGUF-loaded model, which
is why the folder is written here.

Everything goes into a temporary sibling folder that is renamed into place at the end: a file refused
half-way, or an interrupted import, leaves no half-written folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from llmpipe.errors import UserError
from llmpipe.models.limits import MODEL_LIMITS

SHARD_BYTES = 2 << 30  # fp32 bytes per safetensors shard: the most one import holds in memory at a time
MAX_TENSORS, MAX_FIELDS = 1 << 20, 1 << 16  # header counts beyond any real model's (a 405B has ~1100 tensors)
ARCHITECTURES = ("llama",)

# GGUF tensor names (per block after "blk.N.") -> Hugging Face LlamaForCausalLM names
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}


class GGUFError(UserError, ValueError):
    """A GGUF file llmpipe cannot convert; one line naming the file and the field or tensor."""


def _header_counts(path: Path) -> None:
    """The magic and the two counts of the fixed header, checked before GGUFReader loops over them."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (no GGUF header)")
    version = int.from_bytes(head[4:8], "little")
    tensors, fields = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    if tensors > MAX_TENSORS or fields > MAX_FIELDS:
        raise GGUFError(f"{path}: header counts {tensors} tensors and {fields} metadata fields, beyond "
                        f"{MAX_TENSORS} / {MAX_FIELDS}: corrupt")


def open_reader(path: Path):
    """gguf.GGUFReader over `path`; a truncated or corrupt file is one line."""
    import gguf

    if not path.is_file():
        raise GGUFError(f"{path}: not found (or not a file)")
    _header_counts(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, EOFError) as err:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({type(err).__name__}: "
                        f"{str(err)[:120] or 'cannot be parsed'})") from None
    reader.source = path  # NOTE: the reader keeps no path of its own; every error line names the file
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as err:
        raise GGUFError(f"{reader.source}: {key}: unreadable ({err})") from None


def _int(reader, key: str, default: int | None = None, bound: str | None = None) -> int:
    value = _field(reader, key, default)
    if value is None:
        raise GGUFError(f"{reader.source}: {key}: required metadata is missing")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GGUFError(f"{reader.source}: {key}: expected an integer, got {value!r:.40}")
    value = int(value)
    if bound is not None and not 1 <= value <= MODEL_LIMITS[bound]:
        raise GGUFError(f"{reader.source}: {key}: {value} is outside 1..{MODEL_LIMITS[bound]}, llmpipe's bound on "
                        f"model.{bound}")
    return value


def _f32(value) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def read_config(reader) -> dict:
    """config.json for transformers' LlamaForCausalLM, from the file's metadata, every size bounded."""
    where = reader.source
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{where}: general.architecture: {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    a = f"{arch}."
    n_heads = _int(reader, a + "attention.head_count", bound="n_heads")
    n_kv = _int(reader, a + "attention.head_count_kv", n_heads, bound="n_heads")
    dim = _int(reader, a + "embedding_length", bound="dim")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _int(reader, a + "vocab_size", len(tokens.data) if tokens is not None else None, bound="vocab_size")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
           "intermediate_size": _int(reader, a + "feed_forward_length", bound="ffn_dim"),
           "num_hidden_layers": _int(reader, a + "block_count", bound="n_layers"),
           "num_attention_heads": n_heads, "num_key_value_heads": n_kv, "vocab_size": vocab,
           "max_position_embeddings": _int(reader, a + "context_length", bound="max_seq_len"),
           "rms_norm_eps": _f32(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
           "rope_theta": _f32(_field(reader, a + "rope.freq_base", 10000.0)), "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
    if dim % n_heads or n_heads % n_kv:
        raise GGUFError(f"{where}: {a}embedding_length {dim} / attention.head_count {n_heads} / head_count_kv "
                        f"{n_kv}: heads must divide the width and kv heads the heads")
    cfg["head_dim"] = dim // n_heads
    rot = _field(reader, a + "rope.dimension_count", cfg["head_dim"])
    if rot != cfg["head_dim"]:
        raise GGUFError(f"{where}: {a}rope.dimension_count: {rot} differs from head_dim {cfg['head_dim']} "
                        "(partial rotary is not supported)")
    scaling = _field(reader, a + "rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFError(f"{where}: {a}rope.scaling.type: {scaling!r} is not supported (none)")
    return cfg


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the numpy shape (rows, cols) config.json's sizes give it."""
    d, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    block = {"attn_norm": (d,), "attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, d),
             "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f), "ffn_norm": (d,)}
    out = {"token_embd.weight": (v, d), "output_norm.weight": (d,), "output.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        out.update({f"blk.{i}.{k}.weight": shape for k, shape in block.items()})
    return out


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.weight"


def check_tensors(reader, cfg: dict) -> list:
    """The reader's tensors, each checked: a known name, a type gguf can dequantise, the shape the
    metadata gives, its bytes inside the file. Returns them in file order."""
    import gguf
    from gguf.quants import _type_traits

    where, size = reader.source, os.path.getsize(reader.source)
    expected = _expected_shapes(cfg)
    dequantisable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *_type_traits}
    seen = set()
    for t in reader.tensors:
        if t.name not in expected:
            raise GGUFError(f"{where}: tensor {t.name!r} is not part of a llama model llmpipe converts")
        if t.tensor_type not in dequantisable:
            raise GGUFError(f"{where}: tensor {t.name}: type {t.tensor_type.name} cannot be dequantised")
        shape = tuple(int(n) for n in reversed(t.shape))
        if shape != expected[t.name]:
            raise GGUFError(f"{where}: tensor {t.name}: shape {shape} disagrees with the metadata's "
                            f"{expected[t.name]}")
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        need = int(np.prod(shape)) // block * type_size
        if shape[-1] % block or t.n_bytes != need or t.data_offset + need > size:
            raise GGUFError(f"{where}: tensor {t.name}: {need} bytes at offset {t.data_offset} do not fit the "
                            f"file's {size} bytes (truncated?)")
        seen.add(t.name)
    missing = sorted(set(expected) - seen - {"output.weight"})
    if missing:
        raise GGUFError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    return list(reader.tensors)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows: (heads, 2, hd/2, in) was stored as (heads, hd/2, 2, in)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantised(t, cfg: dict):
    """One tensor as an fp32 torch tensor in Hugging Face's layout."""
    import torch
    from gguf.quants import dequantize

    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(int(n) for n in reversed(t.shape)))
    if t.name.endswith(".attn_q.weight"):
        w = _unpermute(w, cfg["num_attention_heads"])
    elif t.name.endswith(".attn_k.weight"):
        w = _unpermute(w, cfg["num_key_value_heads"])
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))  # off the read-only map


def _shards(tensors: list) -> list[list]:
    """Tensors grouped into shards of at most SHARD_BYTES of fp32 (one tensor alone may exceed it)."""
    shards, current, used = [], [], 0
    for t in tensors:
        nbytes = int(np.prod([int(n) for n in t.shape])) * 4
        if current and used + nbytes > SHARD_BYTES:
            shards.append(current)
            current, used = [], 0
        current.append(t)
        used += nbytes
    return shards + ([current] if current else [])


def write_weights(tensors: list, cfg: dict, out: Path) -> None:
    """model.safetensors (or shards with model.safetensors.index.json), written one shard at a time."""
    from safetensors.torch import save_file

    shards = _shards(tensors)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        data = {hf_name(t.name): dequantised(t, cfg) for t in shard}
        save_file(data, str(out / name), metadata={"format": "pt"})
        total += sum(x.numel() * 4 for x in data.values())
        weight_map.update({k: name for k in data})
        del data
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _special(reader, tokens: list[str] | None) -> dict:
    """{bos,eos,unk,pad}_token(_id) the file names, ids checked against its vocabulary."""
    out = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is None:
            continue
        if tokens is None or not 0 <= int(value) < len(tokens):
            raise GGUFError(f"{reader.source}: tokenizer.ggml.{key}: {value} is not a token of the vocabulary")
        out[f"{name}_token_id"], out[f"{name}_token"] = int(value), tokens[int(value)]
    return out


def write_tokenizer(reader, path: Path, cfg: dict, out: Path) -> None:
    """tokenizer.json (transformers' GGUF conversion), tokenizer_config.json and generation_config.json."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise GGUFError(f"{path}: tokenizer: cannot be converted ({str(err)[:160]})") from None
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    special = _special(reader, tokens)
    if len(tok) > cfg["vocab_size"]:
        raise GGUFError(f"{path}: tokenizer: {len(tok)} tokens, more than the model's vocab_size "
                        f"{cfg['vocab_size']}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg["max_position_embeddings"],
              **{k: v for k, v in special.items() if not k.endswith("_id")},
              "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False))}
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    ids = {k: v for k, v in special.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg.update(ids)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "generation_config.json").write_text(json.dumps({**ids, "_from_model_config": True}, indent=2))


def import_gguf(src: str | Path, dest: str | Path) -> dict:
    """Convert `src` (a GGUF file) into the HF folder `dest` (which must not exist yet). Returns config.json."""
    src, dest = Path(src), Path(dest)
    if dest.exists():
        raise GGUFError(f"{dest}: already exists (choose a new folder, or remove it)")
    reader = open_reader(src)
    cfg = read_config(reader)
    tensors = check_tensors(reader, cfg)
    cfg["tie_word_embeddings"] = not any(t.name == "output.weight" for t in tensors)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_tokenizer(reader, src, cfg, tmp)
        write_weights(tensors, cfg, tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg
