"""An OpenAI-compatible endpoint under concurrent load, measured as a client sees it (`llmpipe bench serve`,
and the benchmark stage's short serving run).

A fixed, seeded set of prompts (windows of the run's validation text, decoded by its tokenizer) is sent
to POST /v1/completions, streamed (server-sent events, `stream_options.include_usage`), greedy, at each
concurrency C (C client threads, each sending its next request when its last one ended) or, with a
request rate R, at seeded Poisson arrival times (R per second on average, at most C in flight). The
endpoint is the run's own `llmpipe serve`, started on a free loopback port and stopped afterwards, or
any OpenAI-compatible server given by `--url` (its first model of GET /v1/models), so the same numbers
can be taken for another server. Definitions, as the offline benchmark's:

    TTFT             a request's send to its first streamed text chunk (ms; p50, p90, p99)
    TPOT             (last chunk - first chunk) / (completion tokens - 1), per request (ms; p50, p90, p99)
    output tokens/s  completion tokens of all requests (the usage the server reports) / wall time from
                     the first send to the last end
    requests/s       requests that completed / the same wall time

A request the server refuses (429 when its queue is full, any error status) is counted in `errors`,
not in the latencies; so is one whose streamed line grows past MAX_LINE_BYTES without a newline, or that
has not ended REQUEST_DEADLINE_S after it was sent (a server that never ends a line, or trickles bytes,
cannot hold the client's memory or time without bound).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.errors import ConfigError, UserError

log = logging.getLogger("llmpipe.serve")
MAX_LINE_BYTES = 1 << 20  # one server-sent event; a chunk of a completion is a few hundred bytes
REQUEST_DEADLINE_S = 600.0  # a whole streamed request, from its send to its last line

DEFINITIONS = ("TTFT: a request's send to its first streamed text chunk. TPOT: (last chunk - first chunk) / "
               "(completion tokens - 1), per request. Output tokens/s: completion tokens of all requests / wall "
               "time from the first send to the last end; requests/s likewise. Closed loop: each client sends its "
               "next request when its last one ended. A refused request counts in errors, not in the latencies.")

MAX_CONCURRENCY = 1024


class BenchServeError(UserError):
    """The endpoint could not be measured (it did not start, or refused every request)."""


@dataclass
class LoadResult:
    concurrency: int
    rate: float | None  # requests/s of the Poisson arrivals; None: closed loop (each client sends at once)
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float]  # p50, p90, p99
    tpot_ms: dict[str, float]


def parse_levels(text: str) -> list[int]:
    """--concurrency "1,4,8,16" -> [1, 4, 8, 16]; ConfigError naming the option otherwise."""
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        raise ConfigError(f"--concurrency {text!r}: a comma-separated list of integers, e.g. 1,4,8,16") from None
    if not levels or any(not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise ConfigError(f"--concurrency {text!r}: each between 1 and {MAX_CONCURRENCY}")
    return levels


def check_options(requests: int, prompt_tokens: int, max_tokens: int, rate: float | None) -> None:
    for opt, value, low, high in (("--requests", requests, 1, 100_000), ("--prompt-tokens", prompt_tokens, 1, 1 << 20),
                                  ("--max-tokens", max_tokens, 1, 1 << 20)):
        if not low <= value <= high:
            raise ConfigError(f"{opt} {value}: must be between {low} and {high}")
    if rate is not None and not (rate > 0 and np.isfinite(rate)):
        raise ConfigError(f"--rate {rate}: must be a positive number of requests per second")


def prompts_from_run(run_dir: Path, n: int, tokens: int, seed: int) -> list[str]:
    """`n` seeded windows of `tokens` tokens of the run's validation split, as text."""
    from llmpipe.data.shards import TokenShard
    from llmpipe.data.tokenizer import load_tokenizer
    from llmpipe.stages import stage_dir

    data = stage_dir(run_dir, "prepare_data")
    try:
        shard = TokenShard(data / "val.bin")
        tok = load_tokenizer(data / "tokenizer.json")
    except (OSError, ValueError) as err:
        raise BenchServeError(f"{data}: no validation text to take prompts from ({err})") from None
    if len(shard) <= tokens:
        raise ConfigError(f"--prompt-tokens {tokens}: the validation split holds {len(shard)} tokens")
    starts = np.random.default_rng(seed).integers(0, len(shard) - tokens, n)
    return [tok.decode([int(t) for t in shard.tokens[s:s + tokens]]) for s in starts]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`llmpipe serve RUN` in a process of its own on a free loopback port: up once GET /health says
    ready (the model loaded), stopped by SIGTERM (it drains) on exit."""

    def __init__(self, run_dir: Path, variant: str, max_batch: int, log_path: Path, extra: list[str] = ()):
        self.run_dir, self.variant, self.max_batch, self.log_path = run_dir, variant, max_batch, log_path
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> LocalServer:

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "llmpipe", "serve", str(self.run_dir), "--variant", self.variant,
                "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(self.max_batch),
                "--max-queue", str(MAX_CONCURRENCY), *self.extra]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            return self._wait_ready()
        except BaseException:  # not ready (it died, a Ctrl-C): nothing started here outlives the caller
            self.__exit__()
            raise

    def _wait_ready(self) -> LocalServer:
        import httpx

        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise BenchServeError(f"llmpipe serve exited with {self.proc.returncode} before it was ready: "
                                      f"{tail[0]} (log: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _client(url: str, api_key: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url, timeout=600, headers=headers)


def first_model(url: str, api_key: str | None) -> str:
    """The first model GET /v1/models lists (what a request names)."""
    import httpx

    try:
        with _client(url, api_key) as http:
            r = http.get("/v1/models")
    except httpx.HTTPError as err:
        raise BenchServeError(f"--url {url}: {err}") from None
    if r.status_code != 200:
        raise BenchServeError(f"--url {url}: GET /v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchServeError(f"--url {url}: GET /v1/models lists no model") from None


class _StreamError(Exception):
    pass


def _lines(r, deadline: float, max_bytes: int = MAX_LINE_BYTES):
    """The lines of a streamed response, each at most `max_bytes`, all before `deadline` (perf_counter);
    _StreamError beyond either."""
    pending = bytearray()  # the line not ended yet; each chunk is searched once
    for chunk in r.iter_bytes():
        if time.perf_counter() > deadline:
            raise _StreamError("the stream did not end before the request's deadline")
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending += chunk[start:end]
            yield bytes(pending).rstrip(b"\r").decode("utf-8", "replace")
            pending.clear()
            start = end + 1
        pending += chunk[start:]
        if len(pending) > max_bytes:
            raise _StreamError(f"a streamed line longer than {max_bytes} bytes")
    if pending:
        yield bytes(pending).decode("utf-8", "replace")


def one_request(http, model: str, prompt: str, max_tokens: int,
                deadline_s: float = REQUEST_DEADLINE_S) -> dict[str, Any]:
    """One streamed completion: its TTFT, TPOT and completion tokens (seconds), or its error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"{r.status_code}: {_start(r)}"}
            first, last, tokens = _read_stream(_lines(r, t0 + deadline_s))
    except _StreamError as err:
        return {"error": str(err)}
    end = time.perf_counter()
    first, last = first or end, last or end
    return {"ttft": first - t0, "tpot": (last - first) / max(tokens - 1, 1), "tokens": tokens, "error": None}


def _start(r, limit: int = 200) -> str:
    """The first `limit` characters of an error's body (the rest is not read: it may never end)."""
    head = bytearray()
    for chunk in r.iter_bytes():
        head += chunk
        if len(head) >= 4 * limit:
            break
    return head.decode("utf-8", "replace")[:limit]


def _read_stream(lines) -> tuple[float | None, float | None, int]:
    """(first text chunk's time, last one's, completion tokens the usage reports) of a completion's SSE lines."""
    first = last = None
    tokens = 0
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            last = time.perf_counter()
            first = first or last
    return first, last, tokens


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {f"p{q}": float(np.percentile(values, q)) * 1e3 for q in (50, 90, 99)}


def run_load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
             rate: float | None = None, seed: int = 0, api_key: str | None = None) -> LoadResult:
    """Every prompt once at this concurrency (or at `rate` requests/s, at most `concurrency` in flight)."""
    todo = list(prompts)
    arrivals = None
    if rate is not None:  # seeded Poisson arrivals, relative to the first send
        arrivals = list(np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))))
    lock, results = threading.Lock(), []
    t0 = time.perf_counter()

    def worker() -> None:
        with _client(url, api_key) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop(0)
                    due = arrivals.pop(0) if arrivals is not None else 0.0
                wait = t0 + due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                try:
                    r = one_request(http, model, prompt, max_tokens)
                except Exception as err:  # a dropped connection is a failed request, not a failed benchmark
                    r = {"error": f"{type(err).__name__}: {err}"}
                with lock:
                    results.append(r)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    return LoadResult(concurrency, rate, len(results), len(results) - len(ok), wall, len(ok) / wall,
                      sum(r["tokens"] for r in ok) / wall, _percentiles([r["ttft"] for r in ok]),
                      _percentiles([r["tpot"] for r in ok if r["tokens"] > 1]))


def table(rows: list[LoadResult]) -> str:
    lines = ["| concurrency | rate | requests (errors) | requests/s | output tokens/s | TTFT p50 / p90 / p99 ms | "
             "TPOT p50 / p90 / p99 ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t, p = r.ttft_ms, r.tpot_ms
        lines.append(f"| {r.concurrency} | {'-' if r.rate is None else f'{r.rate:g}/s'} | {r.requests} ({r.errors}) | "
                     f"{r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | {t['p50']:.1f} / {t['p90']:.1f} / "
                     f"{t['p99']:.1f} | {p['p50']:.2f} / {p['p90']:.2f} / {p['p99']:.2f} |")
    return "\n".join(lines)


def measure(url: str, model: str, prompts: list[str], levels: list[int], max_tokens: int,
            rate: float | None = None, seed: int = 0, api_key: str | None = None,
            progress=lambda text: None) -> list[LoadResult]:
    """A warm-up request, then run_load at each concurrency; BenchServeError when nothing succeeded."""
    with _client(url, api_key) as http:
        warm = one_request(http, model, prompts[0], min(4, max_tokens))
    if warm["error"]:
        raise BenchServeError(f"{url}: the warm-up request failed: {warm['error']}")
    rows = []
    for c in levels:
        rows.append(run_load(url, model, prompts, c, max_tokens, rate, seed, api_key))
        r = rows[-1]
        progress(f"concurrency {c}: {r.output_tokens_per_s:.1f} output tokens/s, TTFT p50 {r.ttft_ms['p50']:.1f} ms, "
                 f"{r.errors} errors")
    if all(r.errors == r.requests for r in rows):
        raise BenchServeError(f"{url}: every request failed")
    return rows
