"""A Hugging Face folder (consolidate's hf/) written as GGUF, the file llama.cpp and Ollama load.

`write` reads config.json, model.safetensors and tokenizer.json of a Llama-architecture folder and writes
one GGUF file with the `gguf` package (llama.cpp's own writer): the architecture's metadata, the byte-level
BPE tokenizer (tokens, their types, merges, special ids, the chat template) and the tensors under llama.cpp's
names. The query and key projections are permuted as llama.cpp's convert_hf_to_gguf.py does (llama.cpp's
rotary embedding pairs neighbouring dimensions, Hugging Face's pairs the two halves).

Types (`QUANT_TYPES`): f16 (every matrix in half precision), q8_0 (blocks of 32 int8 and one fp16 scale),
q4_0 (blocks of 32 4-bit and one scale) and q4_1 (blocks of 32 4-bit, a scale and a minimum); in both 4-bit
types the token embedding and the output head stay at q8_0, as llama.cpp's own 4-bit files keep the most
sensitive matrices wider. The norms stay f32 in every type, and a matrix whose rows are not whole blocks of 32
stays f16 (as llama.cpp's own converter does).

How the blocks are chosen (`method`): "rtn" is gguf.quants' numpy port of llama.cpp's reference quantisers
(what llama.cpp's own converter and llama-quantize write without an importance matrix); "hqq" (q4_1 only, its
default) is onnxruntime's half-quadratic quantiser, the recipe that holds on a real model
(docs/measurements/quantisation.md): its scale and float zero point per block are exactly Q4_1's
`d * q + m` (d = scale, m = -zero * scale), so llama.cpp's own Q4_1 kernels run HQQ's weights unchanged.

`write_lora` writes a PEFT LoRA adapter (consolidate's adapter/) as llama.cpp's LoRA GGUF (general.type
adapter; `<tensor>.lora_a` / `.lora_b` beside the base tensor's name, the query and key B permuted as the
base): with the base the fine-tune came from (`llmpipe.infer.lora_rows.write_base`) at q4_1, llama.cpp runs a
fine-tune whose weight changes are below a 4-bit step without rounding them away (`llama --lora`,
llama-cpp-python's `lora_path`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from llmpipe.errors import StageError

QUANT_TYPES = ("f16", "q8_0", "q4_0", "q4_1")
METHODS = ("rtn", "hqq")
# HF name (layer index stripped) -> llama.cpp name
_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_WIDE = ("token_embd.weight", "output.weight")  # kept at q8_0 in a 4-bit file


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name of a Hugging Face Llama parameter."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m is None or m.group(2) not in _LAYER:
        raise StageError(f"GGUF export: no llama.cpp name for the tensor {hf_name!r}")
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotary layout (halves) -> llama.cpp's (neighbouring pairs), as convert_hf_to_gguf.py."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_1_hqq(array: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles; llama.cpp's block_q4_1) of a [rows, K] matrix, K a
    multiple of 32, with the scale and float zero point of onnxruntime's HQQ quantiser in blocks of 32 along K:
    HQQ's `(q - z) * s` is Q4_1's `d * q + m` with d = s, m = -z * s. Same byte shape as gguf.quants.quantize."""
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    rows, k = array.shape
    quantizer = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=32, bits=4))
    out = np.empty((rows, k // 32 * 20), dtype=np.uint8)
    step = max(1, (1 << 22) // k)  # rows per call: bounds HQQ's float copies to a few tens of MB
    for r0 in range(0, rows, step):
        with torch.no_grad():
            q, s, z = quantizer.quantize_internal(torch.from_numpy(np.ascontiguousarray(array[r0:r0 + step])),
                                                  bits=4, group_size=32)
        q = q.numpy().astype(np.uint8).reshape(-1, 2, 16)  # [blocks, halves, 16]: llama.cpp's nibble order
        s, z = s.numpy().reshape(-1, 1), z.numpy().reshape(-1, 1)
        d = s.astype(np.float16).view(np.uint8)
        m = (-z * s).astype(np.float16).view(np.uint8)
        qs = q[:, 0, :] | (q[:, 1, :] << np.uint8(4))
        n = q.shape[0] // (k // 32)
        out[r0:r0 + n] = np.concatenate([d, m, qs], axis=-1).reshape(n, -1)
    return out


def _tensor_type(name: str, array: np.ndarray, qtype: str, method: str = "rtn"):
    """(data to write, GGMLQuantizationType) of one tensor in a file of `qtype`."""
    import gguf

    T = gguf.GGMLQuantizationType
    if array.ndim == 1:
        return array.astype(np.float32), T.F32
    if qtype == "f16":
        return array.astype(np.float16), T.F16
    want = T.Q8_0 if qtype == "q8_0" or name in _WIDE else {"q4_0": T.Q4_0, "q4_1": T.Q4_1}[qtype]
    if array.shape[-1] % gguf.GGML_QUANT_SIZES[want][0]:  # rows not in whole blocks: f16, as convert_hf_to_gguf
        return array.astype(np.float16), T.F16
    if want == T.Q4_1 and method == "hqq":
        return q4_1_hqq(array.astype(np.float32)), want
    return gguf.quants.quantize(array.astype(np.float32), want), want


def _tokenizer(writer, folder: Path, config: dict) -> None:
    """The byte-level BPE tokenizer of tokenizer.json (and the chat template, when the folder has one)."""
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise StageError(f"GGUF export: {folder / 'tokenizer.json'} is a {model.get('type')} tokenizer; "
                         "only byte-level BPE is written")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(added)
    size = int(config["vocab_size"])
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        if i < size:
            tokens[i] = text
            types[i] = gguf.TokenType.CONTROL if text in added else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    template = folder / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text(encoding="utf-8"))


def write(hf_dir: Path, out: Path, qtype: str = "f16", name: str = "llmpipe", method: str | None = None) -> Path:
    """GGUF of the Hugging Face folder `hf_dir` at `qtype` (one of QUANT_TYPES) at `out` (written beside it
    first, then renamed: never half there). An untied or tied head both work: without lm_head.weight the file
    has no output tensor and llama.cpp reuses the embedding. `method` (METHODS): how the 4-bit blocks are
    chosen; default hqq for q4_1, rtn (llama.cpp's reference quantiser) for the other types."""
    import gguf
    from safetensors.numpy import load_file

    if qtype not in QUANT_TYPES:
        raise StageError(f"GGUF export: type {qtype!r} is not one of {', '.join(QUANT_TYPES)}")
    method = method or ("hqq" if qtype == "q4_1" else "rtn")
    if method not in METHODS or (method == "hqq" and qtype != "q4_1"):
        raise StageError(f"GGUF export: method {method!r} with type {qtype!r}: hqq writes q4_1 only, rtn any type")
    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "llama":
        raise StageError(f"GGUF export: {hf_dir / 'config.json'} has model_type {config.get('model_type')!r}; "
                         "only llama is written")
    if config.get("rope_scaling"):
        raise StageError(f"GGUF export: {hf_dir / 'config.json'} has rope_scaling {config['rope_scaling']}, "
                         "which this writer does not carry over; export without export.gguf")
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    dim = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or dim // heads)
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    tensors = load_file(str(hf_dir / "model.safetensors"))
    if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
        del tensors["lm_head.weight"]  # llama.cpp reuses token_embd
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_context_length(int(config.get("max_position_embeddings", 2048)))
    w.add_embedding_length(dim)
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(int(config["vocab_size"]))
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    _tokenizer(w, hf_dir, config)
    for hf_name in sorted(tensors, key=_order):
        array = tensors[hf_name].astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            array = _permute(array, heads)
        elif hf_name.endswith("k_proj.weight"):
            array = _permute(array, kv)
        data, ggml_type = _tensor_type(gguf_name(hf_name), array, qtype, method)
        w.add_tensor(gguf_name(hf_name), data,
                     raw_dtype=ggml_type)
    return _finish(w, tmp, out)


def _finish(w, tmp: Path, out: Path) -> Path:
    """Write the GGUFWriter `w`'s file at `tmp`, then rename it to `out` (never half there)."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    tmp.rename(out)
    return out


def _order(hf_name: str) -> tuple[int, str]:
    m = re.match(r"model\.layers\.(\d+)\.", hf_name)
    return (int(m.group(1)) if m else (-1 if "embed" in hf_name else 10**6)), hf_name


def write_lora(adapter_dir: Path, hf_dir: Path, out: Path, name: str = "llmpipe") -> Path:
    """llama.cpp's LoRA adapter GGUF (f32 A and B) of the PEFT adapter in `adapter_dir` (read and checked by
    llmpipe.infer.lora_rows.Adapter), for the Llama model of `hf_dir` (its config.json: heads for the query and
    key permutation). PEFT's scale alpha / r (or alpha / sqrt(r), rsLoRA) is written as the alpha llama.cpp
    divides by the rank. Written beside `out`, then renamed."""
    import gguf

    from llmpipe.infer.lora_rows import Adapter

    adapter = Adapter.read(adapter_dir)
    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    parent = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    ranks = {a.shape[0] for a, _ in adapter.tensors.values()}
    if len(ranks) != 1:
        raise StageError(f"GGUF export: {adapter_dir} has LoRA ranks {sorted(ranks)}; one rank is written")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter.scale * ranks.pop()))
    for (layer, module), (a, b) in sorted(adapter.tensors.items()):
        base = gguf_name(f"model.layers.{layer}.{parent[module]}.{module}.weight")
        if module == "q_proj":
            b = _permute(b, heads)
        elif module == "k_proj":
            b = _permute(b, kv)
        w.add_tensor(base + ".lora_a", np.ascontiguousarray(a, dtype=np.float32))
        w.add_tensor(base + ".lora_b", np.ascontiguousarray(b, dtype=np.float32))
    return _finish(w, tmp, out)
