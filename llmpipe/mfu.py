"""Model FLOPs utilisation: the one FLOPs count, the peak it is measured against, and the ratio.

Training metrics, the step profiler and `llmpipe plan` all count with `flops_per_token` and divide
with `mfu`. The peak per device comes, in this order, from:

  1. an override (train.peak_tflops; `llmpipe plan --peak-tflops`);
  2. the table below, by the name the accelerator reports (torch.cuda / torch.npu get_device_name)
     and the training dtype: dense figures (no 2:4 sparsity), each with its source;
  3. on CPU, a GEMM calibration measured once per machine (CPU model, threads, dtype, torch version)
     and cached under `<artifacts>/.calibration/`: MFU on CPU is against a measured GEMM peak, not
     a datasheet figure.

An accelerator not in the table (or a dtype the table has no figure for) gives no peak: MFU is
then null and the reason says to set train.peak_tflops. It is never guessed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmpipe import device as dev

log = logging.getLogger("llmpipe.mfu")

CALIBRATION_DIR = ".calibration"  # under run.artifacts_dir


@dataclass(frozen=True)
class Peak:
    """Dense peak TFLOPS of one device, or None with the reason in `source`."""

    tflops: float | None
    source: str


# -- the FLOPs count ---------------------------------------------------------------------------------

def flops_per_token(args, seq_len: int) -> float:
    """Training FLOPs per token of a LLaMA `ModelArgs`: 6N (forward 2N + backward 4N) over the
    non-embedding parameters N (the output head counts, the embedding lookup does not) plus the
    attention scores and values, 12 * L * d * T (PaLM's appendix B; Chinchilla's 6N + attention), d being the
    attention's width, n_heads * head_dim (the hidden size but where head_dim is set apart, as Qwen3's)."""
    width = args.n_heads * getattr(args, "head_dim", args.dim // args.n_heads)
    return 6 * args.num_params(embeddings=False) + 12 * args.n_layers * width * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Achieved model FLOP/s over `peak_flops` (FLOP/s of every device together); None without a peak."""
    if peak_flops is None or not peak_flops > 0:
        return None
    return flops_per_token * tokens_per_s / peak_flops


# -- the table ---------------------------------------------------------------------------------------
# Dense TFLOPS per dtype. fp32 is the plain FP32 rate: PyTorch leaves TF32 off for matmuls by default
# (torch.backends.cuda.matmul.allow_tf32); with TF32 on, fp32 matmuls run on tensor cores and MFU
# against this figure can exceed 1: set train.peak_tflops to the TF32 figure then.
# Ascend: no vendor datasheet per SKU; the figure is CANN's own cycle model, cube cores x cube_freq x
# 16*16*16 MACs x 2, from the SKU's <CANN>/<arch>-linux/data/platform_config/Ascend910B?.ini
# ([SoCInfo] cube_core_cnt, [AICoreSpec] cube_freq): check yours there. The 910B family does bf16 at
# the fp16 rate (support_bf16=1, one fractal shape for both); it has no documented fp32 cube rate.

@dataclass(frozen=True)
class _Chip:
    pattern: str  # regex searched (case-insensitive) in the reported device name
    label: str
    tflops: dict[str, float]  # dtype -> dense TFLOPS
    doc: str  # where the figures come from (short; the URL is in the comment beside)


def _same(fp32: float, half: float) -> dict[str, float]:
    return {"fp32": fp32, "bf16": half, "fp16": half}


_TABLE: tuple[_Chip, ...] = (  # first match wins: the narrower names come first
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM / NVL: BF16 1979 / 1671 with sparsity)
    _Chip(r"\bH200\b.*\bNVL\b", "NVIDIA H200 NVL", _same(60.0, 835.5), "NVIDIA H200 datasheet"),
    _Chip(r"\bH200\b", "NVIDIA H200 SXM", _same(67.0, 989.4), "NVIDIA H200 datasheet"),
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 SXM / PCIe /
    # NVL: BF16 1979 / 1513 / 1671 with sparsity; the H100 whitepaper gives SXM5 dense as 989.4). The
    # SXM part reports itself as "NVIDIA H100 80GB HBM3".
    _Chip(r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", _same(60.0, 835.5), "NVIDIA H100 datasheet"),
    _Chip(r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", _same(51.0, 756.5), "NVIDIA H100 datasheet"),
    _Chip(r"\bH100\b", "NVIDIA H100 SXM", _same(67.0, 989.4), "NVIDIA H100 datasheet"),
    # H800: the H100 with a narrower NVLink, the same compute (NVIDIA H800 product brief)
    _Chip(r"\bH800\b.*\bPCIe\b", "NVIDIA H800 PCIe", _same(51.0, 756.5), "NVIDIA H800 product brief"),
    _Chip(r"\bH800\b", "NVIDIA H800 SXM", _same(67.0, 989.4), "NVIDIA H800 product brief"),
    # NVIDIA HGX H20 product brief (not on nvidia.com publicly): FP32 44, TF32 74, BF16/FP16 148 dense
    _Chip(r"\bH20\b", "NVIDIA H20", _same(44.0, 148.0), "NVIDIA HGX H20 product brief"),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # (every A100: FP32 19.5, TF32 156, BF16/FP16 312 dense; 624 with sparsity). A800: the A100 with a
    # narrower NVLink, the same compute (NVIDIA A800 datasheet).
    _Chip(r"\bA100\b", "NVIDIA A100", _same(19.5, 312.0), "NVIDIA A100 datasheet"),
    _Chip(r"\bA800\b", "NVIDIA A800", _same(19.5, 312.0), "NVIDIA A800 datasheet"),
    # https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 (BF16/FP16 733 with sparsity)
    _Chip(r"\bL40S\b", "NVIDIA L40S", _same(91.6, 362.05), "NVIDIA L40S datasheet"),
    # https://www.nvidia.com/en-us/data-center/l40/ (BF16/FP16 362.1 with sparsity)
    _Chip(r"\bL40\b", "NVIDIA L40", _same(90.5, 181.05), "NVIDIA L40 datasheet"),
    # https://www.nvidia.com/en-us/data-center/l4/ (BF16/FP16 242 with sparsity)
    _Chip(r"\bL4\b", "NVIDIA L4", _same(30.3, 121.0), "NVIDIA L4 datasheet"),
    # https://www.nvidia.com/en-us/data-center/products/a10-gpu/ (BF16/FP16 250 with sparsity). Not the
    # A10G (AWS's variant, different clocks): \b keeps it out.
    _Chip(r"\bA10\b", "NVIDIA A10", _same(31.2, 125.0), "NVIDIA A10 datasheet"),
    # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    # (FP16 tensor: SXM2 125, PCIe 112, V100S 130). Volta has no bf16: no figure.
    _Chip(r"\bV100S\b", "NVIDIA V100S PCIe", {"fp32": 16.4, "fp16": 130.0}, "NVIDIA V100 datasheet"),
    _Chip(r"\bV100\b.*\bPCIE\b", "NVIDIA V100 PCIe", {"fp32": 14.0, "fp16": 112.0}, "NVIDIA V100 datasheet"),
    _Chip(r"\bV100\b", "NVIDIA V100 SXM2", {"fp32": 15.7, "fp16": 125.0}, "NVIDIA V100 datasheet"),
    # NVIDIA Ada GPU architecture whitepaper, appendix A (RTX 4090): FP16/BF16 tensor with FP32
    # accumulate (what PyTorch uses) 165.2 dense; 330.3 is FP16 accumulate.
    _Chip(r"\bRTX 4090\b(?! D\b)", "NVIDIA GeForce RTX 4090", _same(82.6, 165.2), "NVIDIA Ada architecture whitepaper"),
    # Ascend 910B family (Atlas A2), CANN platform_config: 910B1 24 cube cores x 1850 MHz, 910B2 24 x
    # 1800 MHz, 910B3 20 x 1800 MHz, 910B4 20 x 1500 MHz.
    _Chip(r"910B1(?!\d)", "Ascend 910B1", {"bf16": 363.7, "fp16": 363.7}, "CANN platform_config Ascend910B1.ini"),
    _Chip(r"910B2(?!\d)", "Ascend 910B2", {"bf16": 353.9, "fp16": 353.9}, "CANN platform_config Ascend910B2.ini"),
    _Chip(r"910B3(?!\d)", "Ascend 910B3", {"bf16": 294.9, "fp16": 294.9}, "CANN platform_config Ascend910B3.ini"),
    _Chip(r"910B4(?!\d)", "Ascend 910B4", {"bf16": 245.8, "fp16": 245.8}, "CANN platform_config Ascend910B4.ini"),
    # Ascend 910 (first generation, "Ascend910A"): 256 TFLOPS FP16 (Huawei's launch figure, Hot Chips
    # 31, 2019, "DaVinci: A Scalable Architecture for Neural Network Computing"); no bf16.
    _Chip(r"910A\b", "Ascend 910A", {"fp16": 256.0}, "Huawei Ascend 910 launch (Hot Chips 31)"),
    # Ascend 310P3 (Atlas 300I Pro, one chip): 70 TFLOPS FP16 (Huawei Atlas 300I Pro product page);
    # an inference chip, no bf16.
    _Chip(r"310P", "Ascend 310P", {"fp16": 70.0}, "Huawei Atlas 300I Pro datasheet"),
)


def table_peak(name: str, precision: str) -> Peak:
    """The table's dense peak for the device reporting itself as `name`, in `precision`."""
    for chip in _TABLE:
        if re.search(chip.pattern, name, re.IGNORECASE):
            if precision not in chip.tflops:
                return Peak(None, f"no {precision} figure for {chip.label} ({name!r}) in llmpipe.mfu's table: "
                                  "set train.peak_tflops")
            return Peak(chip.tflops[precision], f"{chip.label} {precision} dense peak ({chip.doc})")
    return Peak(None, f"unknown accelerator {name!r}: set train.peak_tflops")


def resolve_peak(device: torch.device, precision: str, override: float | None = None,
                 calibration_dir: Path | None = None, threads: int | None = None) -> Peak:
    """One device's peak for MFU: `override` (train.peak_tflops) wins; an accelerator is looked up in the
    table by its reported name; a CPU is measured (see `cpu_peak`; threads: default torch's count)."""
    if override is not None:
        return Peak(float(override), "train.peak_tflops")
    if device.type != "cpu":
        return table_peak(dev.device_name(device), precision)
    if calibration_dir is None:
        return Peak(None, "CPU peak: no calibration folder given")
    return cpu_peak(precision, threads or torch.get_num_threads(), calibration_dir)


# -- CPU calibration ---------------------------------------------------------------------------------

_MAX_CPU_TFLOPS = 1000.0  # no CPU comes near a PFLOP/s: a cached figure above this is not a measurement
_SIZES = (256, 512, 1024, 2048)
_REPS = 5  # per size, at most: the best of several, as a repetition that lost its core is no peak
_BUDGET_S = 0.3  # timed work in all; the next (8x bigger) size is tried only if one product still fits


def measure_gemm_tflops(precision: str, threads: int, budget_s: float = _BUDGET_S) -> float:
    """Best rate of square matmuls in `precision` on `threads` threads, 2n^3 FLOPs over a product's
    time: the fastest repetition of the sizes that fit in `budget_s` (well under a second in all)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best, end = 0.0, time.perf_counter() + budget_s
        gen = torch.Generator().manual_seed(0)
        for n in _SIZES:
            a, b = (torch.randn(n, n, generator=gen).to(dev.dtype(precision)) for _ in range(2))
            out = torch.mm(a, b)  # warm-up: the BLAS picks its kernels, the caches fill
            for _ in range(_REPS):
                t0 = time.perf_counter()
                torch.mm(a, b, out=out)
                dt = time.perf_counter() - t0
                best = max(best, 2 * n ** 3 / dt / 1e12)
                if time.perf_counter() + dt > end:
                    break
            if time.perf_counter() + 8 * dt > end:
                break
        return best
    finally:
        torch.set_num_threads(before)


def _key(precision: str, threads: int) -> dict:
    return {"cpu": dev.cpu_model(), "threads": threads, "dtype": precision, "torch": torch.__version__}


def _cache_path(folder: Path, key: dict) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", key["cpu"]).strip("-")[:48] or "cpu"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    return folder / f"gemm-{slug}-t{key['threads']}-{key['dtype']}-{digest}.json"


def _read_cached(path: Path, key: dict) -> float | None:
    """The cached TFLOPS if `path` holds a calibration for exactly `key`; None (and a warning) otherwise."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        wrong = [k for k, v in key.items() if data.get(k) != v]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} differ from this machine's")
        tflops = data.get("tflops")
        if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or \
                not 0 < tflops < _MAX_CPU_TFLOPS:  # also NaN and inf
            raise ValueError(f"tflops={tflops!r} is not a plausible CPU peak")
        return float(tflops)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        log.warning("ignoring the GEMM calibration %s (%s); measuring again", path, err)
        return None


def _write_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _locked(folder: Path):
    """One calibration at a time per folder: ranks starting together measure once, not against each other."""
    with open(folder / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _measure(precision: str, threads: int) -> tuple[float, str | None]:
    """The GEMM peak on `threads` threads, and why it is not to be cached (None: it is)."""
    tflops = measure_gemm_tflops(precision, threads)
    if threads == 1:
        return tflops, None
    single = measure_gemm_tflops(precision, 1)
    if tflops >= single:
        return tflops, None
    # NOTE: N threads slower than one: other processes held cores and the BLAS's threads waited on each
    # other (seen at 1 GFLOP/s for 2 threads on 2 busy cores, 170 when idle). Count N x one thread's rate,
    # an upper bound (MFU errs low), and measure again next time.
    return single * threads, (f"{threads} threads measured slower than one ({tflops:.3g} < {single:.3g} TFLOPS): "
                              f"the cores were busy; using one thread's rate x {threads}, not cached")


def cpu_peak(precision: str, threads: int, folder: Path) -> Peak:
    """This CPU's measured GEMM peak for `threads` threads in `precision`: read from `folder` when a
    calibration for this CPU model, thread count, dtype and torch version is there, else measured and
    written there. A cached file that does not verify is measured again (with a warning)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = _key(precision, threads)
    path = _cache_path(folder, key)
    label = f"measured GEMM peak, {precision} on {threads} thread(s) of {key['cpu']}"
    with _locked(folder):
        tflops = _read_cached(path, key)
        if tflops is not None:
            return Peak(tflops, f"{label} ({path.name})")
        tflops, suspect = _measure(precision, threads)
        if suspect:
            log.warning("CPU GEMM peak: %s", suspect)
            return Peak(tflops, f"{label}: {suspect}")
        _write_atomic(path, {**key, "tflops": tflops, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "method": f"fastest square matmul, n in {list(_SIZES)}, up to {_REPS} each, "
                                       f"{_BUDGET_S} s of work"})
        log.info("measured this CPU's %s GEMM peak: %.3g TFLOPS on %d thread(s) (%s)", precision, tflops, threads,
                 path)
    return Peak(tflops, f"{label} ({path.name})")


def calibration_dir(artifacts_dir: str | Path) -> Path:
    """Where CPU calibrations are cached: `<artifacts root>/.calibration/`."""
    return Path(artifacts_dir).resolve() / CALIBRATION_DIR
