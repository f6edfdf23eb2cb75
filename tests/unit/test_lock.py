"""The run-folder lock: exclusive across processes, re-entrant in one, stale locks recognised."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from llmpipe.lock import LOCK, LockError, run_lock


def test_second_process_is_refused_with_the_holder_named(tmp_path):
    run = tmp_path / "run"
    with run_lock(run):
        with run_lock(run):  # the same process may re-enter
            pass
        assert (run / LOCK).exists()
        code = ("import sys; from llmpipe.lock import run_lock, LockError\n"
                f"try:\n    run_lock({str(run)!r}).__enter__()\nexcept LockError as e:\n"
                "    print(e); sys.exit(3)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 3
        assert f"is in use by pid {os.getpid()}" in out.stdout
    assert not (run / LOCK).exists()


def test_stale_lock_from_a_dead_process_is_taken_over(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "started": "x"}))
    with run_lock(run):
        assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    assert "stale lock" in caplog.text


def test_lock_held_on_another_host_is_respected(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x"}))
    with pytest.raises(LockError, match="in use by pid 1 on elsewhere"):
        with run_lock(run):
            pass


def test_an_unused_new_run_folder_is_not_left_behind(tmp_path):
    with run_lock(tmp_path / "new"):
        pass
    assert not (tmp_path / "new").exists()
