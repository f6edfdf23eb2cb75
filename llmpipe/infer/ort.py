"""onnxruntime side of the benchmark: FP16 / INT8 / INT4 variants of the FP32 graph, and sessions.

    fp16   float16 weights and compute (onnxruntime.transformers.float16)
    int8   dynamic quantization: int8 MatMul weights, activations quantized per call
    int4   weight-only MatMulNBits (onnxruntime's MatMulNBitsQuantizer): 4-bit blocks, one scale each
    int8w  the same with 8-bit blocks
    int8s  static quantization (quantize_static): int8 weights and activations, the activations'
           ranges calibrated on validation text (a CalibrationDataReader the caller gives)

These graphs are for onnxruntime only (MatMulNBits is a contrib op); the portable graphs ATC reads
are never changed.

Provider names come from `llmpipe.device.ort_providers` only; this module never spells one.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmpipe.device import OrtProvider
from llmpipe.infer.graphs import EXTERNAL_DATA_BYTES, MODEL_FILE, model_files, save_model

log = logging.getLogger("llmpipe.bench")

VARIANTS = ("fp32", "fp16", "int8", "int4", "int8w", "int8s")


class ProviderUnavailable(RuntimeError):
    """onnxruntime lists the provider but could not enable it here (its libraries or device are missing)."""


@dataclass
class Variant:
    """One model variant on disk, or the reason it could not be made."""

    name: str  # one of VARIANTS
    path: Path | None
    error: str | None = None

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in model_files(self.path)) if self.path else 0


def convert_fp16(src: Path, dst: Path) -> list[Path]:
    """FP16 weights and compute, FP32 inputs/outputs kept (keep_io_types). Returns the files written."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    src_bytes = sum(f.stat().st_size for f in model_files(src))
    with warnings.catch_warnings():
        # NOTE: it warns for every weight outside fp16's range (clamped); the accuracy numbers
        # measured later say whether that mattered.
        warnings.simplefilter("ignore", UserWarning)
        # A path (not a proto) lets it run shape inference by path, which works above 2 GiB.
        proto = convert_float_to_float16(str(src), keep_io_types=True)
    # FP16 weights take half the FP32 bytes.
    return save_model(proto, dst, external=src_bytes // 2 > EXTERNAL_DATA_BYTES)


class _QuietQuantizer(logging.Filter):
    """Drops onnxruntime.quantization's own log records below ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        from_quantizer = f"onnxruntime{os.sep}quantization" in record.pathname
        return not from_quantizer or record.levelno >= logging.ERROR


def quantize_int8(src: Path, dst: Path, per_channel: bool = False, keep_fp32: Sequence[str] = ()) -> list[Path]:
    """Dynamic INT8 quantization: QInt8 weights of MatMul/Gemm (one scale per tensor, or per output channel),
    activations quantized per call. `keep_fp32`: kinds of weight MatMuls left in fp32 (fp32_matmuls: "down",
    "head")."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    big = sum(f.stat().st_size for f in model_files(src)) > EXTERNAL_DATA_BYTES
    quiet = _QuietQuantizer()
    # NOTE: quantize_dynamic logs through the root logger (logging.info / logging.warning): a line per
    # tensor ("Quantization parameters ... not specified", "Ignore MatMul due to non constant B"
    # for the attention products, which is intended) and a "consider pre-processing" hint meant for
    # CNNs. A filter on the root logger keeps the pipeline's log readable.
    logging.getLogger().addFilter(quiet)
    try:
        # NOTE: reduce_range (7-bit weights): x86 CPUs without VNNI multiply u8 x s8 with
        # VPMADDUBSW, whose 16-bit sums saturate; on the debug model that made the max abs logit
        # diff 1.38 instead of 0.07. The cost on VNNI/ARM/GPU is one bit of weight precision.
        quantize_dynamic(src, dst, op_types_to_quantize=["MatMul", "Gemm"], per_channel=per_channel,
                         reduce_range=True, weight_type=QuantType.QInt8, use_external_data_format=big,
                         nodes_to_exclude=fp32_matmuls(src, keep_fp32) if keep_fp32 else None)
    finally:
        logging.getLogger().removeFilter(quiet)
    return model_files(dst)


def _size(src: Path) -> int:
    return sum(f.stat().st_size for f in model_files(src))


def quantize_weight_only(src: Path, dst: Path, bits: int, block_size: int, accuracy_level: int,
                         symmetric: bool = False, algorithm: str = "rtn", head_bits: int | None = None,
                         zero_points: str = "integer", adapter=None, merged_hf: Path | None = None,
                         kernel: str = "onnxruntime") -> list[Path]:
    """Weight-only quantization with onnxruntime's MatMulNBitsQuantizer: every MatMul with a constant
    weight becomes MatMulNBits (`bits`-bit weights in blocks of `block_size` input rows, one fp32 scale
    and zero point per block); activations stay fp32 unless `accuracy_level` 4 (int8 activations inside
    the kernel, its fastest CPU path). The attention products (no constant weight) are left as they are.
    `algorithm`: rtn (round to nearest from each block's range) or hqq (the quantizer's half-quadratic
    optimisation of scales and float zero points). `head_bits`: the output head's width when it differs
    (8: a second round-to-nearest pass over the head alone, which on SmolLM2-135M is what keeps 4-bit within
    its gates; docs/measurements/quantisation.md). `zero_points`: integer folds hqq's float zero points into
    integer ones and appended block-sum rows (llmpipe.infer.fold), onnxruntime's fast kernel path; float
    keeps them (its slow path, dequantising every call). `adapter` (llmpipe.infer.lora_rows.Adapter): the
    adapter's product appended as rows of the folded nodes, `src` being the graph of its base (the builder's,
    named by module), or with `merged_hf` (consolidate's hf/) a graph of the merged weights, whose adapted
    weights get the product taken off first (llmpipe's portable graphs). `kernel` llmpipe: the 4-bit nodes
    become llmpipe.Q4Gemv (llmpipe.infer.native) with hqq's float zero points as they are, no fold."""
    import onnx

    from llmpipe.infer import fold, native

    if kernel == "llmpipe":
        # before the quantizer's minutes: a machine that cannot build the op says so now (and the build is
        # cached for the sessions that will run the graph)
        native.library()
        zero_points = "float"  # HQQ's as they are: the kernel computes d * q + m

    # NOTE: the quantizer's module logger has a handler of its own and logs a line per node at INFO.
    own = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, quiet = own.level, _QuietQuantizer()
    own.setLevel(logging.ERROR)
    logging.getLogger().addFilter(quiet)
    try:
        head = fp32_matmuls(src, ["head"]) if head_bits and head_bits != bits else []
        model = onnx.load(str(src))
        # the values' ranks before any contrib op is in the graph (what the fold needs to know of its inputs)
        ranks = fold.value_ranks(model) if algorithm == "hqq" and zero_points == "integer" else None
        modules = None
        if adapter is not None and merged_hf is not None:
            from llmpipe.infer import lora_rows

            modules = lora_rows.take_off(model, merged_hf, adapter)
        model = _nbits(model, bits, block_size, accuracy_level, symmetric, algorithm, exclude=head)
        if head:
            # NOTE: blocks of 32 for the head, as llama.cpp's q8_0 (what the shipped SmolLM2 GGUF keeps it at)
            model = _nbits(model, head_bits, 32, accuracy_level, symmetric, "rtn", include=head)
        # NOTE: after every quantizer pass: the fold's and the adapter's own MatMuls (block sums, x A^T) stay fp32
        if algorithm == "hqq" and zero_points == "integer":
            fold.fold_model(model, ranks)
        if adapter is not None:
            from llmpipe.infer import lora_rows

            lora_rows.attach(model, adapter, modules)
            # x A^T at 8 bits (blocks of 32, round to nearest): measured 3-5% faster decode than fp32 A on
            # SmolLM2-135M (a quarter of its bytes), the fine-tune's quality the same (docs/measurements/
            # quantisation.md). NOTE: the quantizer's nodes_to_include adds to its op types rather than
            # restricting them; the A MatMuls are the only fp32 weight MatMuls left at this point.
            names = [n.name for n in model.graph.node if n.name.endswith(lora_rows.A_SUFFIX)]
            model = _nbits(model, 8, 32, accuracy_level, False, "rtn", include=names)
        # after the adapter's rows (appended to the 4-bit nodes as they are, then swapped with them)
        if kernel == "llmpipe" and native.swap_model(model) == 0:
            raise ValueError(f"{src.name}: no 4-bit MatMulNBits node llmpipe's kernel takes (blocks of 32, N a "
                             "multiple of 8)")
        # NOTE: the embedding stays fp32 (MatMul weights only), so the result's size is not bits/32 of
        # the source's: a source that needed external data writes its variant with external data too.
        from onnxruntime.quantization.onnx_model import ONNXModel

        ONNXModel(model).save_model_to_file(str(dst), use_external_data_format=_size(src) > EXTERNAL_DATA_BYTES)
    finally:
        own.setLevel(level)
        logging.getLogger().removeFilter(quiet)
    return model_files(dst)


def _nbits(model, bits: int, block_size: int, accuracy_level: int, symmetric: bool, algorithm: str,
           exclude: Sequence[str] = (), include: Sequence[str] | None = None):
    """One MatMulNBitsQuantizer pass over `model` (a ModelProto): the weight MatMuls of `include` (all when
    None) but `exclude`. Returns the quantized ModelProto."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    algo = mq.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits) if algorithm == "hqq" else None
    quantizer = mq.MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                        accuracy_level=accuracy_level or None, nodes_to_exclude=list(exclude),
                                        nodes_to_include=list(include) if include is not None else None,
                                        op_types_to_quantize=("MatMul",), algo_config=algo)
    quantizer.process()
    out = quantizer.model.model
    if algorithm == "hqq" and accuracy_level:
        # NOTE: the HQQ pass writes its MatMulNBits nodes without accuracy_level (0: fp32 activations)
        import onnx

        for node in out.graph.node:
            if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
    return out


def weight_matmuls(path: Path) -> list[str]:
    """Names of the MatMul/Gemm nodes of the graph at `path` whose second input is a constant weight."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    consts = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1
            and n.input[1] in consts]


def fp32_matmuls(path: Path, keep: Sequence[str]) -> list[str]:
    """Names of the weight MatMuls of `keep`'s kinds in the graph at `path`: "down" (the feed-forward's
    down projection: its input is a Mul of another weight MatMul's output, silu(x W1) * x W3), "head"
    (the output projection: it writes a graph output, the logits)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = set(weight_matmuls(path))
    producer = {o: n for n in graph.node for o in n.output}
    weight_outputs = {n.output[0] for n in graph.node if n.name in weights}
    outputs = {o.name for o in graph.output}
    out = []
    for n in graph.node:
        if n.name not in weights:
            continue
        src = producer.get(n.input[0])
        down = src is not None and src.op_type == "Mul" and any(i in weight_outputs for i in src.input)
        if ("down" in keep and down) or ("head" in keep and n.output[0] in outputs):
            out.append(n.name)
    return out


def quantize_static_int8(src: Path, dst: Path, reader, quant_format: str = "qoperator",
                         keep_fp32: Sequence[str] = ("down", "head")) -> list[Path]:
    """Static INT8 (onnxruntime's quantize_static): int8 weights per output channel and uint8
    activations whose ranges come from running `reader` (a CalibrationDataReader) through the graph
    (min/max). Only the MatMuls with constant weights are quantized: the attention products (two
    activations, one of them softmax probabilities) keep fp32. `quant_format` "qdq" inserts
    QuantizeLinear/DequantizeLinear pairs that onnxruntime fuses into integer kernels; "qoperator"
    writes the quantized operators directly. `keep_fp32`: kinds of weight MatMuls left in fp32 (see
    fp32_matmuls): the down projection's input (a product of two projections) has the outlier channels
    a per-tensor uint8 range cannot hold, and the head's errors go straight into the logits."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    kept = set(fp32_matmuls(src, keep_fp32))
    nodes = [n for n in weight_matmuls(src) if n not in kept]
    if not nodes:
        raise ValueError(f"{src.name}: no MatMul with a constant weight to quantize")
    extra = {"MatMulConstBOnly": True}
    quiet = _QuietQuantizer()
    logging.getLogger().addFilter(quiet)
    try:
        # NOTE: reduce_range (7-bit weights), as for dynamic int8: without VNNI the u8 x s8 products
        # saturate 16-bit sums. Per-channel weight scales keep the accuracy of the 7 bits.
        quantize_static(str(src), str(dst), reader,
                        quant_format=QuantFormat.QDQ if quant_format == "qdq" else QuantFormat.QOperator,
                        op_types_to_quantize=["MatMul", "Gemm"], nodes_to_quantize=nodes, per_channel=True,
                        reduce_range=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, use_external_data_format=_size(src)
                        > EXTERNAL_DATA_BYTES, extra_options=extra)
    finally:
        logging.getLogger().removeFilter(quiet)
    return model_files(dst)


class FeedsReader:
    """A CalibrationDataReader over a list of feed dicts (input name -> array), read once in order."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._feeds = list(feeds)
        self._next = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._next >= len(self._feeds):
            return None
        self._next += 1
        return self._feeds[self._next - 1]

    def rewind(self) -> None:
        self._next = 0


def make_variants(fp32_path: Path, names: list[str], out_dir: Path, filename: str = MODEL_FILE,
                  quantize=None, calibration=None, lora: tuple[Path, Path] | None = None) -> dict[str, Variant]:
    """The FP32 graph plus each requested variant under out_dir/<name>/<filename>. FP32 is always
    included (it is the accuracy reference). A failed conversion is recorded, not raised.

    `quantize`: benchmark.quantize (llmpipe.config.QuantizeSection: the int4 / int8w / int8s settings).
    `calibration`: for int8s (and int8 with benchmark.quantize.smooth_alpha), a callable returning a fresh
    CalibrationDataReader of this graph. `lora`: a LoRA
    run's (consolidate's hf/, adapter/), for a weight-only variant whose adapter is kept separate
    (benchmark.quantize.<v>.adapter)."""

    def weight_only(variant):
        def make(src, dst):
            if quantize is None:
                raise ValueError(f"{variant} needs the benchmark.quantize settings, none were given")
            section = getattr(quantize, variant)
            adapter = merged = None
            if section.adapter == "separate":
                from llmpipe.infer import lora_rows

                if lora is None:
                    raise ValueError(f"benchmark.quantize.{variant}.adapter: separate, but no LoRA adapter was given")
                merged, adapter = lora[0], lora_rows.Adapter.read(lora[1])
            return quantize_weight_only(src, dst, section.bits, section.block_size, section.accuracy_level,
                                        section.symmetric, section.algorithm, section.head_bits,
                                        section.zero_points, adapter, merged, section.kernel)
        return make

    def smoothed(variant, src, dst, keep):
        """`src` with SmoothQuant's scales (benchmark.quantize.smooth_alpha) beside `dst`, or `src` itself."""
        if quantize is None or quantize.smooth_alpha is None:
            return src
        if calibration is None:
            raise ValueError(f"{variant}: benchmark.quantize.smooth_alpha needs calibration data (validation text), "
                             "none was given")
        from llmpipe.infer.smooth import smooth_file

        out = dst.with_name(dst.stem + ".smoothed.onnx")
        n = smooth_file(src, out, calibration(), quantize.smooth_alpha, fp32_matmuls(src, keep))
        log.info("variant %s: SmoothQuant scales (alpha %s) on %d MatMul inputs", variant, quantize.smooth_alpha, n)
        return out

    def without(path: Path, src: Path) -> None:
        if path != src:
            for f in model_files(path):
                f.unlink(missing_ok=True)

    def static(src, dst):
        if calibration is None or quantize is None:
            raise ValueError("int8s needs calibration data (validation text), none was given")
        scaled = smoothed("int8s", src, dst, quantize.static_keep_fp32)
        try:
            return quantize_static_int8(scaled, dst, calibration(), quantize.static_format,
                                        quantize.static_keep_fp32)
        finally:
            without(scaled, src)

    def dynamic(src, dst):
        if quantize is None:
            return quantize_int8(src, dst)
        scaled = smoothed("int8", src, dst, quantize.dynamic_keep_fp32)
        try:
            return quantize_int8(scaled, dst, quantize.dynamic_per_channel, quantize.dynamic_keep_fp32)
        finally:
            without(scaled, src)

    makers = {"fp16": convert_fp16, "int8": dynamic, "int4": weight_only("int4"),
              "int8w": weight_only("int8w"), "int8s": static}
    variants = {"fp32": Variant("fp32", Path(fp32_path))}
    for name in names:
        if name == "fp32":
            continue
        if name not in makers:
            raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
        dst = Path(out_dir) / name / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            makers[name](Path(fp32_path), dst)
            variants[name] = Variant(name, dst)
            log.info("variant %s: %s (%d bytes)", name, dst, variants[name].nbytes())
        except Exception as err:  # any converter failure is a result to report
            log.warning("variant %s could not be made: %s", name, err)
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            variants[name] = Variant(name, None, error=f"{type(err).__name__}: {first}")
    return variants


def session_options(threads: int | None) -> ort.SessionOptions:
    """All graph optimizations, `threads` intra-op threads (None: os.cpu_count()), quiet logs."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or os.cpu_count() or 1
    opts.inter_op_num_threads = 1  # one graph at a time: parallelism is inside the ops
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3  # errors only
    return opts


def create_session(path: Path, provider: OrtProvider, threads: int | None) -> ort.InferenceSession:
    """An InferenceSession on `provider`; raises ProviderUnavailable if onnxruntime fell back to another."""
    from llmpipe.infer import native

    opts = session_options(threads)
    native.register(opts, path)  # llmpipe's own op library, when the graph uses it (kernel: llmpipe)
    session = ort.InferenceSession(str(path), opts, providers=[provider.ort_name])
    # NOTE: onnxruntime silently falls back to the CPU provider when the requested one cannot
    # initialise (missing CUDA/CANN libraries); timing that would mislabel the row.
    active = session.get_providers()
    if not active or active[0] != provider.ort_name:
        raise ProviderUnavailable(f"onnxruntime did not enable {provider.ort_name} (active: {active})")
    return session


def run_logits(session: ort.InferenceSession, input_ids: np.ndarray) -> np.ndarray:
    """One forward pass: input_ids (batch, seq) int64 -> logits (batch, seq, vocab) float32."""
    return session.run(["logits"], {"input_ids": input_ids})[0]
