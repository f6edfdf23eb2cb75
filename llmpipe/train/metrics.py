"""Per-step metrics to metrics.jsonl and TensorBoard (rank 0 only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"


def read(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (train records carry "loss", eval records "val_loss")."""
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class MetricsWriter:
    def __init__(self, out_dir: Path, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        self.path = Path(out_dir) / METRICS
        # On resume, drop what a failed attempt logged after the checkpoint it resumes from.
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
