"""Training checkpoints: atomic save, sha256 verification, newest-valid lookup, retention.

A checkpoint is a folder `step-NNNNNN/` holding what the data-parallel strategy writes (for
format "full", from DDP: model.safetensors, optimizer.pt, trainer_state.pt) and meta.json: format,
step, world size, model args, and the sha256 and size of every other file. It is written into
`step-NNNNNN.tmp/` and renamed into place with meta.json written last, so a folder without a valid
meta.json is never trusted.

At scale no rank reads another rank's files: each rank hashes the files it wrote (the strategy's
`write` says which), rank 0 gathers the small {path: sha256} dicts and hashes only what no rank
claimed. A failed write on any rank (a full disk) fails the save on every rank with one line and
leaves the previous checkpoints untouched; retention deletes old checkpoints only after the newest
one verified. With `Saver(asynchronous=True)` the slow part (writing, hashing, meta.json, rename,
retention) runs in a background thread on its own process group; the step loop waits only while
the state is staged, and for the previous save before starting the next.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from llmpipe.checkpoint import trust
from llmpipe.manifest import sha256_file

log = logging.getLogger("llmpipe.checkpoint")

META = "meta.json"
# The files of a checkpoint folder, named once (llmpipe.checkpoint.state writes and reads them;
# checkpoint.dcp names dcp/, checkpoint.zero DeepSpeed's deepspeed/).
MODEL = "model.safetensors"  # the full-format weights file
OPTIM = "optimizer.pt"  # the full-format optimizer state
TRAINER = "trainer_state.pt"  # counters, RNG, lr schedule, loss scaler (formats full and dcp; rank 0)
CONFIG = "config.yaml"  # the resolved run config (llmpipe.config.load reads it)
TOKENIZER = "tokenizer.json"  # the tokenizer the model was trained with
_STEP_RE = re.compile(r"^step-(\d{6,})$")


class CheckpointError(OSError):
    """A checkpoint could not be saved (full disk, a rank's write failed); the message is one line."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


@dataclass
class Written:
    """What one rank's `write(folder)` did: `claims()` lists the files it wrote (asked once `pending`,
    the future of an asynchronous write, is done). A plain list of paths (or None) works too."""
    claims: Callable[[], Iterable[Path]] = list
    pending: Future | None = None


@dataclass
class _Job:
    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    written: Written | None = None
    error: str | None = None
    result: list[Any] = field(default_factory=list)


def _one_line(err: BaseException) -> str:
    text = (str(err).splitlines() or [""])[0] or type(err).__name__
    return f"{type(err).__name__}: {text}" if not isinstance(err, OSError) else text


def hash_files(folder: Path, paths: Iterable[Path]) -> dict[str, list]:
    """{path relative to folder: [sha256, bytes]} of the given files under `folder`."""
    out = {}
    for p in paths:
        p = Path(folder) / p if not Path(p).is_absolute() else Path(p)
        if p.is_file():
            out[p.relative_to(folder).as_posix()] = [sha256_file(p), p.stat().st_size]
    return out


class Saver:
    """Saves checkpoints under `root`; every rank makes one with the same arguments and calls
    `save(step, write, meta)` at the same steps, then `wait()` before the end."""

    def __init__(self, root: Path, rank: int = 0, world: int = 1, keep_last: int | None = None,
                 asynchronous: bool = False, protect: int | None = None,
                 describe: dict[str, bytes | Path] | None = None):
        self.root, self.rank, self.world, self.keep_last = Path(root), rank, world, keep_last
        # files rank 0 adds to every checkpoint folder (name -> content, or a file to copy): the resolved
        # config and the tokenizer, so a step folder explains itself; hashed and listed like the rest
        self.describe = describe or {}
        self.protect = protect  # retention keeps the newest checkpoint at or before this step too
        self.asynchronous = asynchronous
        # NOTE: the background thread's collectives (DCP's and the digest gather) run on a group of
        # their own, so they never interleave with the training's on the default group.
        self.group = dist.new_group(backend="gloo") if asynchronous and world > 1 else None
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def save(self, step: int, write: Callable[[Path], Written | Iterable[Path] | None],
             meta: dict[str, Any]) -> float:
        """Write checkpoint `step`: `write(folder)` writes this rank's files and says which (see
        Written). Returns the seconds the caller was blocked (the training stall)."""
        t0 = time.perf_counter()
        self.wait()  # the previous asynchronous save: its error surfaces here
        final = step_dir(self.root, step)
        job = _Job(step, final.with_name(final.name + ".tmp"), final, meta)
        if self.rank == 0:
            if job.tmp.exists():  # a failed attempt's leftovers: never a checkpoint
                shutil.rmtree(job.tmp)
            job.tmp.mkdir(parents=True)
        self._barrier()
        try:
            w = write(job.tmp)
            job.written = w if isinstance(w, Written) else Written(lambda w=w: list(w or []))
        except Exception as err:  # every rank must reach the gather: report it there
            if not isinstance(err, OSError):
                log.exception("rank %d: writing checkpoint %s failed", self.rank, final.name)
            job.error = _one_line(err)
        if self.asynchronous and job.error is None and job.written.pending is not None:
            self._job = job
            self._thread = threading.Thread(target=self._finish, args=(job,), daemon=True,
                                            name=f"checkpoint-{step}")
            self._thread.start()
        else:
            self._finish(job)
            self._raise(job)
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the pending asynchronous save (if any) is complete; raise its error."""
        if self._thread is not None:
            self._thread.join()
            job, self._thread, self._job = self._job, None, None
            self._raise(job)

    @staticmethod
    def _raise(job: _Job) -> None:
        if job.result and job.result[0] is not None:
            raise job.result[0]

    def _finish(self, job: _Job) -> None:
        """Hash this rank's files, gather every rank's digests and errors, then on rank 0: hash what
        nobody claimed, write meta.json, check the folder, rename, prune."""
        digests: dict[str, list] = {}
        if job.error is None:
            try:
                if job.written.pending is not None:
                    job.written.pending.result()
                digests = hash_files(job.tmp, job.written.claims())
            except Exception as err:
                job.error = _one_line(err)
        try:
            reports = self._gather({"rank": self.rank, "files": digests, "error": job.error})
            err = None
            if self.rank == 0:
                self._publish(job, reports)
            else:
                failed = [r for r in reports if r["error"]]
                if failed:
                    err = CheckpointError(_failure(job, failed))
            job.result.append(err)
        except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
            job.result.append(e)

    def _publish(self, job: _Job, reports: list[dict]) -> None:
        failed = [r for r in reports if r["error"]]
        try:
            if failed:
                raise CheckpointError(_failure(job, failed))
            for name, src in self.describe.items():
                if isinstance(src, bytes):
                    (job.tmp / name).write_bytes(src)
                else:
                    shutil.copyfile(src, job.tmp / name)
            files: dict[str, list] = {}
            for r in reports:
                files.update(r["files"])
            present = sorted(p for p in job.tmp.rglob("*") if p.is_file())
            unclaimed = [p for p in present if p.relative_to(job.tmp).as_posix() not in files]
            if unclaimed:
                log.debug("checkpoint %s: rank 0 hashes %d unclaimed files", job.final.name, len(unclaimed))
            files.update(hash_files(job.tmp, unclaimed))
            files = dict(sorted(files.items()))
            body = {**job.meta, "step": job.step, "files": {k: v[0] for k, v in files.items()},
                    "bytes": {k: v[1] for k, v in files.items()}}
            (job.tmp / META).write_text(json.dumps(body, indent=2) + "\n")
            problem = verify(job.tmp, digests=False)  # listing, sizes, nothing that runs code
            if problem:
                raise CheckpointError(f"checkpoint {job.final.name} not saved: {problem}")
            if job.final.exists():  # a previous attempt's checkpoint at the same step
                shutil.rmtree(job.final)
            os.replace(job.tmp, job.final)
        except OSError as err:
            shutil.rmtree(job.tmp, ignore_errors=True)  # never a checkpoint; frees the space
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(_failure(job, [{"rank": 0, "error": _one_line(err)}])) from None
        if self.keep_last:
            prune(self.root, self.keep_last, verified=job.final, protect=self.protect)


def _failure(job: _Job, failed: list[dict]) -> str:
    first = failed[0]
    prev = [p.name for p in list_steps(job.final.parent) if p != job.final]
    kept = f"previous checkpoint {prev[-1]} kept" if prev else "no previous checkpoint"
    return (f"checkpoint {job.final.name} not saved: rank {first['rank']}: {first['error']} "
            f"({len(failed)} of the ranks failed); {kept}")


def save(root: Path, step: int, write: Callable[[Path], Any], meta: dict[str, Any], rank: int = 0,
         world: int = 1) -> Path:
    """Write one checkpoint synchronously (every rank calls this); returns its folder."""
    Saver(root, rank, world).save(step, write, meta)
    return step_dir(root, step)


def verify(folder: Path, digests: bool = True) -> str | None:
    """None when the checkpoint is complete, holds exactly the files meta.json lists, every file
    matches its sha256 (its recorded size only, with digests=False: the check right after writing,
    when every writer has just hashed its own files) and nothing in it would run code when loaded
    (trust.check); else the problem."""
    folder = Path(folder)
    meta_path = folder / META
    try:
        meta = json.loads(meta_path.read_text())
        files, sizes = meta["files"], meta.get("bytes", {})
        assert isinstance(files, dict) and isinstance(sizes, dict)
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
        if name in sizes and p.stat().st_size != sizes[name]:
            return f"{p} has {p.stat().st_size} bytes, {META} says {sizes[name]} (partially written)"
        if digests and sha256_file(p) != digest:
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


def prune(root: Path, keep_last: int, verified: Path | None = None, protect: int | None = None) -> list[Path]:
    """Remove all but the newest `keep_last` checkpoints (only step-NNNNNN folders), and only when
    the newest verifies: `verified` names the one Saver just checked after writing it; any other
    newest is verified here in full. `protect`: also keep the newest checkpoint at or before that
    step (wsd's last stable-phase checkpoint, where a longer run branches off). Returns the folders
    removed (none when it refused)."""
    steps = list_steps(root)
    old = steps[:-keep_last]
    if protect is not None:
        stable = [p for p in steps if int(_STEP_RE.match(p.name).group(1)) <= protect]
        old = [p for p in old if not stable or p != stable[-1]]
    if not old:
        return []
    newest = steps[-1]
    if verified is None or Path(verified) != newest:
        problem = verify(newest)
        if problem:
            log.warning("retention: keeping %d older checkpoints, the newest does not verify (%s)",
                        len(old), problem)
            return []
    for folder in old:
        shutil.rmtree(folder, ignore_errors=True)
    return old


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / META).read_text())
