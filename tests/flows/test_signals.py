"""`llmpipe run` stopped by a signal mid-training: nothing it started keeps running (the Prefect
server included), Ctrl-C ends in one `error: interrupted` line with exit 130, SIGTERM in one
`error: terminated` line with exit 143, and the partial training folder stays for the next run to
resume from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.flows.test_pipeline import _write_config

pytestmark = pytest.mark.slow
LLMPIPE = str(Path(sys.executable).with_name("llmpipe"))


def _proc_stat(pid: int) -> tuple[int, str, str] | None:
    """(ppid, state, start time) of a live process from /proc; None when gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return None if fields[0] in "ZX" else (int(fields[1]), fields[0], fields[19])


def _descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every live process below `root`, whatever session or group it is in."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))):
            children.setdefault(st[0], []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if st := _proc_stat(pid):
                found.add((pid, st[2]))
                todo.append(pid)
    return found


def _still_running(tracked: set[tuple[int, str]], marker: str) -> list[str]:
    """Command lines of tracked processes still alive (same pid and start time) and of any process
    whose command line names the test's folder."""
    alive = [pid for pid, start in tracked if (st := _proc_stat(pid)) and st[2] == start]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in Path(entry, "cmdline").read_text() and _proc_stat(int(entry.name)):
                    alive.append(int(entry.name))
            except OSError:
                pass
    lines = []
    for pid in sorted(set(alive)):
        try:
            lines.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_text().replace(chr(0), ' ')}")
        except OSError:
            pass
    return lines


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A suite started in the background of a
    non-interactive shell (`pytest &`, nohup) ignores SIGINT, children inherit that, and Python then
    installs no KeyboardInterrupt handler: `llmpipe run` would rightly ignore the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_training(tmp_path: Path) -> tuple[subprocess.Popen, Path, set[tuple[int, str]], dict]:
    """`llmpipe run` (own session, own Prefect home, TMPDIR in tmp_path) on a run that trains far
    longer than the test waits; returns once a checkpoint is on disk, with every descendant seen."""
    config = _write_config(tmp_path)
    tree = yaml.safe_load(config.read_text())
    tree["train"].update(nproc_per_node=1, max_steps=1_000_000, checkpoint={"every_steps": 3, "keep_last": 2},
                         eval={"every_steps": 1_000_000, "batches": 1})
    config.write_text(yaml.safe_dump(tree))
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "TMPDIR": str(tmp_path / "tmp")}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_LOGGING_LEVEL", None)  # the default level, as a user has it
    proc = subprocess.Popen([LLMPIPE, "run", str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True, preexec_fn=_default_sigint)
    partial = tmp_path / "artifacts" / "flowtest" / ".02_train.partial"
    tracked: set[tuple[int, str]] = set()
    deadline = time.monotonic() + 300  # a guard against a hang, not a measurement
    while not (partial.joinpath("checkpoints").is_dir() and any(partial.joinpath("checkpoints").iterdir())):
        tracked |= _descendants(proc.pid)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"training never started: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    tracked |= _descendants(proc.pid)
    return proc, partial, tracked, env


def _wait_gone(tracked: set[tuple[int, str]], marker: str, grace_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + grace_s
    while (left := _still_running(tracked, marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_sigint_to_llmpipe_run_mid_training_prints_interrupted_exits_130_and_keeps_the_partial_folder(tmp_path):
    proc, partial, tracked, _ = _start_training(tmp_path)
    names = " ".join(Path(f"/proc/{pid}/cmdline").read_text() for pid, _ in tracked
                     if Path(f"/proc/{pid}/cmdline").exists())
    assert "uvicorn" in names and "torch.distributed.run" in names  # the server and training were up
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.splitlines()[-1] == "error: interrupted", stderr[-3000:]
    assert [ln for ln in stderr.splitlines() if ln.startswith("error:")] == ["error: interrupted"]
    assert "Traceback" not in stderr and "Error logging to API" not in stderr, stderr[-3000:]
    assert any(partial.joinpath("checkpoints").iterdir()) and partial.joinpath("metrics.jsonl").is_file()
    assert _wait_gone(tracked, str(tmp_path)) == []
    assert list((tmp_path / "tmp").glob("torchelastic_*")) == []  # torchrun's logs are in the stage folder
    assert any(partial.joinpath("torchrun-logs").iterdir())


def test_sigkill_of_llmpipe_run_mid_training_leaves_nothing_running(tmp_path):
    proc, _, tracked, _ = _start_training(tmp_path)
    assert len(tracked) >= 3  # the Prefect server, torchrun and its rank
    proc.kill()  # no handler, no atexit: only the kernel can clean up after it
    proc.communicate(timeout=60)
    assert _wait_gone(tracked, str(tmp_path)) == []


def test_sigterm_to_llmpipe_run_mid_training_prints_terminated_exits_143_and_stops_the_training(tmp_path):
    proc, partial, tracked, _ = _start_training(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)  # what `kill PID`, systemd or a container runtime sends
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.splitlines()[-1] == "error: terminated", stderr[-3000:]
    assert [ln for ln in stderr.splitlines() if ln.startswith("error:")] == ["error: terminated"]
    assert "Traceback" not in stderr and "Error logging to API" not in stderr, stderr[-3000:]
    assert any(partial.joinpath("checkpoints").iterdir()) and partial.joinpath("metrics.jsonl").is_file()
    assert _wait_gone(tracked, str(tmp_path)) == []
