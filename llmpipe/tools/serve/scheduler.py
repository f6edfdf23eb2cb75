"""The decode loop of `llmpipe serve`: one thread owns the model and runs iteration-level scheduling.

Each iteration: admit the waiting requests that fit the free slots (one prompt pass for all of them,
so newcomers stall the running ones for no longer than that), then one decode step for every active
request together, then each request picks its own next token (its own temperature, top_p and seeded
generator), streams what is new of its text, and leaves the batch when it is done, cancelled (its
client went away) or out of room. Requests wait in a bounded queue; `submit` refuses beyond it (the
server answers 429).

Text goes out through the same ChatStreamer `llmpipe generate --chat` uses: stop ids are not shown,
text stops before a stop string, and text that may still become one is held back until it is known.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from llmpipe.infer.decode import pick_tokens
from llmpipe.tools.generate import ChatStreamer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


class _Out:
    """ChatStreamer's `out`: each piece of text goes to the request's asyncio queue."""

    def __init__(self, req: Job):
        self.req = req

    def write(self, text: str) -> None:
        if text:
            self.req.emit(("text", text))

    def flush(self) -> None:
        pass


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    seed: int | None
    stop_ids: list[int]
    stop_strings: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    tokens: int = 0
    finish_reason: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop closed: nobody listens any more
            pass

    def cancel(self) -> None:
        self.cancelled = True


class _Active:
    """A request in the batch: its sampler and its text so far."""

    def __init__(self, req: Job, tokenizer):
        self.req = req
        self.rng = np.random.default_rng(req.seed)
        self.stream = ChatStreamer(tokenizer, _Out(req), req.stop_ids, req.stop_strings)
        self.last = 0

    def pick(self, logits: np.ndarray) -> int:
        r = self.req
        return int(pick_tokens(logits[None], temperature=r.temperature, top_p=r.top_p, rng=self.rng)[0])

    def take(self, token: int) -> bool:
        """Record `token`; True when the request is done."""
        r = self.req
        r.tokens += 1
        self.last = token
        self.stream(np.array([token]))
        if self.stream.done:
            r.finish_reason = "stop"
        elif r.tokens >= r.max_tokens:
            r.finish_reason = "length"
        return r.finish_reason is not None


class Scheduler:
    """Owns `slots` (llmpipe.infer.batching.SlotBatch or EngineSlots) in one thread."""

    def __init__(self, slots, tokenizer, max_queue: int, metrics):
        self.slots, self.tokenizer, self.max_queue, self.metrics = slots, tokenizer, max_queue, metrics
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[_Active] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="llmpipe-serve-decode", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10)

    def submit(self, req: Job) -> None:
        with self.cond:
            # free slots take newcomers at the next step; beyond them, max_queue may wait
            if len(self.waiting) >= self.max_queue + max(0, self.slots.free()):
                raise QueueFull
            self.waiting.append(req)
            self.metrics.queue.set(len(self.waiting))
            self.cond.notify()

    def busy(self) -> int:
        """Requests admitted or waiting."""
        with self.cond:
            return len(self.waiting) + len(self.active)

    def _next(self) -> list[Job]:
        """The waiting requests that fit the free slots (admitted together); blocks while there is
        nothing to do."""
        with self.cond:
            while not self.stopping and not self.active and not self.waiting:
                self.cond.wait()
            new = []
            while self.waiting and len(new) < self.slots.free():
                req = self.waiting.popleft()
                if req.cancelled:
                    self._finish_unadmitted(req)
                else:
                    new.append(req)
            self.metrics.queue.set(len(self.waiting))
            return new

    def _finish_unadmitted(self, req: Job) -> None:
        req.finish_reason = "cancelled"
        req.emit(("done", None))

    def _loop(self) -> None:
        while not self.stopping:
            try:
                self._iteration()
            except Exception as err:  # a bug or a runtime failure: end every request with it, keep serving
                log.exception("serve: decode step failed")
                for a in self.active:
                    a.req.finish_reason = "error"
                    a.req.emit(("error", f"{type(err).__name__}: {err}"))
                while self.slots.n:
                    self.slots.release(self.slots.n - 1)
                self.active = []

    def _iteration(self) -> None:
        reqs = self._next()
        if reqs:
            try:
                logits = self.slots.admit([r.ids for r in reqs])  # one prompt pass for all newcomers
            except Exception as err:  # e.g. a prompt longer than an OM prefill's largest gear
                for r in reqs:
                    r.finish_reason = "error"
                    r.emit(("error", str(err)))
                return
            new = [_Active(r, self.tokenizer) for r in reqs]
            self.active += new
            now = time.perf_counter()
            for r in reqs:
                r.first_token = now
                self.metrics.ttft.observe(now - r.submitted)
                self.metrics.tokens_in.inc(len(r.ids))
            self._after(new, [a.pick(row) for a, row in zip(new, logits)])
        if not self.active:
            return
        running = list(self.active)
        logits = self.slots.step(np.array([a.last for a in running], np.int64))  # (n, vocab)
        self.metrics.batch.set(len(running))
        self._after(running, [a.pick(row) for a, row in zip(running, logits)])

    def _after(self, running: list[_Active], tokens: list[int]) -> None:
        """Record each request's token; release the finished and the cancelled."""
        for a, token in zip(running, tokens):
            if a.req.cancelled:
                a.req.finish_reason = "cancelled"
            else:
                a.take(token)
                self.metrics.tokens_out.inc()
        for a in [a for a in running if a.req.finish_reason is not None]:
            self._release(a)
        # a request cancelled before its token was taken above is also released here
        for a in [a for a in self.active if a.req.cancelled and a.req.finish_reason is None]:
            a.req.finish_reason = "cancelled"
            self._release(a)
        self.metrics.batch.set(len(self.active))

    def _release(self, a: _Active) -> None:
        row = self.active.index(a)
        moved = self.slots.release(row)
        last = self.active.pop()
        if moved is not None:
            self.active[row] = last
        r = a.req
        if r.finish_reason != "cancelled":
            a.stream.finish()  # what was held back for a stop string that never came
            if r.tokens > 1 and r.first_token is not None:
                self.metrics.tpot.observe((time.perf_counter() - r.first_token) / (r.tokens - 1))
        r.emit(("done", r.finish_reason))
