"""Per-step metrics to metrics.jsonl and TensorBoard (rank 0 only).

A kill or a full disk can leave the last line half-written: readers skip it (and any other line
that is not a record, counted in a warning), and a resumed writer rewrites the file without it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("llmpipe.train.metrics")

METRICS = "metrics.jsonl"


def _record(line: bytes) -> dict[str, Any] | None:
    """The record on `line`: a JSON object with an integer "step"; None for anything else."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # torn, not UTF-8, not JSON, absurdly nested
        return None
    ok = isinstance(rec, dict) and type(rec.get("step")) is int
    return rec if ok else None


def read(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (train records carry "loss", eval records "val_loss"); lines
    that are not records (a torn last line) are skipped with a warning."""
    if not Path(path).is_file():
        return []
    records, bad = [], []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                rec = _record(line)
                if rec is None:
                    bad.append(number)
                else:
                    records.append(rec)
    if bad:
        torn = " (a torn last line)" if bad == [number] and not line.endswith(b"\n") else ""
        log.warning("%s: skipped %d line(s) that are not metrics records%s: line %s", path, len(bad), torn,
                    ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else ""))
    return records


class MetricsWriter:
    def __init__(self, out_dir: Path, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        self.path = Path(out_dir) / METRICS
        # On resume, drop what a failed attempt logged after the checkpoint it resumes from, and
        # lines that are not records (a torn tail), which would sit in the middle once appended to.
        kept = [r for r in read(self.path)
                if r["step"] < resume_step or ("loss" in r and r["step"] == resume_step)]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._f = self.path.open("a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is a dependency, but metrics.jsonl alone is enough
            self._tb = None

    def _write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in rec.items():
                if k != "step" and v is not None:  # mfu is null without a peak: nothing to plot
                    self._tb.add_scalar(f"{'val' if k.startswith('val') else 'train'}/{k}", v, rec["step"])

    def step(self, rec: dict[str, Any]) -> None:
        if self.enabled:
            self._write(rec)

    def eval(self, step: int, val_loss: float) -> None:
        if self.enabled:
            self._write({"step": step, "val_loss": val_loss})

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                self._tb.close()
