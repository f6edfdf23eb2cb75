"""The Prefect API server `llmpipe run` starts for itself when none is configured.

Prefect's own ephemeral server is a uvicorn subprocess in the caller's process group, stopped only
by an atexit hook: a SIGKILLed or SIGTERMed `llmpipe run` leaves it running under PID 1 for good,
and a Ctrl-C reaches it too, so it dies while the engine still reports the interrupted run's state
(minutes of connection retries). This one is the same uvicorn app, started by llmpipe as a child in
its own session (out of reach of the terminal's Ctrl-C) that the kernel kills when `llmpipe run`
dies, however it dies (PR_SET_PDEATHSIG), and that `llmpipe run` stops, group and all, when it ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import prefect
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

import flows  # noqa: F401  (sets Prefect defaults before prefect is imported)

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class ServerError(RuntimeError):
    """The local Prefect server did not come up."""


def _die_with_parent() -> None:
    """Between fork and exec: SIGKILL the server when the thread that started it dies. SQLite's
    journal makes a killed server safe; a graceful SIGTERM could hang and outlive the CLI."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_argv(port: int, python: str = sys.executable) -> list[str]:
    """uvicorn serving Prefect's API app on 127.0.0.1:port (what Prefect's ephemeral mode runs)."""
    return [python, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]


def _start(port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    with open(log_path, "ab") as log:
        return subprocess.Popen(server_argv(port), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True,
                                preexec_fn=_die_with_parent if _LIBC is not None else None)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> bool:
    """True once GET {url}/health answers 200; False when the process exited first (a port taken
    between choosing and binding it). Raises ServerError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return True
            time.sleep(0.1)
    stop(proc)
    raise ServerError(f"the local Prefect server did not answer on {url} within {timeout_s:.0f}s")


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after `grace_s`; the group, so nothing uvicorn
    may have started stays behind."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # any straggler left in the group


@contextlib.contextmanager
def prefect_api(timeout_s: float | None = None) -> Iterator[str | None]:
    """Point Prefect at a server for the body: the configured PREFECT_API_URL when there is one
    (yields it), else a local server started here and stopped on the way out (yields its URL)."""
    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    timeout_s = timeout_s or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    log_path = Path(get_current_settings().home) / "llmpipe-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        port = _free_port()
        proc, url = _start(port, log_path), f"http://127.0.0.1:{port}/api"
        try:
            if _wait_healthy(proc, url, timeout_s):
                break
        except BaseException:
            stop(proc)
            raise
    else:
        raise ServerError(f"the local Prefect server exited at start (exit code {proc.returncode}); "
                          f"see {log_path}")
    # NOTE: the environment too: processes started in the body (Dask workers running prepare_data's
    # units) read their settings from it, and would otherwise start ephemeral servers of their own.
    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _drain_to_server()
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous
        stop(proc)


def _drain_to_server(timeout_s: float = 10.0) -> None:
    """Send the log records and events still queued while the server is up. Prefect drains them
    only at interpreter exit, when this server is gone: its workers then retry for over a minute
    before giving up with "Error logging to API" on the terminal."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)
