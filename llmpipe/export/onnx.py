"""The export_onnx stage: consolidated weights -> ONNX graphs, checked, with ORT parity numbers.

Three graphs, each with its own export function over the shared `_export_graph`, and optionally a fourth:

- model.onnx (prefill): `input_ids` int64 (batch, seq) -> `logits` float32 (batch, seq, vocab) and
  the prompt's cache `present.{i}.key/value` (batch, kv_heads, seq, head_dim) per layer; batch and
  seq dynamic.
- decoder_with_past.onnx (export.kv_cache; for onnxruntime): `input_ids` (batch, seq) plus
  `past.{i}.key/value` (batch, kv_heads, past, head_dim) -> `logits` and `present.{i}.key/value`
  (batch, kv_heads, past + seq, head_dim); batch, seq and past dynamic.
- decoder_static.onnx (export.static_decoder; for ATC and in-place decoding): a cache of fixed
  length L = export.kv_cache_len. Inputs `input_ids` and `position_ids` int64 (batch, chunk),
  `attention_mask` int64 (batch, L) (1: the slot holds an earlier token), `cache.{i}.key/value`
  float32 (batch, kv_heads, L, head_dim); outputs `logits` (batch, chunk, vocab) and the chunk's
  own `new.{i}.key/value` (batch, kv_heads, chunk, head_dim), which the caller writes into slots
  `position_ids` of its cache. Only batch and chunk are dynamic (ATC pins them too). The graph only
  reads the cache, so a decode loop never copies it.
- ort/ (export.ort_graph; for onnxruntime only): onnxruntime-genai's model builder run on consolidate's
  hf/ (llmpipe.export.fused): fused attention over the filled cache, fused norms and rotary embedding,
  one cache buffer shared by past and present; checked by FusedEngine's greedy decoding against PyTorch
  like the static decoder.

A chat run's template travels with the graphs: consolidate's copies (chat_template.jinja, hf/'s
tokenizer_config.json) are checked against training's digest before anything is exported (an artifact
whose template differs is refused, naming the file and both digests; llmpipe.checkpoint.template_digest),
then chat_template.jinja is written beside the graphs and its digest recorded in the manifest.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from llmpipe import device
from llmpipe.checkpoint.template_digest import METRIC, TEMPLATE_FILE, check_folder, digest, training_digest
from llmpipe.export import fused
from llmpipe.infer.graphs import (
    DECODER_FILE,
    EXTERNAL_DATA_BYTES,
    MODEL_FILE,
    STATIC_FILE,
    cache_len,
    decoder_names,
    model_files,
    save_model,
    static_inputs,
)
from llmpipe.infer.stats import logit_agreement
from llmpipe.manifest import write_json_atomic
from llmpipe.models.llama.io import load_model
from llmpipe.models.llama.model import Transformer
from llmpipe.stages import StageContext, StageError, StageResult

log = logging.getLogger("llmpipe.export")

PARITY_FILE = "parity.json"
ORT_DIR = "ort"  # onnxruntime's own graph (llmpipe.export.fused), fp32
GGUF_DIR = "gguf"  # export.gguf: llama.cpp's files of the consolidated weights (llmpipe.export.gguf)
GGUF_ADAPTER, GGUF_ADAPTER_OUTPUT = "adapter.lora.gguf", "lora_gguf"  # export.gguf_adapter: separate
# NOTE: trace with batch != seq and neither equal to 1: the tracer may bake a size-1 dimension
# into broadcasts, or confuse two equal dimensions, which would break the dynamic axes.
TRACE_SHAPE = (2, 16)


def random_ids(batch: int, seq: int, vocab_size: int, seed: int) -> np.ndarray:
    """Reproducible random token ids (batch, seq) int64 in [0, vocab_size)."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, seq), dtype=np.int64)


def check_shapes(shapes: Sequence[Sequence[int]], max_seq_len: int, key: str) -> None:
    """Raise StageError unless every (batch, seq) is positive and seq fits the model."""
    for batch, seq in shapes:
        if batch < 1 or seq < 1:
            raise StageError(f"{key}: ({batch}, {seq}) must have batch >= 1 and seq >= 1")
        if seq > max_seq_len:
            raise StageError(f"{key}: seq {seq} in ({batch}, {seq}) exceeds the model's max_seq_len "
                             f"{max_seq_len}")


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _export_graph(module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, opset: int,
                  input_names: list[str], output_names: list[str],
                  dynamic_axes: dict[str, dict[int, str]], external: bool) -> list[Path]:
    """Trace `module` on `args` into an ONNX file (or graph + external data); returns the files."""
    # NOTE: the legacy TorchScript exporter (dynamo=False) on purpose: the dynamo exporter's lowest
    # opset is 18, and ATC reads opsets 9-18, so opset 17 (the default) needs the legacy one.
    target = path
    if external:  # export next to a scratch name, then gather the tensors into one data file
        scratch = path.parent / f".{path.stem}-export"
        scratch.mkdir(exist_ok=True)
        target = scratch / path.name
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)  # "legacy TorchScript-based ONNX export"
        # NOTE: TracerWarning comes from `if rep > 1` (GQA) in the model: head counts are fixed per
        # model, so the traced branch is the right one for every input shape.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module, args, str(target), input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic_axes, opset_version=opset, do_constant_folding=True,
                          dynamo=False)
    if not external:
        return model_files(path)
    # NOTE: onnx.load pulls the weights back into memory (about the model's size again); the
    # exporter scatters >2 GiB models over one file per tensor, which ATC and users dislike.
    files = save_model(onnx.load(str(target)), path, external=True)
    shutil.rmtree(target.parent)
    return files


class _Prefill(nn.Module):
    """The prompt pass: logits and the prompt's keys/values, flat, for the ONNX exporter."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor):
        logits, present = self.model.forward_cached(input_ids)
        return (logits, *[t for kv in present for t in kv])


def export_prefill(model: Transformer, path: Path, opset: int,
                   external_data_bytes: int = EXTERNAL_DATA_BYTES) -> list[Path]:
    """Export the prefill graph: input_ids (batch, seq) int64 -> logits (batch, seq, vocab) float32 and
    present.{i}.key/value (batch, kv_heads, seq, head_dim), batch and seq dynamic. External data when
    the weights exceed `external_data_bytes`."""
    _check_fp32(model, "export_prefill")
    batch, seq = TRACE_SHAPE[0], min(TRACE_SHAPE[1], model.args.max_seq_len)
    ids = torch.from_numpy(random_ids(batch, seq, model.args.vocab_size, seed=0))  # (B, T)
    present = decoder_names(model.args.n_layers, "present")
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"},
            **{n: {0: "batch", 2: "seq"} for n in present}}
    return _export_graph(_Prefill(model), (ids,), Path(path), opset, ["input_ids"], ["logits", *present],
                         axes, external=weight_bytes(model) > external_data_bytes)


def _check_fp32(model: Transformer, what: str) -> None:
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(f"{what} needs an fp32 model (load it with dtype=torch.float32)")
    model.eval()


class _Decoder(nn.Module):
    """Flat-argument wrapper of Transformer.forward_cached for the ONNX exporter."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, *past_flat: torch.Tensor):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits, present = self.model.forward_cached(input_ids, past)
        return (logits, *[t for kv in present for t in kv])


def export_decoder(model: Transformer, path: Path, opset: int,
                   external_data_bytes: int = EXTERNAL_DATA_BYTES) -> list[Path]:
    """Export the KV-cache decoder graph (batch, new tokens and past length all dynamic)."""
    _check_fp32(model, "export_decoder")
    a = model.args
    # NOTE: trace with past 5 and 3 new tokens (not 1) so no axis is baked in as a constant.
    ids = torch.from_numpy(random_ids(2, 3, a.vocab_size, seed=0))
    with torch.no_grad():
        _, past = model.forward_cached(torch.from_numpy(random_ids(2, 5, a.vocab_size, seed=1)))
    past_names, present_names = decoder_names(a.n_layers, "past"), decoder_names(a.n_layers, "present")
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes.update({n: {0: "batch", 2: "past_seq"} for n in past_names})
    axes.update({n: {0: "batch", 2: "total_seq"} for n in present_names})
    flat = tuple(t for kv in past for t in kv)
    return _export_graph(_Decoder(model), (ids, *flat), Path(path), opset, ["input_ids", *past_names],
                         ["logits", *present_names], axes, external=weight_bytes(model) > external_data_bytes)


class _StaticDecoder(nn.Module):
    """Flat-argument wrapper of Transformer.forward_static for the ONNX exporter."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, *cache_flat):
        cache = [(cache_flat[2 * i], cache_flat[2 * i + 1]) for i in range(len(cache_flat) // 2)]
        logits, new = self.model.forward_static(input_ids, position_ids, attention_mask, cache)
        return (logits, *[t for kv in new for t in kv])


def export_static_decoder(model: Transformer, path: Path, opset: int, length: int,
                          external_data_bytes: int = EXTERNAL_DATA_BYTES) -> list[Path]:
    """Export decoder_static.onnx with a cache of `length` slots (see the module docstring)."""
    _check_fp32(model, "export_static_decoder")
    a = model.args
    batch, chunk = 2, 3  # NOTE: neither 1 nor equal, so both axes stay dynamic (see TRACE_SHAPE)
    ids = torch.from_numpy(random_ids(batch, chunk, a.vocab_size, seed=0))
    positions = torch.arange(5, 5 + chunk).expand(batch, chunk).contiguous()
    mask = (torch.arange(length) < 5).long().expand(batch, length).contiguous()
    cache = [torch.zeros(batch, a.n_kv_heads, length, a.head_dim) for _ in range(2 * a.n_layers)]
    new = decoder_names(a.n_layers, "new")
    axes = {"input_ids": {0: "batch", 1: "chunk"}, "position_ids": {0: "batch", 1: "chunk"},
            "attention_mask": {0: "batch"}, "logits": {0: "batch", 1: "chunk"},
            **{n: {0: "batch"} for n in decoder_names(a.n_layers, "cache")},
            **{n: {0: "batch", 2: "chunk"} for n in new}}
    return _export_graph(_StaticDecoder(model), (ids, positions, mask, *cache), Path(path), opset,
                         static_inputs(a.n_layers), ["logits", *new], axes,
                         external=weight_bytes(model) > external_data_bytes)


def export_ort_decoder(model: Transformer, path: Path, opset: int, length: int,
                       external_data_bytes: int = EXTERNAL_DATA_BYTES) -> list[Path]:
    """Export decoder_ort.onnx, for onnxruntime only: decoder_static.onnx's maths and names with the cache
    length dynamic (axis "cache" of attention_mask and of every cache input, up to `length`, the RoPE
    table's reach), so an engine can feed only the filled part of its cache, rounded up to a bucket
    (llmpipe.infer.decode.GrowingEngine), and a step's attention costs what the cache holds, not its
    capacity. ATC needs static shapes: it gets decoder_static.onnx, unchanged."""
    _check_fp32(model, "export_ort_decoder")
    a = model.args
    batch, chunk, slots = 2, 3, 7  # NOTE: none 1 and all different, so no axis is baked in (see TRACE_SHAPE)
    ids = torch.from_numpy(random_ids(batch, chunk, a.vocab_size, seed=0))
    positions = torch.arange(5, 5 + chunk).expand(batch, chunk).contiguous()
    mask = (torch.arange(slots) < 5).long().expand(batch, slots).contiguous()
    cache = [torch.zeros(batch, a.n_kv_heads, slots, a.head_dim) for _ in range(2 * a.n_layers)]
    axes = {"input_ids": {0: "batch", 1: "chunk"}, "position_ids": {0: "batch", 1: "chunk"},
            "attention_mask": {0: "batch", 1: "cache"}, "logits": {0: "batch", 1: "chunk"},
            **{n: {0: "batch", 2: "cache"} for n in decoder_names(a.n_layers, "cache")},
            **{n: {0: "batch", 2: "chunk"} for n in decoder_names(a.n_layers, "new")}}
    return _export_graph(_StaticDecoder(model), (ids, positions, mask, *cache), Path(path), opset,
                         static_inputs(a.n_layers), ["logits", *decoder_names(a.n_layers, "new")], axes,
                         external=weight_bytes(model) > external_data_bytes)


def decoder_parity(model: Transformer, onnx_path: Path, shapes: Sequence[Sequence[int]], seed: int) -> dict:
    """For each (batch, seq): PyTorch builds the cache of the first seq//2 tokens, onnxruntime's
    decoder continues with the rest; its logits are compared with PyTorch's full-sequence pass,
    which also checks the cache maths (positions, bottom-right causal mask)."""
    provider = device.ort_providers(["cpu"])[0]
    session = ort.InferenceSession(str(onnx_path), providers=[provider.ort_name])
    names = decoder_names(model.args.n_layers, "past")
    per_shape = []
    for i, (batch, seq) in enumerate(shapes):
        ids = random_ids(batch, max(seq, 2), model.args.vocab_size, seed + 100 + i)
        cut = ids.shape[1] // 2
        with torch.inference_mode():
            ref = model(torch.from_numpy(ids)).float().numpy()[:, cut:]  # (B, T - cut, vocab)
            _, past = model.forward_cached(torch.from_numpy(ids[:, :cut]))
        feed = {"input_ids": ids[:, cut:], **{n: t.numpy() for n, t in zip(names, (t for kv in past for t in kv))}}
        out = session.run(["logits"], feed)[0]
        per_shape.append({"batch": batch, "past": cut, "new": ids.shape[1] - cut, **logit_agreement(ref, out)})
    return {"shapes": per_shape, "max_abs_diff": max(s["max_abs_diff"] for s in per_shape),
            "top1_agreement": min(s["top1_agreement"] for s in per_shape)}


def static_parity(model: Transformer, prefill_path: Path, static_path: Path, length: int, seed: int,
                  new_tokens: int = 64, prompt_len: int = 16, refs: dict | None = None) -> dict:
    """Greedy continuation of random prompts (batch 1 and 2) by onnxruntime's prefill graph plus
    static decoder vs PyTorch's greedy decoding with its KV cache (llmpipe.infer.decode.greedy_reference):
    the tokens must be identical, and each step's logits are compared."""
    from llmpipe.infer.decode import StaticEngine

    cpu = device.ort_providers(["cpu"])[0].ort_name
    engine = StaticEngine(ort.InferenceSession(str(prefill_path), providers=[cpu]),
                          ort.InferenceSession(str(static_path), providers=[cpu]), model.args, length)
    return engine_parity(model, engine, length, seed, new_tokens, prompt_len, refs)


def ort_graph_parity(model: Transformer, folder: Path, length: int, seed: int, new_tokens: int = 64,
                     prompt_len: int = 16, refs: dict | None = None) -> dict:
    """static_parity's check for the builder's graph in `folder` (llmpipe.export.fused) run by FusedEngine."""
    from llmpipe.infer.fused import FusedEngine, GraphConfig

    cpu = device.ort_providers(["cpu"])[0].ort_name
    engine = FusedEngine(ort.InferenceSession(str(folder / MODEL_FILE), providers=[cpu]),
                         GraphConfig.read(folder), length)
    return engine_parity(model, engine, length, seed, new_tokens, prompt_len, refs)


def engine_parity(model: Transformer, engine, length: int, seed: int, new_tokens: int = 64,
                  prompt_len: int = 16, refs: dict | None = None) -> dict:
    """Greedy continuation of random prompts (batch 1 and 2) by a decoding engine (start/step) vs
    PyTorch's greedy decoding with a KV cache: whether the tokens are identical, and each step's logits
    compared. `refs`, shared by the engines of one export, keeps PyTorch's runs so each is decoded once.
    A run with a non-finite logit on either side never counts as identical (argmax of NaNs agrees)."""
    from llmpipe.infer.decode import greedy_reference

    prompt_len = max(1, min(prompt_len, length // 2))
    n = max(1, min(new_tokens, length - prompt_len))
    per_batch = []
    for batch in (1, 2):
        prompt = random_ids(batch, prompt_len, model.args.vocab_size, seed + 200 + batch)
        key = (batch, prompt_len, n, seed)
        if refs is None or key not in refs:
            found = greedy_reference(model, prompt, n)
            if refs is not None:
                refs[key] = found
        ref_tokens, ref_logits = refs[key] if refs is not None else found
        logits = [engine.start(prompt)]
        tokens = [logits[-1].argmax(-1)]
        for _ in range(n - 1):
            logits.append(engine.step(tokens[-1]))
            tokens.append(logits[-1].argmax(-1))
        tokens_arr, got = np.stack(tokens, axis=1), np.stack(logits, axis=1)
        # NaN logits argmax to token 0 on both sides: a NaN run is never called identical
        finite = bool(np.isfinite(got).all() and np.isfinite(ref_logits).all())
        per_batch.append({"batch": batch, "prompt": prompt_len, "new_tokens": n, "finite_logits": finite,
                          "identical_tokens": finite and bool((tokens_arr == ref_tokens).all()),
                          "token_agreement": float((tokens_arr == ref_tokens).mean()),
                          **logit_agreement(ref_logits, got)})
    return {"cache_len": length, "runs": per_batch,
            "identical_tokens": all(r["identical_tokens"] for r in per_batch),
            "max_abs_diff": max(r["max_abs_diff"] for r in per_batch),
            "top1_agreement": min(r["top1_agreement"] for r in per_batch)}


def _tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """(where, tensor) for every tensor a graph stores: initializers, sparse ones, Constant-style
    node attributes, and the same inside subgraphs (If/Loop/Scan bodies)."""
    for t in graph.initializer:
        yield f"initializer {t.name!r}", t
    for s in graph.sparse_initializer:
        yield f"sparse initializer {s.values.name!r}", s.values
        yield f"sparse initializer {s.values.name!r} indices", s.indices
    for node in graph.node:
        for a in node.attribute:
            where = f"node {node.name or node.op_type!r} attribute {a.name!r}"
            for t in [a.t] if a.HasField("t") else list(a.tensors):
                yield where, t
            for g in [a.g] if a.HasField("g") else list(a.graphs):
                yield from _tensors(g)


def check_external_data(path: Path, folder: Path | None = None) -> None:
    """StageError unless every external-data `location` in the ONNX file at `path` names a file
    inside `folder` (default: the file's own folder).

    NOTE: a location is a path relative to the graph file that onnx and onnxruntime open and
    read; one edited to '../../../../etc/passwd', an absolute path, or a link out of the folder
    would make them read (and the fp16/int8 converters copy) a file the stage never produced.
    """
    path = Path(path)
    root = (Path(folder) if folder is not None else path.parent).resolve()
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # protobuf's DecodeError and friends
        raise StageError(f"{path}: not a readable ONNX model ({_first_line(err)})") from None
    for where, tensor in _tensors(proto.graph):
        entries = {e.key: e.value for e in tensor.external_data}
        if tensor.data_location != onnx.TensorProto.EXTERNAL and not entries:
            continue
        location = entries.get("location", "")
        target = (path.parent / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(root):
            raise StageError(f"{path}: {where} has its external data at {location!r}, outside {root}; "
                             "refusing to read it (re-export the model)")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_model(path: Path) -> None:
    """onnx.checker on the file: by path, so models with external data (> 2 GiB) work too."""
    onnx.checker.check_model(str(path))


def file_opset(path: Path) -> int:
    """The default-domain opset an ONNX file declares (the graph only, weights are not read)."""
    proto = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def parity(model: Transformer, onnx_path: Path, shapes: Sequence[Sequence[int]], seed: int) -> dict[str, Any]:
    """PyTorch fp32 vs onnxruntime (CPU) logits on random ids for each (batch, seq)."""
    provider = device.ort_providers(["cpu"])[0]
    session = ort.InferenceSession(str(onnx_path), providers=[provider.ort_name])
    per_shape = []
    for i, (batch, seq) in enumerate(shapes):
        ids = random_ids(batch, seq, model.args.vocab_size, seed + i)  # (B, T)
        with torch.inference_mode():
            ref = model(torch.from_numpy(ids)).float().numpy()  # (B, T, vocab)
        out = session.run(["logits"], {"input_ids": ids})[0]
        agree = logit_agreement(ref, out)
        per_shape.append({"batch": batch, "seq": seq, **agree})
        log.info("parity %dx%d: max abs diff %.3g, mean %.3g, top-1 agreement %.4f", batch, seq,
                 agree["max_abs_diff"], agree["mean_abs_diff"], agree["top1_agreement"])
    return {
        "provider": provider.name,
        "shapes": per_shape,
        "max_abs_diff": max(s["max_abs_diff"] for s in per_shape),
        "mean_abs_diff": float(np.mean([s["mean_abs_diff"] for s in per_shape])),
        "top1_agreement": min(s["top1_agreement"] for s in per_shape),
    }


def _worst(a: float, b: float) -> float:
    """The larger difference; NaN when either is (Python's max would drop a NaN met second)."""
    return float(np.max([a, b]))


def _load(ctx: StageContext) -> Transformer:
    folder = ctx.input_path("consolidate", "model").parent
    try:
        return load_model(folder, dtype=torch.float32, device="cpu")
    except (ValueError, OSError, RuntimeError) as err:
        raise StageError(f"export_onnx: cannot load the consolidated model in {folder}: {err}") from None


def run(ctx: StageContext) -> StageResult:
    """The export_onnx stage: model.onnx (+ model.onnx.data) and parity.json in ctx.work_dir."""
    cfg = ctx.cfg.export
    template = _chat_template(ctx)  # before any work: a drifted template is refused in a second
    hf_dir = _ort_graph_source(ctx)  # before any work too: export.ort_graph with no builder or no hf/
    gguf_src = _gguf_source(ctx)  # and export.gguf with no hf/
    _gguf_adapter(ctx)  # and export.gguf_adapter: separate with no adapter/
    model = _load(ctx)
    check_shapes(cfg.parity_shapes, model.args.max_seq_len, "export.parity_shapes")
    path = ctx.work_dir / MODEL_FILE
    t0 = time.perf_counter()
    files = export_prefill(model, path, cfg.opset)
    check_external_data(path, ctx.work_dir)
    check_model(path)
    export_s = time.perf_counter() - t0
    log.info("exported %s (%d bytes) in %.1fs", path, sum(f.stat().st_size for f in files), export_s)

    report = parity(model, path, cfg.parity_shapes, ctx.cfg.run.seed)
    outputs = {"model": MODEL_FILE, "parity": PARITY_FILE}
    if len(files) > 1:
        outputs["model_data"] = files[1].name
    worst = report["max_abs_diff"]
    refs: dict = {}  # PyTorch's greedy runs, decoded once for every engine compared with them
    if cfg.kv_cache:
        dec_files = export_decoder(model, ctx.work_dir / DECODER_FILE, cfg.opset)
        check_external_data(ctx.work_dir / DECODER_FILE, ctx.work_dir)
        check_model(ctx.work_dir / DECODER_FILE)
        report["decoder"] = decoder_parity(model, ctx.work_dir / DECODER_FILE, cfg.parity_shapes, ctx.cfg.run.seed)
        worst = _worst(worst, report["decoder"]["max_abs_diff"])
        outputs["decoder"] = DECODER_FILE
        if len(dec_files) > 1:
            outputs["decoder_data"] = dec_files[1].name
    if cfg.static_decoder:
        length = cache_len(cfg.kv_cache_len, model.args.max_seq_len)
        static = ctx.work_dir / STATIC_FILE
        static_files = export_static_decoder(model, static, cfg.opset, length)
        check_external_data(static, ctx.work_dir)
        check_model(static)
        report["static_decoder"] = static_parity(model, path, static, length, ctx.cfg.run.seed, refs=refs)
        worst = _worst(worst, report["static_decoder"]["max_abs_diff"])
        outputs["decoder_static"] = STATIC_FILE
        if len(static_files) > 1:
            outputs["decoder_static_data"] = static_files[1].name
        log.info("static decoder (cache %d): greedy %d tokens %s PyTorch's, max abs logit diff %.3g", length,
                 report["static_decoder"]["runs"][0]["new_tokens"],
                 "identical to" if report["static_decoder"]["identical_tokens"] else "DIFFERENT from",
                 report["static_decoder"]["max_abs_diff"])
    unknown = fused.unsupported_family(hf_dir) if hf_dir is not None else None
    if unknown:  # a family the builder does not know: said in parity.json and the manifest, portable graphs kept
        log.warning("export.ort_graph: no ort/ graph: %s", unknown)
        report["ort_graph"] = {"skipped": unknown}
        hf_dir = None
    if hf_dir is not None:
        t1 = time.perf_counter()
        fused.build(hf_dir, ctx.work_dir / ORT_DIR, "fp32")
        length = cache_len(cfg.kv_cache_len, model.args.max_seq_len)
        report["ort_graph"] = ort_graph_parity(model, ctx.work_dir / ORT_DIR, length, ctx.cfg.run.seed, refs=refs)
        worst = _worst(worst, report["ort_graph"]["max_abs_diff"])
        outputs["ort_graph"] = ORT_DIR
        log.info("ort/ (onnxruntime-genai's builder, %.1fs): greedy %s PyTorch's, max abs logit diff %.3g",
                 time.perf_counter() - t1, "identical to" if report["ort_graph"]["identical_tokens"] else
                 "DIFFERENT from", report["ort_graph"]["max_abs_diff"])
    outputs.update(_gguf_files(ctx, gguf_src))
    same_tokens = all(report.get(k, {}).get("identical_tokens", True) for k in ("static_decoder", "ort_graph"))
    report = {"atol": cfg.parity_atol, "passed": worst <= cfg.parity_atol and same_tokens, **report}
    write_json_atomic(ctx.work_dir / PARITY_FILE, report)
    if not same_tokens:
        which = "decoder_static.onnx" if not report.get("static_decoder", {}).get("identical_tokens", True) \
            else f"{ORT_DIR}/ (FusedEngine)"
        raise StageError(f"export_onnx: greedy decoding with {which} chose other tokens than "
                         f"PyTorch's greedy decoding (details in {PARITY_FILE})")
    if not report["passed"]:
        raise StageError(f"export_onnx: ONNX Runtime logits differ from PyTorch by up to "
                         f"{worst:.3g}, above export.parity_atol={cfg.parity_atol:g} "
                         f"(details in {PARITY_FILE})")

    metrics = {
        "opset": file_opset(path),
        "onnx_bytes": sum(f.stat().st_size for f in files),
        "external_data": len(files) > 1,
        "parity_max_abs_diff": report["max_abs_diff"],
        "parity_mean_abs_diff": report["mean_abs_diff"],
        "parity_top1_agreement": report["top1_agreement"],
        "decoder_parity_max_abs_diff": report["decoder"]["max_abs_diff"] if cfg.kv_cache else None,
        "static_decoder_cache_len": report["static_decoder"]["cache_len"] if cfg.static_decoder else None,
        "static_decoder_max_abs_diff": report["static_decoder"]["max_abs_diff"] if cfg.static_decoder else None,
        "static_decoder_identical_tokens": report["static_decoder"]["identical_tokens"] if cfg.static_decoder
        else None,
        "ort_graph_max_abs_diff": report["ort_graph"]["max_abs_diff"] if hf_dir else None,
        "ort_graph_identical_tokens": report["ort_graph"]["identical_tokens"] if hf_dir else None,
        "export_seconds": round(export_s, 3),
    }
    if unknown:
        metrics["ort_graph_skipped"] = unknown
    if template is not None:
        (ctx.work_dir / TEMPLATE_FILE).write_text(template, encoding="utf-8")
        outputs["chat_template"] = TEMPLATE_FILE
        metrics[METRIC] = digest(template)
    return StageResult(outputs=outputs, metrics=metrics)


def _ort_graph_source(ctx: StageContext) -> Path | None:
    """consolidate's hf/ folder when ort/ is to be built (export.ort_graph), else None; a StageError naming
    the field when it cannot be (no hf/, no builder)."""
    if not ctx.cfg.export.ort_graph:
        return None
    folder, manifest = ctx.inputs["consolidate"]
    reason = fused.unavailable_reason()
    if not any(name.startswith("hf/") for name in manifest.outputs):  # a folder output: one entry per file
        reason = "consolidate wrote no hf/ folder (set consolidate.hf_layout: true)"
    if reason:
        raise StageError(f"export.ort_graph: {reason}")
    return manifest.path(folder, "hf/config.json").parent


def _gguf_source(ctx: StageContext) -> Path | None:
    """consolidate's hf/ folder when export.gguf asks for files, else None; a StageError naming the field
    when there is no hf/ (checked before any work)."""
    if not ctx.cfg.export.gguf:
        return None
    folder, manifest = ctx.inputs["consolidate"]
    if not any(name.startswith("hf/") for name in manifest.outputs):
        raise StageError("export.gguf: consolidate wrote no hf/ folder (set consolidate.hf_layout: true)")
    return manifest.path(folder, "hf/config.json").parent


def _gguf_files(ctx: StageContext, hf_dir: Path | None) -> dict[str, str]:
    """export.gguf: consolidate's hf/ as gguf/model-<type>.gguf for each type (llmpipe.export.gguf); the
    manifest's outputs gguf_<type>."""
    from llmpipe.export import gguf

    if hf_dir is None:
        return {}
    (ctx.work_dir / GGUF_DIR).mkdir(exist_ok=True)
    out = {}
    adapter = _gguf_adapter(ctx)
    base = None
    try:
        for qtype in ctx.cfg.export.gguf:
            t0 = time.perf_counter()
            src = hf_dir
            if adapter is not None and qtype in ("q4_0", "q4_1"):
                if base is None:  # the base the fine-tune came from (hf/ minus the adapter's product), once
                    from llmpipe.infer import lora_rows

                    base = lora_rows.write_base(hf_dir, lora_rows.Adapter.read(adapter),
                                                ctx.work_dir / GGUF_DIR / "base.partial")
                    lora = gguf.write_lora(adapter, hf_dir, ctx.work_dir / GGUF_DIR / GGUF_ADAPTER, ctx.cfg.run.name)
                    out[GGUF_ADAPTER_OUTPUT] = lora.relative_to(ctx.work_dir).as_posix()
                src = base
            path = gguf.write(src, ctx.work_dir / GGUF_DIR / f"model-{qtype}.gguf", qtype, ctx.cfg.run.name)
            log.info("GGUF %s: %s (%d bytes%s) in %.1fs", qtype, path, path.stat().st_size,
                     ", the base; the adapter in " + GGUF_ADAPTER if src is base else "", time.perf_counter() - t0)
            out[f"gguf_{qtype}"] = path.relative_to(ctx.work_dir).as_posix()
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)
    return out


def _gguf_adapter(ctx: StageContext) -> Path | None:
    """consolidate's adapter/ (PEFT) for export.gguf_adapter: separate, else None; a StageError when the LoRA
    run's consolidate wrote none."""
    if ctx.cfg.export.gguf_adapter != "separate":
        return None
    folder, manifest = ctx.inputs["consolidate"]
    if not {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(manifest.outputs):
        raise StageError(f"export.gguf_adapter: separate, but consolidate wrote no LoRA adapter (adapter/ in {folder})")
    return manifest.path(folder, "adapter/adapter_config.json").parent


def _chat_template(ctx: StageContext) -> str | None:
    """consolidate's chat template (None for a text run), every copy checked against training's digest."""
    folder, manifest = ctx.inputs["consolidate"]
    training = training_digest(ctx.run_dir, manifest.metrics.get(METRIC), folder / "manifest.json")
    return check_folder(folder, training)
