"""What `llmpipe run` prints: one line per stage start and end, progress bars, the report's path.

Every log record still reaches every handler that wants it: the stage logs (`<run>/logs/<NN_stage>.log`,
`<run>/logs/run.log`), Prefect's API handler (the Prefect UI) and, with `llmpipe run --verbose`, the
terminal. Without --verbose the terminal's handler lets through only

- the records marked with `show()` (a run's and a stage's start and end),
- llmpipe's own warnings and errors, and errors of any library but Prefect's engines (whose failure
  reports the CLI's one `error:` line replaces),

so Prefect's per-task-run lines ("Finished in state Completed()"), lm_eval's notices and each stage's
detail stay in the files. Progress bars (tqdm, to stderr, on a terminal only) are `bar()`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONSOLE = "llmpipe_console"  # the LogRecord attribute show() sets
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_ENGINE = ("prefect",)  # whose errors the CLI's own `error:` line replaces

log = logging.getLogger("llmpipe.console")


def show(logger: logging.Logger, msg: str, *args: Any) -> None:
    """Log `msg` at INFO, marked to appear on the terminal too."""
    logger.info(msg, *args, extra={CONSOLE: True})


class ConsoleFilter(logging.Filter):
    """The terminal's share of the records (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, CONSOLE, False):
            return True
        if record.name == "llmpipe" or record.name.startswith("llmpipe."):
            return record.levelno >= logging.WARNING
        return record.levelno >= logging.ERROR and not record.name.startswith(_ENGINE)


# The terminal, once quiet_console() has run: bars go there; whatever else a library writes to sys.stderr
# while a stage runs (lm_eval's and transformers' own progress bars) goes to the stage's log.
_TERMINAL = None


def terminal():
    """Where progress bars go: the terminal (stderr as it was before any stage redirected it)."""
    return _TERMINAL or sys.stderr


def quiet_console() -> None:
    """Install ConsoleFilter on the root logger's terminal handlers (not on files, not on Prefect's API
    handler, which subclasses neither), and send what libraries write to sys.stderr during a stage to its
    log (see log_to); idempotent."""
    global _TERMINAL
    _TERMINAL = _TERMINAL or sys.stderr
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler or type(handler).__name__ == "PrefectConsoleHandler":
            if not any(isinstance(f, ConsoleFilter) for f in handler.filters):
                handler.addFilter(ConsoleFilter())


# Loggers that do not propagate to the root logger but whose records belong in the stage logs.
_OWN_HANDLERS = ("transformers",)


@contextlib.contextmanager
def log_to(path: Path) -> Iterator[Path]:
    """Append every record logged in this process (all threads) to `path` while inside; on a quiet console
    (quiet_console), what is written to sys.stderr too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in _OWN_HANDLERS)]
    for lg in loggers:
        lg.addHandler(handler)
    with contextlib.ExitStack() as stack:
        if _TERMINAL is not None:  # quiet: the innermost log_to (a stage's, inside run.log's) takes it
            raw = stack.enter_context(open(path, "a", encoding="utf-8", buffering=1))  # noqa: SIM115
            stack.enter_context(contextlib.redirect_stderr(raw))
        try:
            yield path
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
            handler.close()


def logs_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "logs"


def bar(total: float, desc: str, unit: str = "it"):
    """A tqdm bar on the terminal (removed when closed), else None."""
    if not terminal().isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=terminal(), leave=False, dynamic_ncols=True,
                disable=False)  # NOTE: explicit: `llmpipe run` sets TQDM_DISABLE for libraries' own bars


_STEP = re.compile(r"^\[rank0\] step (\d+)/(\d+) ")


class StepBar:
    """Training progress from rank 0's `step N/M` lines (a bar on a terminal, nothing otherwise)."""

    def __init__(self) -> None:
        self.bar = None
        self.done = 0

    def line(self, text: str) -> None:
        m = _STEP.match(text)
        if m is None or not terminal().isatty():
            return
        step, total = int(m.group(1)), int(m.group(2))
        if self.bar is None:
            self.bar = bar(total, "train", "step")
        if self.bar is not None and step > self.done:
            self.bar.update(step - self.done)
            self.done = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def summary(stage: str, metrics: dict[str, Any]) -> str:
    """The one-line result of a finished stage, from its manifest's metrics ('' when none applies)."""
    m = metrics or {}
    if stage == "prepare_data" and "tokens" in m:
        return (f"{m.get('documents', '?')} documents, {_num(m['tokens'], ',')} tokens, "
                f"{m.get('train_samples', '?')} train / {m.get('val_samples', '?')} val samples")
    if stage == "train" and "val_loss" in m:
        return (f"{m.get('steps', '?')} steps, val loss {_num(m.get('val_loss_start'), '.3f')} -> "
                f"{_num(m['val_loss'], '.3f')} (ppl {_num(m.get('val_ppl'), '.1f')}), "
                f"{_num(m.get('tokens_per_s'), ',.0f')} tokens/s")
    if stage == "consolidate" and "params" in m:
        return f"step {m.get('step', '?')}, {_num(m['params'] / 1e6, '.2f')}M parameters, {m.get('dtype', '?')}"
    if stage == "export_onnx" and "parity_max_abs_diff" in m:
        return f"ONNX opset {m.get('opset', '?')}, parity max abs diff {_num(m['parity_max_abs_diff'], '.1e')}"
    if stage == "benchmark" and isinstance(m.get("decode_tokens_per_s"), dict):
        rates = ", ".join(f"{k.split('/')[-1]} {_num(v, '.0f')}" for k, v in m["decode_tokens_per_s"].items())
        rejected = m.get("rejected") or []
        return f"decode tokens/s: {rates}" + (f"; rejected: {', '.join(map(str, rejected))}" if rejected else "")
    if stage == "evaluate" and isinstance(m.get("verdicts"), dict):
        return "gates: " + ", ".join(f"{k} {v}" for k, v in m["verdicts"].items())
    return ""
