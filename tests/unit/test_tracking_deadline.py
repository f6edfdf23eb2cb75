"""A tracking server that trickles its answer never hangs a stage or `llmpipe runs` (issue 36 item 7), and a
command that only reads never creates a store (item 18). The server is a real loopback TCP server that
answers every request with one header byte every 2 s, so no single read ever times out."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from llmpipe import tracking
from llmpipe.cli import main
from tests.conftest import make_cfg


@pytest.fixture
def trickling():
    """http://127.0.0.1:PORT of a server that sends a status line, then a byte of a header every 2 s."""
    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not stop.wait(2.0):
                try:
                    conn.sendall(b"a")
                except OSError:
                    return

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        time.sleep(0.6)  # the accept loop sees it
        server.close()


def test_a_trickling_server_costs_a_stage_s_sync_one_warning_line_at_its_deadline(tmp_path, trickling, caplog):
    cfg = make_cfg(tmp_path, check="fields", tracking={"mlflow": {
        "enabled": True, "tracking_uri": trickling, "timeout_s": 5, "retries": 0, "deadline_s": 3}})
    cfg.run_dir().mkdir(parents=True)
    caplog.set_level(logging.WARNING, "llmpipe.tracking")
    tracking.after_stage(cfg)
    assert [r.getMessage() for r in caplog.records if r.name == "llmpipe.tracking"] == [
        f"tracking: MLflow at {trickling} failed: no complete answer within 3 s (tracking.mlflow.deadline_s); the "
        "run goes on, and the next stage's sync (or `llmpipe track t`) logs what is missing"]
    assert not (cfg.run_dir() / "mlflow.json").exists()  # the abandoned sync wrote nothing


def test_llmpipe_runs_against_a_trickling_server_is_one_line_at_its_deadline(trickling, capsys):
    assert main(["runs", "--tracking-uri", trickling, "--deadline-s", "3"]) == 1
    assert capsys.readouterr().err == f"error: MLflow at {trickling} failed: no complete answer within 3 s\n"


def test_llmpipe_runs_on_a_database_that_does_not_exist_says_so_and_creates_none(tmp_path, capsys):
    db = tmp_path / "new" / "path" / "mlflow.db"
    assert main(["runs", "--tracking-uri", f"sqlite:///{db}"]) == 1
    assert capsys.readouterr().err == f"error: sqlite:///{db}: no MLflow database there ({db} does not exist)\n"
    assert not (tmp_path / "new").exists()
