"""`llmpipe serve RUN`: an OpenAI-compatible endpoint over exactly the artifact that passed its gates.

Before anything listens: the options are checked, the variant's files are verified against their
stages' manifests and its graphs against the decoder's contract (llmpipe.tools.generate.open_run), the
chat template against training's digest (run_template), and the benchmark stage must have completed
(its files verified) with the variant measured by its quality gate and not rejected, nor rejected by the
evaluate stage's gates where that stage has run, and both verdicts must be about the model in the folder now
(llmpipe.verdicts: not stale); otherwise one
`error:` line (--allow-ungated serves anyway, and says so in the log). The routes are in app.py, the
decode loop (continuous batching over the static decoder's rows, or the ORT-optimised graph's where the run
has one: llmpipe.infer.batching) in scheduler.py.

SIGTERM (or Ctrl-C) drains: new requests get 503, the ones in flight finish (at most --drain-timeout
seconds, then they are cut), the process exits 0.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

from llmpipe.config import ConfigError
from llmpipe.errors import UserError

log = logging.getLogger(__name__)
MAX_KEY_BYTES = 4096


class ServeError(UserError):
    """A run that may not be served (gates, files), or a key file that cannot be used."""


def gate_problem(run_dir: Path, variant: str) -> str | None:
    """Why `variant` of the run has not passed its gates for the model in the folder now, or None
    (llmpipe.verdicts: a verdict about an earlier model is stale)."""
    from llmpipe.verdicts import variant_problem

    return variant_problem(run_dir, variant)


def read_key(path: str) -> str:
    """The key in `path`: a regular file (a FIFO or a device would block the start or never end) of UTF-8 text
    holding one key; ConfigError (one line) otherwise."""
    try:
        # NOTE: O_NONBLOCK: opening a FIFO for reading would wait for a writer; the fstat below refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise ConfigError(f"--api-key-file {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"--api-key-file {path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_KEY_BYTES + 1)  # at most one byte past the limit, whatever the file holds
    try:
        key = raw.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise ConfigError(f"--api-key-file {path}: not UTF-8 text (byte {err.start}); a key a client cannot "
                          "send would lock every client out") from None
    if len(raw) > MAX_KEY_BYTES or not key or any(c.isspace() for c in key):
        raise ConfigError(f"--api-key-file {path}: must hold one key (no spaces, at most {MAX_KEY_BYTES} bytes)")
    return key


def check_options(host: str, port: int, max_batch: int, max_queue: int, drain_timeout: float,
                  body_timeout: float = 10.0) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: must be between 0 and 65535")
    if not 1 <= max_batch <= 256:
        raise ConfigError(f"--max-batch {max_batch}: must be between 1 and 256")
    if not 0 <= max_queue <= 100_000:
        raise ConfigError(f"--max-queue {max_queue}: must be between 0 and 100000")
    if not 0 <= drain_timeout <= 3600:
        raise ConfigError(f"--drain-timeout {drain_timeout:g}: must be between 0 and 3600 seconds")
    if not 0.1 <= body_timeout <= 600:
        raise ConfigError(f"--body-timeout {body_timeout:g}: must be between 0.1 and 600 seconds")
    if not host:
        raise ConfigError("--host: empty")


def latest_passing(artifacts_dir: Path, variant: str) -> Path:
    """The run under `artifacts_dir` whose benchmark finished last with `variant` through its gates (what a
    deployment that always serves the newest good model serves); ServeError when none has."""
    from llmpipe.manifest import Manifest, ManifestError
    from llmpipe.stages import stage_dir

    root = Path(artifacts_dir)
    if not root.is_dir():
        raise ServeError(f"--artifacts-dir {root}: not a folder")
    best: tuple[str, str, Path] | None = None
    for run in sorted(root.iterdir()):
        if run.is_symlink() or not run.is_dir() or run.name.startswith("."):  # a link may lead anywhere
            continue
        try:
            manifest = Manifest.read(stage_dir(run, "benchmark"))
        except (ManifestError, OSError):
            continue
        if manifest is None or gate_problem(run, variant) is not None:
            continue
        if best is None or (manifest.finished_at, run.name) > best[:2]:
            best = (manifest.finished_at, run.name, run)
    if best is None:
        raise ServeError(f"--latest-passing: no run under {root} has a completed benchmark that {variant} passed")
    return best[2]


def _slots(loaded, max_batch: int):
    from llmpipe.infer.batching import EngineSlots, FusedSlots, SlotBatch
    from llmpipe.infer.decode import StaticEngine, TorchEngine
    from llmpipe.infer.fused import FusedEngine

    if isinstance(loaded.engine, FusedEngine):
        return FusedSlots(loaded.engine, max_batch), "continuous batching over the ORT-optimised graph's rows"

    if isinstance(loaded.engine, StaticEngine):
        batch = SlotBatch(loaded.engine, max_batch)
        if loaded.engine.batch is not None:
            return batch, (f"continuous batching over the {loaded.engine.batch} rows the decoder was compiled for "
                           "(convert_om.decode_batch), all run each step")
        return batch, "continuous batching over the static decoder's rows"
    model = loaded.engine.model
    return (EngineSlots(lambda: TorchEngine(model, loaded.engine.dev), max_batch, loaded.engine.capacity),
            "one PyTorch engine per slot, stepped in turn (no batched step)")


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of any token's string in the vocabulary (special tokens included): a byte-level
    token's string spends at least one character per byte, a SentencePiece one more (`<0x41>`, `▁`), so a
    token never stands for more bytes of text than this."""
    return max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def connection_limit(max_batch: int, max_queue: int) -> int:
    """uvicorn's limit_concurrency: connections (and tasks) beyond it get 503 at once. Room for every request
    that may decode or wait, plus health checks, scrapes and those refused with 429."""
    return max_batch + max_queue + 32


def check_listen(host: str, port: int) -> None:
    """One line, before any model loads, when `host:port` cannot be listened on (a port in use, a host that
    does not resolve or is not this machine's), instead of uvicorn's error after the load."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ServeError(f"--host {host}: cannot be resolved ({err.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as err:
            raise ServeError(f"--port {port}: cannot listen on {host}:{port} ({err.strerror})") from None


def run_serve(run_dir: Path, run_name: str, variant: str, host: str, port: int, max_batch: int, max_queue: int,
              api_key_file: str | None, allow_ungated: bool, threads: int | None = None,
              drain_timeout: float = 30.0, body_timeout: float = 10.0) -> int:
    import uvicorn

    from llmpipe.tools.generate import chat_stops, open_run, run_template
    from llmpipe.tools.serve.app import Metrics, Served, build_app
    from llmpipe.tools.serve.scheduler import Scheduler

    check_options(host, port, max_batch, max_queue, drain_timeout, body_timeout)
    key = read_key(api_key_file) if api_key_file else None
    check_listen(host, port)
    problem = gate_problem(run_dir, variant)
    if problem and not allow_ungated:
        raise ServeError(f"{problem}; refusing to serve it (--allow-ungated to serve anyway)")
    if key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serve: listening on %s without an API key (--api-key-file): anyone who reaches it may use it",
                    host)
    if problem:
        log.warning("serve: serving UNGATED (--allow-ungated): %s", problem)
    template = run_template(run_dir, variant)
    loaded = open_run(run_dir, variant, threads)  # the variant's ORT-optimised graph when the run has one
    slots, how = _slots(loaded, max_batch)
    stop_ids, stop_strings = chat_stops(loaded, template) if template is not None else ([], [])
    metrics = Metrics()
    scheduler = Scheduler(slots, loaded.tokenizer, max_queue, metrics)
    served = Served(f"{run_name}/{variant}", loaded.tokenizer, loaded.engine.capacity, loaded.eos_ids, template,
                    stop_ids, stop_strings, scheduler, metrics, key, created=int(time.time()),
                    max_token_bytes=max_token_bytes(loaded.tokenizer), body_timeout=body_timeout)
    app = build_app(served)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
                            lifespan="off", server_header=False, timeout_keep_alive=5,
                            limit_concurrency=connection_limit(max_batch, max_queue))
    server = _DrainingServer(config, served, drain_timeout)
    scheduler.start()
    log.info("serve: %s (%s; %s), up to %d at once, %d waiting%s", served.name, loaded.describe, how,
             slots.slots, max_queue, ", API key required" if key else "")
    try:
        server.run()
    finally:
        scheduler.stop()
    return 0


class _DrainingServer:
    """uvicorn's Server whose first SIGTERM/SIGINT drains (503 to new requests, in-flight ones finish
    within the timeout) before it stops; a second one stops at once."""

    def __new__(cls, config, served, timeout: float):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # NOTE: not recorded, so uvicorn does not re-raise it at exit
                if served.draining:
                    self.should_exit = self.force_exit = True
                    return
                served.draining = True
                log.info("serve: signal %d: draining (%d requests in flight, at most %gs)",
                         sig, served.scheduler.busy(), timeout)
                threading.Thread(target=self._drain, daemon=True).start()

            def _drain(self):
                deadline = time.monotonic() + timeout
                while served.scheduler.busy() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if served.scheduler.busy():
                    log.warning("serve: drain timeout: cutting %d requests", served.scheduler.busy())
                self.should_exit = True

        return Server(config)
