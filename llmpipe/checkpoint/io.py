"""Training checkpoints: atomic save, sha256 verification, newest-valid lookup, retention.

A checkpoint is a folder `step-NNNNNN/` holding what the data-parallel strategy writes (for
format "full", from DDP: model.safetensors, optimizer.pt, trainer_state.pt) and meta.json: format,
step, world size, model args, and the sha256 of every other file. It is written into
`step-NNNNNN.tmp/` and renamed into place with meta.json written last, so a folder without a valid
meta.json is never trusted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmpipe.checkpoint import trust
from llmpipe.manifest import sha256_file

log = logging.getLogger("llmpipe.checkpoint")

META = "meta.json"
MODEL = "model.safetensors"  # the full-format weights file
_STEP_RE = re.compile(r"^step-(\d{6,})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save(root: Path, step: int, write: Callable[[Path], None], meta: dict[str, Any], rank: int = 0,
         barrier: Callable[[], None] = lambda: None) -> Path:
    """Write one checkpoint atomically. Every rank calls this; `write(folder)` writes that rank's
    files; then rank 0 hashes every file into meta.json and renames the folder into place."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    write(tmp)
    barrier()
    if rank == 0:
        files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / META).write_text(json.dumps({**meta, "step": step, "files": files}, indent=2) + "\n")
        if final.exists():  # a previous attempt's checkpoint at the same step
            shutil.rmtree(final)
        os.replace(tmp, final)
    barrier()
    return final


def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete, holds exactly the files meta.json lists, every file
    matches its sha256 and nothing in it would run code when loaded (trust.check); else the problem."""
    folder = Path(folder)
    meta_path = folder / META
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"{meta_path} missing or unreadable"
    if not files:
        return f"{meta_path} lists no files"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {META}
    for name in sorted(present - set(files)):
        return f"{folder / name} is not listed in {META}"
    for name, digest in files.items():
        p = folder / name
        if not p.is_file():
            return f"{p} missing"
        if sha256_file(p) != digest:
            return f"{p} does not match its sha256 (corrupted or partially written)"
    return trust.check(folder)


def list_steps(root: Path) -> list[Path]:
    """Checkpoint folders under `root`, oldest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_valid(root: Path) -> Path | None:
    """The newest checkpoint that verifies; corrupted newer ones are reported and passed over."""
    for folder in reversed(list_steps(root)):
        problem = verify(folder)
        if problem is None:
            return folder
        log.warning("checkpoint %s is not usable (%s); trying the previous one", folder.name, problem)
    return None


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` checkpoints (only step-NNNNNN folders)."""
    for folder in list_steps(root)[:-keep_last]:
        shutil.rmtree(folder, ignore_errors=True)


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / META).read_text())
