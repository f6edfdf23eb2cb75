"""onnxruntime side of the benchmark: FP16 / INT8 variants of the FP32 graph, and sessions.

Provider names come from `llmpipe.device.ort_providers` only; this module never spells one.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmpipe.device import OrtProvider
from llmpipe.infer.graphs import EXTERNAL_DATA_BYTES, MODEL_FILE, model_files, save_model

log = logging.getLogger("llmpipe.bench")

VARIANTS = ("fp32", "fp16", "int8")


class ProviderUnavailable(RuntimeError):
    """onnxruntime lists the provider but could not enable it here (its libraries or device are missing)."""


@dataclass
class Variant:
    """One model variant on disk, or the reason it could not be made."""

    name: str  # fp32 | fp16 | int8
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


def quantize_int8(src: Path, dst: Path) -> list[Path]:
    """Dynamic INT8 quantization: QInt8 weights of MatMul/Gemm, activations quantized per call."""
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
        quantize_dynamic(src, dst, op_types_to_quantize=["MatMul", "Gemm"], per_channel=False,
                         reduce_range=True, weight_type=QuantType.QInt8, use_external_data_format=big)
    finally:
        logging.getLogger().removeFilter(quiet)
    return model_files(dst)


def make_variants(fp32_path: Path, names: list[str], out_dir: Path, filename: str = MODEL_FILE) -> dict[str, Variant]:
    """The FP32 graph plus each requested variant under out_dir/<name>/<filename>. FP32 is always
    included (it is the accuracy reference). A failed conversion is recorded, not raised."""
    makers = {"fp16": convert_fp16, "int8": quantize_int8}
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
    session = ort.InferenceSession(str(path), session_options(threads), providers=[provider.ort_name])
    # NOTE: onnxruntime silently falls back to the CPU provider when the requested one cannot
    # initialise (missing CUDA/CANN libraries); timing that would mislabel the row.
    active = session.get_providers()
    if not active or active[0] != provider.ort_name:
        raise ProviderUnavailable(f"onnxruntime did not enable {provider.ort_name} (active: {active})")
    return session


def run_logits(session: ort.InferenceSession, input_ids: np.ndarray) -> np.ndarray:
    """One forward pass: input_ids (batch, seq) int64 -> logits (batch, seq, vocab) float32."""
    return session.run(["logits"], {"input_ids": input_ids})[0]
