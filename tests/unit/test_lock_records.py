"""A lock file that is not a lock record (damaged, planted, absurdly nested) is garbage: taken over,
never a traceback; and the block learns whether it took the lock or re-entered it."""

from __future__ import annotations

import json
import os
import socket

import pytest

from llmpipe.lock import LOCK, run_lock


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,
                                  json.dumps({"pid": "12x", "host": socket.gethostname()}),
                                  json.dumps([1, 2]), json.dumps({"pid": 0, "host": socket.gethostname()})])
def test_a_lock_file_that_is_not_a_lock_record_is_taken_over(tmp_path, text):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(text)
    with run_lock(run) as taken:
        assert taken and json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    assert not (run / LOCK).exists()


def test_the_block_learns_whether_it_took_the_lock_or_re_entered_it(tmp_path):
    with run_lock(tmp_path / "run") as outer:
        with run_lock(tmp_path / "run") as inner:
            assert (outer, inner) == (True, False)
