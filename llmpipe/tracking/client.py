"""The MLflow client of a run: where its store is, and the few settings every request takes.

mlflow is imported here, lazily, on first use: importing it costs seconds, and a run with tracking off
never pays for it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from llmpipe.errors import UserError

DB_FILE = "mlflow.db"  # the default store, under the artifacts folder
ARTIFACT_FOLDER = "mlartifacts"  # beside it: what a local store's runs and model versions upload


class TrackingError(UserError):
    """A tracking or registry request that cannot be done as asked (one line)."""


def default_uri(artifacts_dir: str | Path) -> str:
    return f"sqlite:///{Path(artifacts_dir).resolve() / DB_FILE}"


def resolve_uri(uri: str | None, artifacts_dir: str | Path) -> str:
    """The tracking URI a run logs to: the configured one, else the SQLite file under the artifacts folder."""
    return uri or default_uri(artifacts_dir)


def is_local(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file", "sqlite")


def artifact_location(uri: str, artifacts_dir: str | Path) -> str | None:
    """Where a new experiment keeps its artifacts: beside a local store (MLflow's own default is ./mlruns
    under the working directory, wherever the command happens to run); a server decides for itself."""
    if not is_local(uri):
        return None
    return (Path(artifacts_dir).resolve() / ARTIFACT_FOLDER).as_uri()


def client(uri: str, timeout_s: float = 10.0, retries: int = 1) -> Any:
    """An MlflowClient for `uri` (tracking and registry alike). MLflow reads its HTTP timeout and retries
    from the environment at each request; its defaults (120 s, 7 retries with backoff) would stall a stage
    for minutes on a server that is down, so llmpipe sets its own unless the user set them."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, timeout_s))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(retries))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    # MLflow prints "View run ... at: URL" to stdout whenever a run against a server ends; the flow run's
    # artifact links it already, and stdout is the command's own
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


_UNREACHABLE = re.compile(r"Max retries exceeded|Failed to establish a new connection|Connection(Error| refused)|"
                          r"Read timed out|RemoteDisconnected")
_ERRNO = re.compile(r"\[Errno -?\d+\] [^'\")]+|Read timed out|RemoteDisconnected")


def short(err: BaseException) -> str:
    """One line of an MLflow or connection error (their messages run to pages of HTML or tracebacks)."""
    text = " ".join(str(err).split()) or type(err).__name__
    if _UNREACHABLE.search(text):
        cause = _ERRNO.search(text)
        return f"cannot be reached ({cause.group(0).strip() if cause else 'connection failed'})"
    return text if len(text) <= 300 else text[:297] + "..."


@contextmanager
def quiet():
    """urllib3 logs each retry of a lost connection and alembic each migration step of a new SQLite store;
    a tracking failure is one line, and a first sync prints nothing."""
    names = ("urllib3.connectionpool", "alembic", "mlflow.store.db.utils", "mlflow.store.model_registry.abstract_store")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def within(deadline_s: float, uri: str, fn: Callable[[threading.Event], Any]) -> Any:
    """fn(cancelled) in a daemon thread, waited for at most `deadline_s`: a server that trickles a byte at a
    time never trips the per-read timeout, so a whole sync (or `llmpipe runs`) gets one deadline. Past it,
    TrackingError (one line) and `cancelled` is set: fn must then write nothing more (the thread, blocked on
    its socket, is left to end with the process)."""
    import mlflow  # noqa: F401  imported first: seconds of import are not the server's time

    done: dict[str, Any] = {}
    cancelled = threading.Event()

    def target() -> None:
        try:
            done["value"] = fn(cancelled)
        except BaseException as err:  # noqa: BLE001  handed to the caller
            done["error"] = err

    worker = threading.Thread(target=target, name="llmpipe-tracking", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        cancelled.set()
        raise TrackingError(f"MLflow at {uri} failed: no complete answer within {deadline_s:g} s")
    if "error" in done:
        raise done["error"]
    return done.get("value")


def missing_store(uri: str) -> str | None:
    """For a command that only reads (`llmpipe runs`, promote, models:/...): why a local store named by `uri`
    does not exist (MLflow would create an empty database or folder there), or None."""
    from urllib.parse import unquote

    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = unquote(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:" and not Path(path).is_file():
            return f"{uri}: no MLflow database there ({path} does not exist)"
    elif parsed.scheme in ("", "file"):
        path = unquote(parsed.path) if parsed.scheme == "file" else uri
        if not Path(path).is_dir():
            return f"{uri}: no MLflow store there ({path} is not a folder)"
    return None
