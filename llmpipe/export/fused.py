"""onnxruntime's own graph of a model: onnxruntime-genai's model builder run on consolidate's hf/ folder.

The portable graphs (model.onnx, decoder_static.onnx) stay what ATC needs: standard ops, static
shapes, attention over the whole cache. For onnxruntime, `build` writes a graph of its own with
`python -m onnxruntime_genai.models.builder -i hf/ -o <folder> -p <precision> -e cpu`: one graph for the
prompt and each step, made of onnxruntime's contrib ops (GroupQueryAttention over the filled slots with
the rotary embedding inside, SkipSimplifiedLayerNormalization, MatMulNBits at int4), the cache one
buffer shared by past and present. llmpipe.infer.fused.FusedEngine drives it through a plain
onnxruntime session (no genai runtime), so llmpipe's gates, generate and benchmark see the usual engine.

Why the builder and not onnxruntime's transformer optimizer on llmpipe's own export: on decoder_ort.onnx
(debug flavor, model_type gpt2 or bert) the optimizer fuses the RMSNorms (1 SimplifiedLayerNormalization,
4 SkipSimplifiedLayerNormalization) but no attention and no rotary embedding (0 Attention,
MultiHeadAttention, GroupQueryAttention, RotaryEmbedding): its attention patterns are those of the graphs
torch's exporters make for Hugging Face models. The builder writes the fused graph directly and is what
onnxruntime-genai itself runs, so benchmarks/deploy_vs_peers.py measures llmpipe's engine on the same graph.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from llmpipe.errors import StageError

PRECISIONS = ("fp32", "fp16", "int4", "int8")
PROVIDERS = ("cpu", "cuda")  # the builder's execution providers llmpipe drives (FusedEngine on either)
BUILDER = "onnxruntime_genai.models.builder"
# benchmark.variants whose weight-only quantization the builder applies itself (MatMulNBits at the run's
# benchmark.quantize settings): the ORT-optimised graph of that variant, judged by its gates like any other
ORT_VARIANTS = ("int4", "int8w")
BUILDER_BLOCK_SIZES = (16, 32, 64, 128, 256)  # what the builder's MatMulNBits quantization takes


def weight_only_options(section) -> tuple[str, dict[str, str]] | None:
    """(builder precision, --extra_options) for a benchmark.quantize.<variant> section (WeightOnlySection), or
    None when the builder cannot apply it (2 bits: only the portable graphs get that variant)."""
    precision = {4: "int4", 8: "int8"}.get(section.bits)
    if precision is None:
        return None
    block = section.ort_block_size or section.block_size
    extra = {"block_size": str(block), "accuracy_level": str(section.accuracy_level),
             "is_symmetric": "true" if section.symmetric else "false"}
    if section.head_bits and section.head_bits != section.bits:
        extra["matmul_mixed_precision"] = f"last_matmul:int{section.head_bits}"
        # NOTE: for a tied model the builder (onnxruntime-genai 0.18) shares the head's quantized matrix with
        # the embedding's GatherBlockQuantized, and with the head at other bits it points the Gather at a
        # tensor it never writes (the graph does not load): the embedding stays its own fp32 Gather instead
        extra["shared_embeddings"] = "false"
    return precision, extra


def build_weight_only(hf_dir: Path, out_dir: Path, section, timeout_s: float = 3600,
                      adapter_dir: Path | None = None) -> Path:
    """The CPU graph of a benchmark.quantize.<variant> section (WeightOnlySection) in `out_dir`: round to
    nearest (algorithm rtn) is the builder's own quantization (weight_only_options); hqq is the builder's
    fp32 graph quantized by onnxruntime's MatMulNBitsQuantizer with its HQQ algorithm (the builder has no
    such option), the head at head_bits, the same MatMulNBits ops. `adapter_dir` (a LoRA run's PEFT adapter,
    section.adapter separate): the graph of the base (hf/ with the adapter's product taken off) quantized, the
    adapter appended as rows of its folded nodes (llmpipe.infer.lora_rows). Returns out_dir/model.onnx;
    StageError when the section has no ORT graph (2 bits) or the builder fails."""
    from llmpipe.infer import lora_rows
    from llmpipe.infer.ort import quantize_weight_only

    options = weight_only_options(section)
    if options is None:
        raise StageError(f"ORT-optimised graph: {section.bits}-bit weights are not a precision of the builder")
    if section.algorithm == "rtn":
        return build(hf_dir, out_dir, *options, timeout_s=timeout_s)
    out_dir = Path(out_dir)
    adapter = None
    if adapter_dir is not None and getattr(section, "adapter", "merged") == "separate":
        try:
            adapter = lora_rows.Adapter.read(adapter_dir)
            hf_dir = lora_rows.write_base(hf_dir, adapter, out_dir.with_name(out_dir.name + ".base"))
        except lora_rows.AdapterError as err:
            raise StageError(f"ORT-optimised graph: the separate adapter: {err}") from None
    try:
        fp32 = build(hf_dir, out_dir.with_name(out_dir.name + ".fp32"), "fp32", timeout_s=timeout_s).parent
    finally:
        if adapter is not None:
            shutil.rmtree(hf_dir, ignore_errors=True)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(fp32, tmp, ignore=shutil.ignore_patterns("model.onnx", "model.onnx.data"))
    try:
        quantize_weight_only(fp32 / "model.onnx", tmp / "model.onnx", section.bits,
                             section.ort_block_size or section.block_size, section.accuracy_level,
                             section.symmetric, section.algorithm, section.head_bits, section.zero_points, adapter,
                             kernel=getattr(section, "kernel", "onnxruntime"))
    except lora_rows.AdapterError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StageError(f"ORT-optimised graph: the separate adapter: {err}") from None
    except Exception as err:  # the quantizer's failure names the graph; nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise StageError(f"ORT-optimised graph: onnxruntime's {section.algorithm} quantization of {fp32} failed: "
                         f"{type(err).__name__}: {first}") from None
    finally:
        shutil.rmtree(fp32, ignore_errors=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir / "model.onnx"


# config.json architectures the builder makes a graph of (onnxruntime-genai 0.18's builder.py), among those
# llmpipe reads: each with bias (Qwen2), qk-norm and head_dim (Qwen3), tying and llama3 RoPE (Llama)
BUILDER_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def unsupported_family(hf_dir: Path) -> str | None:
    """Why the builder would not make a graph of the folder's family (said in the manifest; the portable
    graphs stay), or None."""
    import json

    try:
        archs = json.loads((Path(hf_dir) / "config.json").read_text()).get("architectures") or ["?"]
    except (OSError, ValueError) as err:
        return f"{hf_dir}/config.json is not readable ({err})"
    if archs[0] not in BUILDER_FAMILIES:
        return f"onnxruntime-genai's builder does not know {archs[0]} ({', '.join(BUILDER_FAMILIES)})"
    return None


def unavailable_reason() -> str | None:
    """Why the builder cannot run here (its package or transformers missing), or None."""
    for module in ("onnxruntime_genai", "transformers", "onnx_ir"):
        if importlib.util.find_spec(module) is None:
            return f"the Python package {module} is not installed (pip install onnxruntime-genai transformers)"
    return None


def build(hf_dir: Path, out_dir: Path, precision: str = "fp32", extra: dict[str, str] | None = None,
          timeout_s: float = 3600, provider: str = "cpu") -> Path:
    """The builder's graph of the Hugging Face folder `hf_dir` at `precision` for onnxruntime's `provider`
    (cpu, or cuda: a graph for the GPU, fp16 there), in `out_dir` (written beside it first, then moved: never
    half there). `extra`: the builder's --extra_options (int4 / int8: block_size, accuracy_level,
    is_symmetric). Returns out_dir/model.onnx."""
    if provider not in PROVIDERS:
        raise StageError(f"ORT-optimised graph: provider {provider!r} is not one of {', '.join(PROVIDERS)}")
    if precision not in PRECISIONS:
        raise StageError(f"ORT-optimised graph: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    reason = unavailable_reason()
    if reason:
        raise StageError(f"ORT-optimised graph: {reason}")
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log_path = tmp.with_name(out_dir.name + ".builder.log")
    argv = [sys.executable, "-m", BUILDER, "-i", str(hf_dir), "-o", str(tmp), "-p", precision, "-e", provider,
            "-c", str(tmp / "cache")]
    if extra:
        argv += ["--extra_options", *(f"{k}={v}" for k, v in extra.items())]
    with open(log_path, "wb") as out:
        try:
            # offline: the folder is local, and nothing (a tokenizer, a config) is to be fetched from a hub
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False, env=env)
        except subprocess.TimeoutExpired:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StageError(f"ORT-optimised graph: the builder ran past {timeout_s:.0f}s (log: {log_path})") from None
    if done.returncode != 0 or not (tmp / "model.onnx").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise StageError(f"ORT-optimised graph: the builder exited {done.returncode}: {tail[0]} (log: {log_path})")
    shutil.rmtree(tmp / "cache", ignore_errors=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log_path.unlink(missing_ok=True)
    return out_dir / "model.onnx"


def write_hf_folder(model, folder: Path, tokenizer, eos_token: str = "<|endoftext|>") -> Path:
    """A Hugging Face folder of an in-memory llmpipe model, as consolidate writes hf/ (config.json,
    model.safetensors, tokenizer.json and its config files): what the builder reads. For benchmarks and
    tests of random-weight flavors; a run's own hf/ comes from consolidate."""
    import json

    from safetensors.torch import save_file

    from llmpipe.models.llama import hf
    from llmpipe.models.llama.hf_files import hf_files, write_hf_files

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    save_file({hf.to_hf_name(k): v.detach().contiguous() for k, v in params.items()}, folder / "model.safetensors")
    eos = tokenizer.token_to_id(eos_token)
    (folder / "config.json").write_text(json.dumps(hf.hf_config(model.args, "fp32", eos), indent=2) + "\n")
    tokenizer.save(str(folder / "tokenizer.json"))
    write_hf_files(folder, hf_files(tokenizer, eos_token, model.args.max_seq_len))
    return folder
