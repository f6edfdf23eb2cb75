"""Size a deployment before exporting it (`llmpipe plan CONFIG --deploy`): weight bytes per precision,
KV-cache bytes per sequence and per batch, a memory-bandwidth lower bound on decode time per token,
whether weights + cache fit the device, and the benchmark's measured time per output token beside the
bound when the run has one. Arithmetic only: no model built, no device touched.

Assumptions, printed with the numbers:
  weights  parameters only (RoPE tables and other graph constants left out). fp32 4 B and fp16/bf16 2 B
           per parameter. int8 as llmpipe's onnxruntime dynamic quantization stores it
           (llmpipe.infer.ort.quantize_int8: MatMul/Gemm weights, per_channel=False): each weight matrix
           (7 per layer + the output head) 1 B per element plus one fp32 scale and one int8 zero point;
           the token embedding (a Gather) and the RMSNorm weights stay fp32.
  cache    2 (K and V) * n_layers * n_kv_heads * head_dim * cache_len elements per sequence, fp16 on an
           NPU/GPU and fp32 on a CPU (what the exported decoders keep there).
  decode   every step reads all weights and the whole cache once, so (weights + batch * cache) /
           bandwidth is a lower bound on the time per token; compute, launch overheads and the
           activations only add to it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from llmpipe.config import ConfigError, RunConfig
from llmpipe.infer.graphs import DEFAULT_CACHE_LEN
from llmpipe.models.llama.flavors import model_args
from llmpipe.models.llama.model import ModelArgs

GB = 1e9  # datasheets give decimal GB and GB/s
GIB = 1 << 30
PRECISIONS = ("fp32", "fp16", "int8")
RESULTS_FILE = "results.json"  # the benchmark stage's (llmpipe.bench.run.RESULTS_FILE; not imported: onnxruntime)


@dataclass(frozen=True)
class Device:
    """One inference device: peak memory bandwidth and memory per device, from the vendor's figures."""

    name: str
    kind: str  # npu | gpu | cpu: decides the cache dtype (fp16 on npu/gpu, fp32 on cpu)
    bandwidth_gbs: float  # GB/s (decimal), the datasheet's peak
    memory_gb: float | None  # GB per device (decimal); None: not known
    precisions: tuple[str, ...] | None = None  # weight formats the hardware computes in; None: not known
    source: str = ""


# Memory bandwidth and capacity per device. Sources (looked up 2025; vendor datasheets where found):
#   NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): 40 GB HBM2 1,555 GB/s; 80 GB HBM2e
#     SXM 2,039 GB/s (80 GB PCIe: 1,935 GB/s; the SXM figure is used for "A100-80GB").
#   NVIDIA H100 datasheet: SXM 80 GB 3.35 TB/s; PCIe 80 GB 2.0 TB/s (H100 PCIe product brief
#     PB-11133-001: "greater than 2,000 GBps"). Third-party pages quoting "3 TB/s" for SXM round it.
#   NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s.
#   NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s.
#   Ascend 910B (Atlas 800T/800I A2): 64 GB HBM2e per chip (ai.gitee.com's Ascend 910B page; the 910B4
#     has 32 GB). NOTE: no Huawei datasheet with the HBM bandwidth was found; 1.6 TB/s is the figure third
#     parties give for the 64 GB parts and 0.8 TB/s for the 910B4 (half the HBM). One blog gives 400 GB/s,
#     which is about the 910B's HCCS interconnect (392 GB/s), not its HBM: not used. Pass
#     --memory-bandwidth-gbs when you know your part's figure.
#   Ascend 310P3 (Atlas 300I Pro): 24 GB LPDDR4X, 204.8 GB/s (Huawei's Atlas 300I Pro specification);
#     the Atlas 300I Duo carries two 310P3 with 48 GB each and 408 GB/s in all (reviews of the card), the
#     same ~204 GB/s per chip.
#   Ascend 310B (Atlas 200I DK A2, hiascend.com "基本规格"): LPDDR4X 3200 Mbps x 64 bit = 25.6 GB/s,
#     4 GB (boards with the 310B4 such as the Orange Pi AIpro carry 8-16 GB: --memory-gib).
_PREC_NPU = ("fp32", "fp16", "bf16", "int8")  # 910B: Cube fp16/bf16/int8; fp32 on the vector unit and HF32
_PREC_310 = ("fp16", "int8")  # 310P/310B: no bf16; fp32 only on the vector unit
_PREC_A100 = ("fp32", "tf32", "fp16", "bf16", "int8")
_PREC_FP8 = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")
_910B = dict(kind="npu", precisions=_PREC_NPU, source="third-party figure (no Huawei datasheet found)")
DEVICES: dict[str, Device] = {d.name: d for d in [
    Device("Ascend910B", bandwidth_gbs=1600, memory_gb=64, **_910B),
    Device("Ascend910B1", bandwidth_gbs=1600, memory_gb=64, **_910B),
    Device("Ascend910B2", bandwidth_gbs=1600, memory_gb=64, **_910B),
    Device("Ascend910B3", bandwidth_gbs=1600, memory_gb=64, **_910B),
    Device("Ascend910B4", bandwidth_gbs=800, memory_gb=32, **_910B),
    Device("Ascend310P3", "npu", 204.8, 24, _PREC_310, "Huawei Atlas 300I Pro specification"),
    Device("Ascend310B", "npu", 25.6, 4, _PREC_310, "Huawei Atlas 200I DK A2 specification"),
    Device("A100-40GB", "gpu", 1555, 40, _PREC_A100, "NVIDIA A100 datasheet"),
    Device("A100-80GB", "gpu", 2039, 80, _PREC_A100, "NVIDIA A100 datasheet (SXM)"),
    Device("H100-SXM", "gpu", 3350, 80, _PREC_FP8, "NVIDIA H100 datasheet"),
    Device("H100-PCIe", "gpu", 2000, 80, _PREC_FP8, "NVIDIA H100 datasheet"),
    Device("H200", "gpu", 4800, 141, _PREC_FP8, "NVIDIA H200 datasheet"),
    Device("L40S", "gpu", 864, 48, _PREC_FP8, "NVIDIA L40S datasheet"),
]}
_PROVIDER_KIND = {"cpu": "cpu", "cuda": "gpu", "cann": "npu", "npu": "npu"}


def _key(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def find_device(name: str) -> Device | None:
    """The table's entry for `name`, ignoring case, spaces, '-' and '_' ("h100 sxm" is H100-SXM)."""
    return next((d for d in DEVICES.values() if _key(d.name) == _key(name)), None)


def resolve_target(name: str, bandwidth_gbs: float | None = None, memory_gib: float | None = None,
                   what: str = "--soc") -> Device:
    """The device to size for: the table's, with `bandwidth_gbs` (GB/s) and `memory_gib` overriding its
    figures; a name the table lacks (and "cpu") needs `bandwidth_gbs`, else a ConfigError listing the names."""
    for flag, v in (("memory-bandwidth-gbs", bandwidth_gbs), ("memory-gib", memory_gib)):
        if v is not None and not v > 0:
            raise ConfigError(f"{flag} must be > 0 (got {v:g})")
    known = find_device(name)
    if known is None and bandwidth_gbs is None:
        raise ConfigError(f"{what} {name!r}: no memory bandwidth known for it (known: {', '.join(DEVICES)}); "
                          "give --memory-bandwidth-gbs (GB/s) to size for another device or the cpu")
    dev = known or Device(name, "cpu" if _key(name) == "cpu" else "npu", bandwidth_gbs, None,
                          source="--memory-bandwidth-gbs")
    if bandwidth_gbs is not None and known is not None:
        dev = replace(dev, bandwidth_gbs=bandwidth_gbs, source="--memory-bandwidth-gbs")
    if memory_gib is not None:
        dev = replace(dev, memory_gb=memory_gib * GIB / GB)
    return dev


# -- formulas on raw numbers --------------------------------------------------------------------------

def weight_bytes(args: ModelArgs) -> dict[str, int]:
    """Bytes of the weights per precision (fp32, fp16 (= bf16), int8): see the module docstring."""
    n = args.num_params()
    embedding = args.vocab_size * args.dim
    norms = (2 * args.n_layers + 1) * args.dim
    matrices = n - embedding - norms  # wq wk wv wo w1 w2 w3 per layer, and the output head
    n_matrices = 7 * args.n_layers + 1
    int8 = matrices + n_matrices * (4 + 1) + 4 * (embedding + norms)  # + fp32 scale, int8 zero point each
    return {"fp32": 4 * n, "fp16": 2 * n, "int8": int8}


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, cache_len: int, elem_bytes: int) -> int:
    """One sequence's KV cache: 2 (K and V) * layers * kv heads * head_dim * cache_len * bytes per element."""
    return 2 * n_layers * n_kv_heads * head_dim * cache_len * elem_bytes


def decode_bound_s(weights: float, kv_per_seq: float, batch: int, bandwidth_gbs: float) -> float:
    """Lower bound on seconds per decode step (one token per sequence): all weights and the whole cache
    of `batch` sequences read once at `bandwidth_gbs` GB/s."""
    return (weights + batch * kv_per_seq) / (bandwidth_gbs * GB)


def cache_len(cfg: RunConfig, args: ModelArgs) -> int:
    """export.kv_cache_len, or min(model max_seq_len, 1024) when null (what export_onnx uses)."""
    return cfg.export.kv_cache_len or min(args.max_seq_len, DEFAULT_CACHE_LEN)


# -- the benchmark's measurements -----------------------------------------------------------------------

@dataclass
class Measured:
    """One decode row of the benchmark beside the bound for its weights at its batch."""

    variant: str
    provider: str
    batch: int
    tpot_ms: float | None
    error: str | None
    bound_ms: float | None  # None: the batch was not planned or the variant has no precision here


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def read_decode(path: Path) -> tuple[list[dict], int | None] | None:
    """(decode rows, cache_len) from a benchmark results.json; None when there is no file. Missing or
    malformed keys give no rows rather than an error: the file is another stage's output."""
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return [], None
    llm = results.get("llm") if isinstance(results, dict) else None
    if not isinstance(llm, dict):
        return [], None
    rows = [r for r in llm.get("decode") or [] if isinstance(r, dict) and isinstance(r.get("batch"), int)]
    n = llm.get("cache_len")
    return rows, n if isinstance(n, int) else None


def _variant_precision(variant: str, provider: str) -> str | None:
    """The weight precision whose bound a measured variant is compared with (om: ATC's fp16; torch: fp32
    on a CPU, half precision on an accelerator)."""
    if variant in PRECISIONS:
        return variant
    if variant == "om":
        return "fp16"
    if variant == "torch":
        return "fp32" if provider == "cpu" else "fp16"
    return None


# -- the deployment plan --------------------------------------------------------------------------------

@dataclass
class Deploy:
    """Everything `llmpipe plan --deploy` prints. Bytes and seconds are raw numbers; the table converts."""

    flavor: str
    n_params: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    device: Device
    kv_dtype: str  # fp16 | fp32
    cache_len: int
    weights: dict[str, int]  # precision -> bytes
    kv_per_seq: int
    batches: list[int]
    bound_s: dict[str, dict[int, float]]  # precision -> batch -> seconds per token
    fits: dict[str, bool | None]  # precision -> weights + cache at the largest batch fit; None: memory unknown
    results_path: str
    measured: list[Measured] | None  # None: no finished benchmark
    measured_cache_len: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def deploy(cfg: RunConfig, soc: str | None = None, bandwidth_gbs: float | None = None,
           memory_gib: float | None = None) -> Deploy:
    """Size `cfg`'s model for inference on `soc` (default convert_om.soc_version): see the module docstring."""
    from llmpipe.tools.plan import planned_vocab

    try:
        args = model_args(cfg.model, planned_vocab(cfg))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    dev = resolve_target(soc or cfg.convert_om.soc_version, bandwidth_gbs, memory_gib,
                         what="--soc" if soc else "convert_om.soc_version")
    kv_elem = 4 if dev.kind == "cpu" else 2
    n_cache = cache_len(cfg, args)
    kv = kv_cache_bytes(args.n_layers, args.n_kv_heads, args.head_dim, n_cache, kv_elem)
    weights = weight_bytes(args)
    batches = sorted(set(cfg.benchmark.llm.batches))
    bound = {p: {b: decode_bound_s(w, kv, b, dev.bandwidth_gbs) for b in batches} for p, w in weights.items()}
    fits = {p: None if dev.memory_gb is None else w + max(batches) * kv <= dev.memory_gb * GB
            for p, w in weights.items()}
    from llmpipe.stages import stage_dir

    path = stage_dir(cfg.run_dir(), "benchmark") / RESULTS_FILE
    found = read_decode(path)
    measured, measured_len = None, None
    if found is not None:
        rows, measured_len = found
        measured = []
        for r in rows:
            variant, provider = str(r.get("variant")), str(r.get("provider"))
            prec = _variant_precision(variant, provider)
            b = r["batch"]
            measured.append(Measured(variant, provider, b, _number(r.get("tpot_ms")),
                                     r.get("error") if isinstance(r.get("error"), str) else None,
                                     1e3 * bound[prec][b] if prec and b in bound[prec] else None))
    return Deploy(flavor=cfg.model.shown(), n_params=args.num_params(), n_layers=args.n_layers,
                  n_kv_heads=args.n_kv_heads, head_dim=args.head_dim, vocab_size=args.vocab_size, device=dev,
                  kv_dtype="fp32" if kv_elem == 4 else "fp16", cache_len=n_cache, weights=weights, kv_per_seq=kv,
                  batches=batches, bound_s=bound, fits=fits, results_path=str(path), measured=measured,
                  measured_cache_len=measured_len)


# -- the table ----------------------------------------------------------------------------------------

def _size(n: float) -> str:
    if n >= GB:
        return f"{n / GB:9.3f} GB ({n / GIB:.3f} GiB)"
    return f"{n / 1e6:9.3f} MB ({n / (1 << 20):.3f} MiB)"


def _ms(s: float) -> str:
    return f"{1e3 * s:9.4g} ms"


def _measured_lines(d: Deploy) -> list[str]:
    if d.measured is None:
        return [f"measured   no finished benchmark ({d.results_path} not found)"]
    if not d.measured:
        return [f"measured   no decode measurement in {d.results_path}"]
    lines = [f"measured time per output token ({d.results_path})",
             f"  {'variant':<8} {'provider':<8} {'batch':>5} {'measured':>12} {'bound':>12} {'ratio':>7}"]
    for m in d.measured:
        got = _ms(m.tpot_ms / 1e3) if m.tpot_ms is not None else f"{'-':>12}"
        lim = _ms(m.bound_ms / 1e3) if m.bound_ms is not None else f"{'-':>12}"
        ratio = f"{m.tpot_ms / m.bound_ms:6.1f}x" if m.tpot_ms is not None and m.bound_ms else f"{'-':>7}"
        why = f"  ({m.error})" if m.error else ("  (no measurement)" if m.tpot_ms is None else "")
        lines.append(f"  {m.variant:<8} {m.provider:<8} {m.batch:>5} {got:>12} {lim:>12} {ratio:>7}{why}")
    other = sorted({m.provider for m in d.measured if _PROVIDER_KIND.get(m.provider) != d.device.kind})
    if other:
        lines.append(f"  NOTE: measured on {', '.join(other)}, the bound is for {d.device.name} "
                     f"({d.device.kind}): not comparable unless --soc names the machine that ran the benchmark")
    if d.measured_cache_len is not None and d.measured_cache_len != d.cache_len:
        lines.append(f"  NOTE: the benchmark ran with a {d.measured_cache_len}-token cache, the plan with "
                     f"{d.cache_len}")
    return lines


def format_deploy(d: Deploy) -> str:
    """A readable report of a Deploy (GB, GiB, ms)."""
    dev = d.device
    mem = f"{dev.memory_gb:g} GB" if dev.memory_gb is not None else "unknown (--memory-gib)"
    supports = ", ".join(dev.precisions) if dev.precisions else "not known"
    cols = "".join(f"{p:>12}" for p in PRECISIONS)
    lines = [
        f"model    {d.flavor}: {d.n_params / 1e9:.3f}B parameters, {d.n_layers} layers, {d.n_kv_heads} kv heads x "
        f"head_dim {d.head_dim}, vocab {d.vocab_size}",
        f"target   {dev.name} ({dev.kind}): {dev.bandwidth_gbs:g} GB/s memory bandwidth, {mem} "
        f"[{dev.source or 'table'}]",
        f"         computes in: {supports}",
        "",
        "weights (parameters only)",
        *(f"  {p:<6} {_size(w)}" for p, w in d.weights.items()),
        "  (fp16 = bf16. int8: onnxruntime dynamic quantization, per-tensor: matrices 1 B + an fp32 scale and int8",
        "   zero point each; the token embedding and the norms stay fp32)",
        "",
        f"KV cache ({d.kv_dtype} on {dev.kind}, {d.cache_len} tokens)",
        f"  per sequence {_size(d.kv_per_seq)}",
        *(f"  batch {b:<6} {_size(b * d.kv_per_seq)}" for b in d.batches),
        "",
        f"decode time per token, lower bound: (weights + batch x cache) / {dev.bandwidth_gbs:g} GB/s",
        f"  {'batch':>5}{cols}",
        *(f"  {b:>5}" + "".join(f"{_ms(d.bound_s[p][b]):>12}" for p in PRECISIONS) for b in d.batches),
        "  (every step reads all weights and the whole cache once; real steps also compute: a bound, not a "
        "prediction)",
        "",
        f"fits {mem} at batch {max(d.batches)}   " + "   ".join(
            f"{p}: {'-' if f is None else 'yes' if f else 'NO'}" for p, f in d.fits.items()),
        "",
        *_measured_lines(d),
    ]
    return "\n".join(lines)
