"""Profiling training steps (train.profile): TensorBoard traces and a per-step time breakdown.

The profiler comes from device.py (torch.profiler; torch_npu.profiler on NPU) with the config's
wait / warmup / active / repeat schedule; traces land in `<train out>/profile/` (open them with
TensorBoard's profiler plugin, Perfetto or chrome://tracing). For every recorded step the main
thread's time is split into disjoint parts that sum to the step (the profiler's ProfilerStep#N
range, logging and checkpointing included):

    communication  inside collective / point-to-point calls (gloo, nccl, hccl, c10d) on the main
                   thread: the communication the step waits for (exposed)
    data           loading and copying the micro-batches (not already communication)
    compute        forward and backward (the rest of llmpipe/forward_backward)
    optimizer      clipping, the optimizer and lr steps (the rest of llmpipe/optimizer)
    other          everything else: logging, metrics, checkpoints, Python between the parts

Each row also has `communication_background_ms`: collectives running on other threads (DDP's
bucketed all-reduces on gloo's threads during backward), which overlap compute and are not part
of the sum. On CPU/gloo collective time is CPU time. On accelerators
kernels and collectives run asynchronously: CPU-side time then measures launch and wait, and the
device timeline is in the trace, not in this breakdown.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from torch.autograd.profiler import record_function

from llmpipe import device as dev
from llmpipe import mfu

log = logging.getLogger("llmpipe.train")

DATA, FORWARD_BACKWARD, OPTIMIZER = "llmpipe/data", "llmpipe/forward_backward", "llmpipe/optimizer"
PARTS = ("communication", "data", "compute", "optimizer", "other")
_COMM = re.compile(r"gloo|nccl|hccl|c10d::|all_?reduce|reduce_?scatter|all_?gather|broadcast|"
                   r"isend|irecv|batch_isend|barrier|record_param_comms", re.IGNORECASE)
_STEP = re.compile(r"^ProfilerStep[#*]")


def mark(name: str) -> contextlib.AbstractContextManager:
    """A labelled range in the trace (cheap when no profiler is running)."""
    return record_function(name)


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals`."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def breakdown(events, tokens_per_step: int, flops_per_token: float, peak_flops: float | None,
              first_step: int = 1) -> list[dict[str, Any]]:
    """Per recorded step: the disjoint parts (ms) of the main thread's time, step time, tokens/s, MFU
    (llmpipe.mfu's, as the training metrics; None without a peak). `events` is a profiler's `events()`;
    `first_step` is the (1-based) training step of the first one."""
    steps = sorted((e for e in events if _STEP.match(e.name)), key=lambda e: e.time_range.start)
    rows = []
    for i, st in enumerate(steps):
        s0, s1 = st.time_range.start, st.time_range.end
        within = [e for e in events if e is not st and e.time_range.end > s0 and e.time_range.start < s1]
        mine = [e for e in within if e.thread == st.thread]
        background = _union([(max(e.time_range.start, s0), min(e.time_range.end, s1)) for e in within
                             if e.thread != st.thread and _COMM.search(e.name)])

        clipped = [(e.name, max(e.time_range.start, s0), min(e.time_range.end, s1)) for e in mine]
        comm = [(a, b) for n, a, b in clipped if _COMM.search(n)]
        data, fwd_bwd, optim = ([(a, b) for n, a, b in clipped if n == label]
                                for label in (DATA, FORWARD_BACKWARD, OPTIMIZER))
        c, cd, cdf = _union(comm), _union(comm + data), _union(comm + data + fwd_bwd)
        cdfo = _union(comm + data + fwd_bwd + optim)
        step_us = s1 - s0
        parts = {"communication": c, "data": cd - c, "compute": cdf - cd, "optimizer": cdfo - cdf,
                 "other": step_us - cdfo}
        tok_s = tokens_per_step / (step_us / 1e6) if step_us > 0 else 0.0
        rows.append({"step": first_step + i, "step_ms": step_us / 1e3,
                     **{f"{k}_ms": v / 1e3 for k, v in parts.items()}, "communication_background_ms": background / 1e3,
                     "tokens_per_s": tok_s, "mfu": mfu.mfu(tok_s, flops_per_token, peak_flops)})
    return rows


class StepProfiler:
    """Context manager around the step loop; call `step()` after every training step. A no-op unless
    train.profile.enabled. Writes profile/breakdown_rank<r>.json and logs the mean breakdown."""

    def __init__(self, cfg, env, out_dir: Path, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float | None, first_step: int):
        self.cfg, self.env, self.p = cfg, env, cfg.train.profile
        self.folder = Path(out_dir) / "profile"
        self.meta = (tokens_per_step, flops_per_token, peak_flops, first_step)
        self.rows: list[dict[str, Any]] = []
        self._prof = None

    def _ready(self, prof) -> None:
        tokens, flops, peak, start = self.meta
        events = prof.events()
        n = sum(1 for e in events if _STEP.match(e.name))
        # prof.step_num counts the step() calls so far; the recorded steps are the last n of them
        self.rows.extend(breakdown(events, tokens, flops, peak, first_step=start + prof.step_num - n + 1))

    def __enter__(self) -> StepProfiler:
        if self.p.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._prof = dev.profiler(self.env.device, self.p.wait, self.p.warmup, self.p.active, self.p.repeat,
                                      str(self.folder), on_trace=self._ready, record_shapes=self.p.record_shapes,
                                      with_stack=self.p.with_stack)
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(*exc)
        self._prof = None
        mean = {k: sum(r[f"{k}_ms"] for r in self.rows) / len(self.rows) for k in ("step", *PARTS)} if self.rows \
            else {}
        (self.folder / f"breakdown_rank{self.env.rank}.json").write_text(
            json.dumps({"rank": self.env.rank, "steps": self.rows, "mean_ms": mean}, indent=2) + "\n")
        if self.env.main and mean:
            log.info("profile (%d steps, mean per step, rank 0): %.1f ms = %s; traces in %s", len(self.rows),
                     mean["step"], " + ".join(f"{k} {mean[k]:.1f}" for k in PARTS), self.folder)
