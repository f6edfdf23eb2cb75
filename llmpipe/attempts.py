"""What earlier attempts of a stage leave behind, kept on purpose.

    artifacts/<run>/superseded/<NN_stage>-<fingerprint12>-<UTC>/   a resumable stage's folder (training:
                                     checkpoints) whose fingerprint no longer matches, moved aside
                                     instead of deleted; a later attempt may warm-start from it
    artifacts/<run>/failed/<NN_stage>-<UTC>/   a failed attempt's evidence: its logs and error files
                                     (not checkpoints or large outputs) and error.txt; the last
                                     FAILED_KEEP per stage are kept

Nothing here deletes a checkpoint except `clean` (the explicit `llmpipe clean RUN [--keep N]`) and
`prune_superseded` (the train.checkpoint.keep_superseded retention setting).

Nothing outside the run folder's real path is ever written or deleted through these folders:
superseded/ or failed/ as a symlink (or not a folder) is refused (KeptFolderError), and removals go
through a descriptor of the folder opened without following a link, so one swapped for a link after
the check is not followed either. A symlink inside them is never a kept folder: nothing is read
through it, and a removal unlinks it and leaves its target alone. The run folder itself may be a
symlink (artifacts_dir on another disk, by the user's choice); its real path is the run's.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from llmpipe.errors import UserError

log = logging.getLogger("llmpipe.stages")

SUPERSEDED, FAILED = "superseded", "failed"
FAILED_KEEP = 5  # failed attempts' evidence kept per stage
EVIDENCE_MAX_BYTES = 16 << 20  # larger files (weights, ONNX graphs) are not evidence
# Logs and error files: what a failed attempt's evidence is (results and weights are not).
_EVIDENCE_GLOBS = ("*.log", "*.out", "*.err", "*.jsonl", "error*.json", "*argv.json", "config.yaml")
_EVIDENCE_FOLDERS = {"torchrun-logs"}  # every file below: per-rank output and error files
ERROR_FILE = "error.txt"
_NAME_RE = re.compile(r"^(\d\d_[a-z_]+)-(?:([0-9a-f]{12})-)?(\d{8}T\d{6}\d*Z)$")


class KeptFolderError(UserError):
    """superseded/ or failed/ is a symlink or not a folder: nothing is written or deleted through it."""


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


def _checked(root: Path) -> bool:
    """Whether run_dir/<kind>/ exists; KeptFolderError if it is a symlink or not a folder. A plain
    folder directly under the run folder cannot resolve outside its real path."""
    if root.is_symlink():
        raise KeptFolderError(f"{root} is a symlink (to {os.readlink(root)}); {root.name}/ must be a plain "
                              f"folder inside the run folder: nothing is written or deleted through a link")
    if root.exists() and not root.is_dir():
        raise KeptFolderError(f"{root} is not a folder")
    return root.exists()


def check_folders(run_dir: Path) -> None:
    """Refuse (KeptFolderError) a superseded/ or failed/ that is a symlink or not a folder."""
    for kind in (SUPERSEDED, FAILED):
        _checked(Path(run_dir) / kind)


def kept(run_dir: Path, kind: str, stage_folder: str | None = None, *, links: bool = False) -> list[Kept]:
    """Folders under run_dir/<kind>/ (optionally of one stage), newest first; KeptFolderError if <kind>/
    is a symlink. A symlink inside is not listed (nothing is read through it) unless links=True (to
    remove it)."""
    root = Path(run_dir) / kind
    found = []
    if _checked(root):
        with os.scandir(root) as entries:
            for e in entries:
                m = _NAME_RE.match(e.name)
                wanted = e.is_dir(follow_symlinks=False) or (links and e.is_symlink())
                if wanted and m and (stage_folder is None or m.group(1) == stage_folder):
                    found.append(Kept(root / e.name, m.group(1), m.group(2), m.group(3)))
    return sorted(found, key=lambda k: k.stamp, reverse=True)


@contextmanager
def _opened(root: Path) -> Iterator[int]:
    """A descriptor of a checked kept-folder root, opened without following a link (ELOOP if it became
    one since the check); removals go through it, never through the root's path."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        yield fd
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Removed:
    """One entry removed from superseded/ or failed/."""

    path: Path
    bytes: int  # freed (0 for a symlink)
    link: str | None = None  # a symlink's target, left alone

    def __str__(self) -> str:
        return f"removed {self.path}" + (f" (a symlink; its target {self.link} left alone)" if self.link else "")


def _remove(fd: int, k: Kept) -> Removed:
    """Remove one entry of the folder open as `fd`: a folder with everything below it (rmtree with a
    dir_fd follows no link, and refuses one swapped in), a symlink by unlinking it."""
    name = k.path.name
    if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
        target = os.readlink(name, dir_fd=fd)
        os.unlink(name, dir_fd=fd)
        return Removed(k.path, 0, target)
    size = 0
    for _, _, files, d in os.fwalk(name, dir_fd=fd):  # follows no link
        for f in files:
            st = os.stat(f, dir_fd=d, follow_symlinks=False)
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    shutil.rmtree(name, dir_fd=fd)
    return Removed(k.path, size)


def supersede(folder: Path, run_dir: Path, stage_folder: str, fingerprint: str) -> Path:
    """Move a stage folder whose fingerprint no longer matches aside (never delete it); KeptFolderError
    if superseded/ is a symlink or not a folder."""
    root = Path(run_dir) / SUPERSEDED
    if not _checked(root):
        root.mkdir(parents=True, exist_ok=True)
    name = f"{stage_folder}-{fingerprint[:12]}-{_stamp()}"
    with _opened(root) as fd:
        os.replace(folder, name, dst_dir_fd=fd)
    log.info("kept the previous %s attempt (fingerprint %s) as %s", stage_folder, fingerprint[:12], root / name)
    return root / name


def prune_superseded(run_dir: Path, stage_folder: str, keep: int | None) -> list[Path]:
    """Retention: remove all but the newest `keep` superseded folders of a stage (None: keep all). Runs
    after the newer result is verified and published, so a problem (a symlinked superseded/, a folder
    that cannot be removed) is a warning, never a failure of the stage; nothing is removed through a
    link."""
    if keep is None:
        return []
    removed = []
    try:
        root = Path(run_dir) / SUPERSEDED
        if not _checked(root):
            return []
        with _opened(root) as fd:
            for k in kept(run_dir, SUPERSEDED, stage_folder, links=True)[keep:]:
                try:
                    log.info("%s (retention keeps %d)", _remove(fd, k), keep)
                    removed.append(k.path)
                except OSError as err:
                    log.warning("retention: could not remove %s: %s", k.path, err)
    except (KeptFolderError, OSError) as err:
        log.warning("retention of superseded %s folders skipped: %s", stage_folder, err)
    return removed


def clean(run_dir: Path, keep: int = 0, done: Callable[[Removed], None] = lambda r: None) -> list[Removed]:
    """`llmpipe clean`: remove superseded folders beyond the newest `keep` per stage, calling done()
    after each removal (a failure half-way leaves an accurate record). Refuses, before removing
    anything, a superseded/ or failed/ that is a symlink or not a folder (KeptFolderError)."""
    check_folders(run_dir)
    root = Path(run_dir) / SUPERSEDED
    if not root.exists():
        return []
    removed = []
    with _opened(root) as fd:
        found = kept(run_dir, SUPERSEDED, links=True)
        for stage_folder in sorted({k.stage_folder for k in found}):
            for k in [k for k in found if k.stage_folder == stage_folder][keep:]:
                removed.append(_remove(fd, k))
                done(removed[-1])
    return removed


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
    its one-line error is all there is. Best effort: a full disk, or a failed/ that is a symlink (never
    written through), must not hide the stage's own error."""
    files = _evidence(Path(work_dir)) if Path(work_dir).is_dir() else []
    if not files:
        return None
    dest = Path(run_dir) / FAILED / f"{stage_folder}-{_stamp()}"
    try:
        _checked(dest.parent)
    except KeptFolderError as err:
        log.warning("kept no evidence of the failed attempt: %s", err)
        return None
    try:
        dest.mkdir(parents=True)
        for f in files:
            target = dest / f.relative_to(work_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
        text = "".join(traceback.format_exception(exc))
        (dest / ERROR_FILE).write_text(f"{type(exc).__name__}: {exc}\n\n{text}", encoding="utf-8")
    except OSError as err:
        log.warning("could not keep the failed attempt's evidence in %s: %s", dest, err)
        shutil.rmtree(dest, ignore_errors=True)
        return None
    try:
        with _opened(dest.parent) as fd:
            for old in kept(run_dir, FAILED, stage_folder, links=True)[FAILED_KEEP:]:
                _remove(fd, old)
    except (KeptFolderError, OSError) as err:
        log.warning("could not remove older failed attempts' evidence under %s: %s", dest.parent, err)
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
    try:  # untrusted like any file in the run folder: a bounded read, any bytes
        with open(found[0].path / ERROR_FILE, "rb") as f:
            first = f.read(4096).decode("utf-8", errors="replace").splitlines()[0]
    except (OSError, IndexError):
        first = "(no error.txt)"
    return found[0], first
