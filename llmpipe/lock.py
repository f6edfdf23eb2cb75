"""One writer per run folder: artifacts/<run>/.lock, recognised as stale when its process is gone.

The lock file records pid, host and start time. A second run on the same folder is refused with a
message naming the holder; a lock left by a dead process on this host is taken over (logged).
The same process may re-enter (the flow holds it while its tasks run stages); the block learns
whether it took the lock or re-entered it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from llmpipe.errors import UserError

log = logging.getLogger("llmpipe.lock")

LOCK = ".lock"


class LockError(UserError, RuntimeError):
    """The run folder is in use by another live process."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: Path) -> dict | None:
    """The lock's record, or None when it is absent, being written, or not a lock record (a lock file
    is under 200 bytes: more, or anything but an object with an integer pid, is garbage)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(4096))
    except (OSError, ValueError, RecursionError):
        return None
    pid = data.get("pid") if isinstance(data, dict) else None
    if type(pid) is not int or pid <= 0:
        return None
    return data


def _try_create(path: Path, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    return True


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[bool]:
    """Hold artifacts/<run>/.lock for the duration of the block. Yields True when this call took the
    lock, False when this process already held it: only a taker knows that no other writer is at
    work in the folder (its own process included), so only a taker may clean up after dead ones."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for _ in range(3):
        if _try_create(path, me):
            break
        holder = _read(path)
        if holder and holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
            yield False  # re-entered by the process that holds it
            return
        if holder and holder.get("host") == me["host"] and not _alive(holder["pid"]):
            log.warning("removing stale lock %s (pid %s is gone)", path, holder.get("pid"))
            path.unlink(missing_ok=True)
            continue
        if holder is None:  # being written right now, or garbage: give it a moment
            time.sleep(0.2)
            if _read(path) is None:
                path.unlink(missing_ok=True)
            continue
        raise LockError(f"{run_dir} is in use by pid {holder.get('pid')} on {holder.get('host')} since "
                        f"{holder.get('started')}; wait for it, or remove {path} if that process is gone")
    else:
        raise LockError(f"could not take the lock {path}")
    try:
        yield True
    finally:
        if (_read(path) or {}).get("pid") == me["pid"]:
            path.unlink(missing_ok=True)
        if created and all(p.name == "logs" and p.is_dir() and not p.is_symlink() for p in run_dir.iterdir()):
            # nothing was produced (bad input, refused before any work; its one error line was printed): leave no
            # run folder behind, not even the stage log of that refusal
            shutil.rmtree(run_dir / "logs", ignore_errors=True)
            run_dir.rmdir()
