"""What earlier attempts of a stage leave behind, kept on purpose.

    artifacts/<run>/superseded/<NN_stage>-<fingerprint12>-<UTC>/   a resumable stage's folder (training:
                                     checkpoints) whose fingerprint no longer matches, moved aside
                                     instead of deleted; a later attempt may warm-start from it
    artifacts/<run>/failed/<NN_stage>-<UTC>/   a failed attempt's evidence: its logs and error files
                                     (not checkpoints or large outputs) and error.txt; the last
                                     FAILED_KEEP per stage are kept

Nothing here deletes a checkpoint except `clean` (the explicit `llmpipe clean RUN [--keep N]`) and
`prune_superseded` (the train.checkpoint.keep_superseded retention setting).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger("llmpipe.stages")

SUPERSEDED, FAILED = "superseded", "failed"
FAILED_KEEP = 5  # failed attempts' evidence kept per stage
EVIDENCE_MAX_BYTES = 16 << 20  # larger files (weights, ONNX graphs) are not evidence
# Logs and error files: what a failed attempt's evidence is (results and weights are not).
_EVIDENCE_GLOBS = ("*.log", "*.out", "*.err", "*.jsonl", "error*.json", "*argv.json", "config.yaml")
_EVIDENCE_FOLDERS = {"torchrun-logs"}  # every file below: per-rank output and error files
ERROR_FILE = "error.txt"
_NAME_RE = re.compile(r"^(\d\d_[a-z_]+)-(?:([0-9a-f]{12})-)?(\d{8}T\d{6}\d*Z)$")


def _stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


@dataclass(frozen=True)
class Kept:
    """One folder under superseded/ or failed/."""

    path: Path
    stage_folder: str  # "02_train"
    fingerprint: str | None  # first 12 hex digits (superseded only)
    stamp: str

    @property
    def bytes(self) -> int:
        return folder_bytes(self.path)

    @property
    def when(self) -> str:
        """The UTC time in the name, as ISO 8601 (seconds)."""
        t = datetime.strptime(self.stamp[:15], "%Y%m%dT%H%M%S")
        return t.replace(tzinfo=timezone.utc).isoformat(timespec="seconds")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and not f.is_symlink())


def kept(run_dir: Path, kind: str, stage_folder: str | None = None) -> list[Kept]:
    """Folders under run_dir/<kind>/ (optionally of one stage), newest first."""
    root = Path(run_dir) / kind
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME_RE.match(p.name)
            if p.is_dir() and m and (stage_folder is None or m.group(1) == stage_folder):
                found.append(Kept(p, m.group(1), m.group(2), m.group(3)))
    return sorted(found, key=lambda k: k.stamp, reverse=True)


def supersede(folder: Path, run_dir: Path, stage_folder: str, fingerprint: str) -> Path:
    """Move a stage folder whose fingerprint no longer matches aside (never delete it)."""
    dest = Path(run_dir) / SUPERSEDED / f"{stage_folder}-{fingerprint[:12]}-{_stamp()}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder, dest)
    log.info("kept the previous %s attempt (fingerprint %s) as %s", stage_folder, fingerprint[:12], dest)
    return dest


def prune_superseded(run_dir: Path, stage_folder: str, keep: int | None) -> list[Path]:
    """Retention: remove all but the newest `keep` superseded folders of a stage (None: keep all)."""
    if keep is None:
        return []
    removed = []
    for k in kept(run_dir, SUPERSEDED, stage_folder)[keep:]:
        shutil.rmtree(k.path)
        removed.append(k.path)
        log.info("removed superseded %s (retention keeps %d)", k.path, keep)
    return removed


def clean(run_dir: Path, keep: int = 0) -> tuple[list[Path], int]:
    """`llmpipe clean`: remove superseded folders beyond the newest `keep` per stage. Returns the
    removed folders and the bytes freed."""
    removed, freed = [], 0
    for stage_folder in sorted({k.stage_folder for k in kept(run_dir, SUPERSEDED)}):
        for k in kept(run_dir, SUPERSEDED, stage_folder)[keep:]:
            freed += k.bytes
            shutil.rmtree(k.path)
            removed.append(k.path)
    return removed, freed


def _evidence(src: Path) -> list[Path]:
    """Files of a failed attempt worth keeping: logs, error files, the config it ran; not results."""
    out = []
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src)
        wanted = rel.parts[0] in _EVIDENCE_FOLDERS or any(f.match(g) for g in _EVIDENCE_GLOBS)
        if wanted and f.is_file() and not f.is_symlink() and f.stat().st_size <= EVIDENCE_MAX_BYTES:
            out.append(f)
    return out


def keep_failure(work_dir: Path, run_dir: Path, stage_folder: str, exc: BaseException) -> Path | None:
    """Copy a failed attempt's evidence to failed/<NN_stage>-<UTC>/ with error.txt; keep the last
    FAILED_KEEP per stage. An attempt that wrote nothing (bad input refused up front) keeps nothing:
    its one-line error is all there is. Best effort: a full disk must not hide the stage's own error."""
    files = _evidence(Path(work_dir)) if Path(work_dir).is_dir() else []
    if not files:
        return None
    dest = Path(run_dir) / FAILED / f"{stage_folder}-{_stamp()}"
    try:
        dest.mkdir(parents=True)
        for f in files:
            target = dest / f.relative_to(work_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
        text = "".join(traceback.format_exception(exc))
        (dest / ERROR_FILE).write_text(f"{type(exc).__name__}: {exc}\n\n{text}", encoding="utf-8")
        for old in kept(run_dir, FAILED, stage_folder)[FAILED_KEEP:]:
            shutil.rmtree(old.path, ignore_errors=True)
    except OSError as err:
        log.warning("could not keep the failed attempt's evidence in %s: %s", dest, err)
        shutil.rmtree(dest, ignore_errors=True)
        return None
    return dest


def repoint(message: str, work_dir: Path, evidence: Path | None) -> str:
    """A failure message naming files in the stage's work folder, pointed at their kept copies."""
    if evidence is None:
        return message

    def swap(m: re.Match) -> str:
        copy = evidence / m.group(1).lstrip("/") if m.group(1) else evidence
        return str(copy) if copy.exists() else m.group(0)

    return re.sub(re.escape(str(work_dir)) + r"(/[^\s:'\"),]*[^\s:'\"),.])?", swap, message)


def last_failure(run_dir: Path, stage_folder: str) -> tuple[Kept, str] | None:
    """The newest failed attempt of a stage and the first line of its error, if any."""
    found = kept(run_dir, FAILED, stage_folder)
    if not found:
        return None
    try:
        first = (found[0].path / ERROR_FILE).read_text(encoding="utf-8").splitlines()[0]
    except (OSError, IndexError):
        first = "(no error.txt)"
    return found[0], first
