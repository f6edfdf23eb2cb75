"""What a training step cost: wall time, tokens/s, MFU (llmpipe.mfu), communication bytes and the
seconds torch.compile took inside it. `start()` before the step, `stop(strategy)` after it (the
device synchronised first) gives the step's record fields; `summary()` the run's steady figures.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from llmpipe import device as dev
from llmpipe import mfu

log = logging.getLogger("llmpipe.train")


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far, as torch._dynamo records them: tracing
    and compiling forward graphs (dynamo's compile_inner, which holds inductor's forward compile)
    plus backward graphs, compiled lazily at the first backward."""
    from torch._dynamo.utils import compilation_time_metrics as times

    return float(sum(times.get("_compile.compile_inner", [])) + sum(times.get("compile_fx.<locals>.bw_compiler", [])))


class Meter:
    """Times each step and turns it into throughput against the job's peak (None: MFU n/a)."""

    def __init__(self, env, tokens_per_step: int, flops_per_token: float, peak_flops: float | None):
        self.env, self.tokens_per_step = env, tokens_per_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.tokens_per_s: list[float] = []  # every step's, the first (warm-up, compile) included
        self.t_start = time.perf_counter()
        self._t0 = self._c0 = 0.0

    def start(self) -> None:
        self._c0 = compile_seconds()
        self._t0 = time.perf_counter()

    def stop(self, strategy, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tokens_per_s, mfu, step_time_s), (comm_bytes, compile_s where there are any) of step `step`."""
        dev.synchronize(self.env.device)
        dt = time.perf_counter() - self._t0
        tok_s = self.tokens_per_step / dt
        self.tokens_per_s.append(tok_s)
        timing = {"tokens_per_s": tok_s, "mfu": mfu.mfu(tok_s, self.flops_per_token, self.peak_flops),
                  "step_time_s": dt}
        extra: dict[str, Any] = {}
        sent = strategy.comm_bytes()
        if sent is not None:
            extra["comm_bytes"] = sent
        compiled = compile_seconds() - self._c0
        if compiled > 0:  # graphs compiled during this step (not a training cost per step)
            extra["compile_s"] = compiled
            if self.env.main:
                log.info("step %d: torch.compile took %.1f s of this step's %.1f s (left out of the "
                         "steady tokens/s)", step, compiled, dt)
        return timing, extra

    def summary(self) -> dict[str, Any]:
        """Steady tokens/s (every step but the first, when there are more) and its MFU, wall seconds."""
        steady = self.tokens_per_s[1:] or self.tokens_per_s
        tok_s = float(np.mean(steady)) if steady else 0.0
        return {"tokens_per_s": tok_s,
                "mfu": mfu.mfu(tok_s, self.flops_per_token, self.peak_flops) if steady else None,
                "wall_s": time.perf_counter() - self.t_start}
