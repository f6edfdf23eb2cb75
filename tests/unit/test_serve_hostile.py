"""Issue 36, the parts of serving that need no model: the held-back text of stop strings found in one pass
(equal to the per-prefix search it replaced), the API key file refused when it is not a regular UTF-8 file,
and `bench serve --url` against real misbehaving loopback servers (a line that never ends, a trickle)."""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import httpx
import pytest

from llmpipe.bench import serving
from llmpipe.config import ConfigError
from llmpipe.infer.stops import held_back
from llmpipe.tools.serve import read_key


def _held_by_every_prefix(text: str, stops: list[str]) -> int:
    """What ChatStreamer held back before issue 36: every prefix of every stop string tested (O(L^2))."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_the_held_back_suffix_found_in_one_pass_equals_every_prefix_tested():
    rng = random.Random(0)
    cases = [("Hello <|im", ["<|im_end|>"]), ("abab", ["ababc"]), ("aaaa", ["aaaaa", "ab"]), ("x", ["x"]),
             ("end\n\nUs", ["\n\nUser:", "###"]), ("", ["abc"]), ("abc", [])]
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 4))]
        cases.append(("".join(rng.choice("abc") for _ in range(rng.randint(0, 14))), stops))
    for text, stops in cases:
        assert held_back(text, stops) == _held_by_every_prefix(text, stops), (text, stops)


# --------------------------------------------------------------------------- the API key file


def test_an_api_key_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    (tmp_path / "key").write_bytes(b"sk-\xff\xfe-latin1")
    with pytest.raises(ConfigError) as err:
        read_key(str(tmp_path / "key"))
    assert str(err.value) == (f"--api-key-file {tmp_path / 'key'}: not UTF-8 text (byte 3); a key a client cannot "
                              "send would lock every client out")


def test_an_api_key_file_that_is_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "key")  # opening it to read would wait for a writer forever
    with pytest.raises(ConfigError) as err:
        read_key(str(tmp_path / "key"))
    assert str(err.value) == f"--api-key-file {tmp_path / 'key'}: not a regular file"


def test_an_api_key_file_that_is_a_folder_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        read_key(str(tmp_path))
    assert str(err.value) == f"--api-key-file {tmp_path}: not a regular file"


# --------------------------------------------------------------------------- bench serve --url vs a bad server


class _BadServer:
    """A real HTTP server on a loopback port that answers every request with `head`, then calls
    `body(send)` until the client goes away; counts the bytes it sent."""

    def __init__(self, head: bytes, body):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.head, self.body, self.sent = head, body, 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(self.head)
                while self.sent < 64 << 20:  # a bound for the test itself
                    self.sent += self.body(conn)
            except OSError:  # the client closed the connection: what a bounded client does
                pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=10)


SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: "


def _send(data: bytes, pause: float = 0.0):
    def body(conn) -> int:
        conn.sendall(data)
        time.sleep(pause)
        return len(data)
    return body


def test_bench_serve_refuses_a_streamed_line_that_never_ends_after_a_bounded_read():
    server = _BadServer(SSE, _send(b"a" * 65536))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            got = serving.one_request(http, "m", "p", 4)
    finally:
        server.close()
    assert got == {"error": f"a streamed line longer than {serving.MAX_LINE_BYTES} bytes"}
    assert server.sent < 8 * serving.MAX_LINE_BYTES  # what the socket buffers held besides, not gigabytes


def test_bench_serve_gives_up_on_a_server_that_trickles_at_the_requests_deadline():
    server = _BadServer(SSE, _send(b"a", pause=0.05))  # a byte every 50 ms: no read ever times out
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            got = serving.one_request(http, "m", "p", 4, deadline_s=0.5)
    finally:
        server.close()
    assert got == {"error": "the stream did not end before the request's deadline"}


def test_bench_serve_reads_only_the_start_of_an_error_body_that_never_ends():
    server = _BadServer(b"HTTP/1.1 500 Internal Server Error\r\nconnection: close\r\n\r\n", _send(b"e" * 65536))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            got = serving.one_request(http, "m", "p", 4)
    finally:
        server.close()
    assert got == {"error": "500: " + "e" * 200}
    assert server.sent < 8 * serving.MAX_LINE_BYTES
