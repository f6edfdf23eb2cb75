"""The one module that knows the hardware: npu / cuda / cpu.

Everything device-specific lives here: picking the device, the distributed backend
(hccl / nccl / gloo), autocast and loss scaling, memory statistics, the name a device reports (which
llmpipe.mfu looks its peak FLOPS up by), and the onnxruntime execution providers. It is also the only
module that imports torch_npu.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from dataclasses import dataclass

import torch


@dataclass
class Env:
    """Where this process trains: its rank in the world, its device and the resolved precision."""

    rank: int
    world: int
    device: torch.device
    precision: str  # fp32 | bf16 | fp16, resolved from train.precision.dtype

    @property
    def main(self) -> bool:
        return self.rank == 0


def env(device: str, dtype: str) -> Env:
    """This process's Env: rank and world from the process group (0 and 1 without one), the device
    resolved from run.device and the precision from train.precision.dtype."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    resolved = resolve(device)
    return Env(rank, world, resolved, precision(resolved, dtype))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# What `llmpipe plan` sizes for when not told otherwise: an Ascend 910B2 (64 GiB of HBM), named as it
# reports itself (llmpipe.mfu's peak table is keyed by that name).
PLAN_DEVICE = "Ascend910B2"
PLAN_MEMORY_GIB = 64.0


_ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "npu": "CANNExecutionProvider"}


def _npu_available() -> bool:
    """Import torch_npu only when asked; it needs CANN and breaks `import torch` without it."""
    if "torch_npu" not in sys.modules:
        try:
            import torch_npu  # noqa: F401
        except Exception:  # ImportError, or OSError when CANN libraries are missing
            return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve(name: str = "auto") -> torch.device:
    """`auto` picks npu, then cuda, then cpu. Asking for a missing device is an error."""
    if name == "auto":
        if _npu_available():
            name = "npu"
        elif torch.cuda.is_available():
            name = "cuda"
        else:
            name = "cpu"
    elif name == "npu" and not _npu_available():
        raise RuntimeError("run.device: npu requested but torch_npu/CANN is not available")
    elif name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device: cuda requested but no CUDA device is visible")
    if name == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(name, local_rank)


def set_current(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)


def dist_backend(device: torch.device) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device.type]


def dist_env(device_name: str, timeout_s: int, hccl=None) -> dict[str, str]:
    """Environment for the launched ranks, the one place HCCL is configured: its timeouts (from
    train.dist_timeout_s) and train.hccl's algo, buffer size, RDMA devices and socket NIC."""
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    if device_name in ("npu", "auto"):
        env["HCCL_CONNECT_TIMEOUT"] = str(max(120, timeout_s))
        env["HCCL_EXEC_TIMEOUT"] = str(max(120, timeout_s))
        if hccl is not None:
            for key, value in (("HCCL_ALGO", hccl.algo), ("HCCL_BUFFER_SIZE", hccl.buffer_size_mb),
                               ("HCCL_IB_HCA", hccl.ib_hca), ("HCCL_SOCKET_IFNAME", hccl.socket_ifname)):
                if value is not None:
                    env[key] = str(value)
    return env


def precision(device: torch.device, requested: str) -> str:
    """Resolve train.precision.dtype: `auto` is bf16 on accelerators, fp32 on CPU."""
    if requested != "auto":
        return requested
    return "fp32" if device.type == "cpu" else "bf16"


def dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast on the device; fp32 is a no-op context."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str, init_scale: float, growth_interval: int):
    """A GradScaler for fp16, or None for fp32/bf16 (which need no loss scaling)."""
    if precision != "fp16":
        return None
    if device.type == "npu":
        from torch_npu.npu.amp import GradScaler  # type: ignore[import-not-found]

        return GradScaler(init_scale=init_scale, growth_interval=growth_interval)
    return torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)


def profiler(device: torch.device, wait: int, warmup: int, active: int, repeat: int, trace_dir: str,
             on_trace=None, record_shapes: bool = False, with_stack: bool = False):
    """A step-scheduled profiler writing TensorBoard traces into `trace_dir`: torch.profiler (CPU, plus
    CUDA kernels on GPU), torch_npu.profiler on NPU. `on_trace(prof)` runs after each cycle too."""
    if device.type == "npu":
        import torch_npu  # type: ignore[import-not-found]

        prof_mod = torch_npu.profiler
        activities = [prof_mod.ProfilerActivity.CPU, prof_mod.ProfilerActivity.NPU]
    else:
        prof_mod = torch.profiler
        activities = [prof_mod.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(prof_mod.ProfilerActivity.CUDA)
    write = prof_mod.tensorboard_trace_handler(trace_dir)

    def ready(prof) -> None:
        write(prof)
        if on_trace is not None:
            on_trace(prof)

    return prof_mod.profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack,
                            schedule=prof_mod.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
                            on_trace_ready=ready)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory; on CPU, the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "npu":
        return int(torch.npu.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_memory(device: torch.device) -> None:
    """Start `peak_memory_bytes` over from what is allocated now (accelerators; a CPU's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "npu":
        torch.npu.reset_peak_memory_stats(device)


def device_name(device: torch.device) -> str:
    """The name the device reports ("NVIDIA A100-SXM4-80GB", "Ascend910B2"); on CPU, the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device.index if device.index is not None else 0)
    return cpu_model()


def cpu_model() -> str:
    """This machine's CPU model: /proc/cpuinfo's "model name", else what `platform` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


@dataclass(frozen=True)
class OrtProvider:
    name: str  # short name used in reports: cpu, cuda, npu
    ort_name: str  # onnxruntime's provider name


def ort_memory(session) -> str:
    """Where an onnxruntime session's provider keeps its tensors, as OrtValue names the device: "cuda" for
    CUDA's, else "cpu" (the CPU provider's memory is the host's)."""
    return "cuda" if session.get_providers()[0] == _ORT_PROVIDERS["cuda"] else "cpu"


def ort_providers(requested: str | list[str] = "auto") -> list[OrtProvider]:
    """onnxruntime providers present here, among CPU, CUDA and CANN (Ascend)."""
    import onnxruntime as ort

    present = set(ort.get_available_providers())
    known = [OrtProvider(short, full) for short, full in _ORT_PROVIDERS.items()]
    if requested == "auto":
        return [p for p in known if p.ort_name in present]
    chosen = []
    for want in requested:
        match = [p for p in known if want in (p.name, p.ort_name)]
        if not match:
            raise ValueError(f"benchmark.providers: unknown provider {want!r} (known: {sorted(_ORT_PROVIDERS)})")
        if match[0].ort_name not in present:
            raise ValueError(f"benchmark.providers: {want!r} is not available in this onnxruntime build")
        chosen.append(match[0])
    return chosen


def cann_toolkit_dirs() -> list[str]:
    """Where the CANN toolkit usually lives (for finding `atc`)."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME")
    dirs = [home] if home else []
    dirs += ["/usr/local/Ascend/ascend-toolkit/latest", os.path.expanduser("~/Ascend/ascend-toolkit/latest")]
    return dirs


def fused_adamw(device_types: set[str]) -> bool:
    """Whether torch's fused AdamW is used (optim.build_optimizer): when every parameter is on the CPU,
    where it is one pass per tensor with no temporaries (a small-flavor step 55 ms against foreach's
    326; benchmarks/train_vs_hf.py). Accelerators keep foreach, the implementation the planner's step
    temporaries were measured with; torch_npu's fused kernels are not checked yet."""
    return device_types == {"cpu"}


def compile_backend(device: torch.device):
    """torch.compile's backend for `device`: inductor on CPU and CUDA, torchair's on NPU. Raises
    RuntimeError with one line when the backend cannot work here: inductor generates C++ on CPU (and
    Triton builds its launchers with a C compiler on CUDA), so it needs a compiler on PATH."""
    import shutil

    if device.type == "npu":
        try:
            import torchair  # type: ignore[import-not-found]  # torch_npu's graph-mode companion
        except Exception as err:  # ImportError, or OSError from missing CANN libraries
            raise RuntimeError(f"train.compile on NPU needs torchair (torch_npu's torch.compile backend), "
                               f"which does not import here: {err}") from None
        return torchair.get_npu_backend()
    names = ["g++", "c++", "clang++"] if device.type == "cpu" else ["cc", "gcc", "clang"]
    env = os.environ.get("CXX" if device.type == "cpu" else "CC")
    if not any(shutil.which(n) for n in ([env] if env else []) + names):
        kind = "C++" if device.type == "cpu" else "C"
        raise RuntimeError(f"train.compile: inductor on {device.type} needs a {kind} compiler and none is on "
                           f"PATH (looked for {', '.join(([env] if env else []) + names)}); install one "
                           "(e.g. apt install g++) or set train.compile: false")
    return "inductor"


# What a cluster scheduler is asked for per accelerator (train.cluster.accelerator): the Kubernetes
# extended resource (Ascend's device plugin, NVIDIA's), Slurm's GRES name, and the ring label
# MindCluster's AscendJob schedules Ascend 910 chips by (its ring-controller.atlas label).
_CLUSTER_RESOURCE = {"npu": "huawei.com/Ascend910", "cuda": "nvidia.com/gpu"}
_SLURM_GRES = {"npu": "npu", "cuda": "gpu"}
_ASCEND_RING = {"npu": "ascend-910b"}


def ascend_ring(accelerator: str) -> str | None:
    """The ring-controller.atlas label an AscendJob's pods carry for these devices; None off Ascend."""
    return _ASCEND_RING.get(accelerator)


def cluster_resource(accelerator: str) -> str | None:
    """The Kubernetes resource a node's devices are requested as; None on CPU."""
    return _CLUSTER_RESOURCE.get(accelerator)


def slurm_gres(accelerator: str) -> str | None:
    """Slurm's generic resource name for the devices; None on CPU."""
    return _SLURM_GRES.get(accelerator)


def cluster_env(accelerator: str, timeout_s: int, hccl=None) -> dict[str, str]:
    """The collective library's environment for ranks a scheduler starts on other machines: HCCL's
    (dist_env) on NPU; NCCL's network settings from the same train.hccl fields on CUDA."""
    env = dist_env(accelerator, timeout_s, hccl)
    if accelerator == "cuda" and hccl is not None:
        for key, value in (("NCCL_IB_HCA", hccl.ib_hca), ("NCCL_SOCKET_IFNAME", hccl.socket_ifname)):
            if value is not None:
                env[key] = str(value)
    return env
