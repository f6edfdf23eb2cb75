"""The routes of `llmpipe serve`, following OpenAI's API: GET /v1/models, POST /v1/completions and
/v1/chat/completions (streamed as server-sent events with `stream: true`, ending `data: [DONE]`),
GET /health (200 once the model is loaded) and GET /metrics (Prometheus' text format).

Every request body is untrusted: read up to MAX_BODY_BYTES within --body-timeout, parsed as JSON, checked
field by field (a lone surrogate in a text, a stop string longer than MAX_STOP_CHARS, a field of OpenAI's
API this server cannot honour such as `logprobs` or `echo`: each refused naming the field); anything wrong
is a 4xx with OpenAI's error object naming the field, never a 500 or a traceback. A prompt whose UTF-8
length cannot fit the context is refused before it is tokenized, and parsing, rendering and tokenizing
run in a worker thread, so one large request never holds up the event loop (/health, other clients).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from llmpipe.errors import UserError
from llmpipe.tools.serve.scheduler import Job, QueueFull

MAX_BODY_BYTES = 1 << 20  # a prompt of a 32k-token context is ~150 KB of text
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # each stop string; the streamer holds back at most this much text
# NOTE: a token stands for at most `max_token_bytes` bytes of normalized text, and a normalizer shrinks a
# character to no fewer than a quarter of its bytes (full-width forms, ligatures): beyond this factor a
# prompt cannot fit the context, whatever the tokenizer makes of it.
NORMALIZER_SHRINK = 4
# Fields of OpenAI's API the server cannot honour: refused unless they hold the value that asks for nothing.
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "n": (None, 1),
}
DISCONNECT_POLL_S = 0.25


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("llmpipe_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.tokens_in = Counter("llmpipe_prompt_tokens", "prompt tokens admitted", registry=r)
        self.tokens_out = Counter("llmpipe_completion_tokens", "tokens generated", registry=r)
        buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("llmpipe_time_to_first_token_seconds", "from the request queued to its first token",
                              buckets=buckets, registry=r)
        self.tpot = Histogram("llmpipe_time_per_output_token_seconds", "mean time of each token after the first",
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1), registry=r)
        self.batch = Gauge("llmpipe_batch_size", "requests in the running decode batch", registry=r)
        self.queue = Gauge("llmpipe_queue_length", "requests waiting for a slot", registry=r)


@dataclass
class Served:
    """What the app serves: one run's variant, loaded."""

    name: str  # "<run>/<variant>"
    tokenizer: object
    capacity: int
    eos_ids: list[int]
    template: object | None  # llmpipe.tools.generate.RunTemplate of a chat run
    chat_stop_ids: list[int]
    chat_stop_strings: list[str]
    scheduler: object  # llmpipe.tools.serve.scheduler.Scheduler
    metrics: Metrics
    api_key: str | None = None
    draining: bool = False
    max_token_bytes: int = 64  # the most UTF-8 bytes one token's text holds (set from the tokenizer's vocabulary)
    body_timeout: float = 10.0  # seconds a body may take to arrive (a client trickling bytes holds a connection)
    created: int = 0


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    n: Literal[1] = 1


class CompletionBody(_Body):
    prompt: str
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


async def _read_body(request: Request, timeout: float) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
    return bytes(body)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"the body is not valid JSON ({str(err)[:80]})") from None


def _same(value: Any, nothing: Any) -> bool:
    # NOTE: a bool only equals a bool (0 == False in Python, yet `logprobs: 0` asks for something); numbers
    # compare by value (`presence_penalty: 0.0` is 0)
    if isinstance(value, bool) or isinstance(nothing, bool):
        return type(value) is type(nothing) and value == nothing
    return value == nothing


def _unsupported(data: dict) -> None:
    for name, nothing in UNSUPPORTED.items():
        value = data.get(name)
        if not any(_same(value, v) for v in nothing):
            raise ApiError(400, f"{name}: {json.dumps(value)[:40]} is not supported by this server (it can only "
                           f"be {' or '.join(json.dumps(v) for v in nothing)})", param=name)


def _no_surrogate(field: str, text: str) -> None:
    """400 for a text with a lone surrogate (JSON's \\ud800 escapes make one): it has no UTF-8 form, so no
    tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{field}: not valid Unicode text (a lone surrogate U+{ord(text[err.start]):04X} at "
                       f"character {err.start})", param=field) from None


def _texts(body: _Body) -> None:
    if isinstance(body, CompletionBody):
        _no_surrogate("prompt", body.prompt)
    else:
        for i, m in enumerate(body.messages):
            _no_surrogate(f"messages.{i}.content", m.content)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for s in stops:
        _no_surrogate("stop", s)


def _parse(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    _unsupported(data)
    try:
        body = model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{field}: {first['msg']}", param=field) from None
    _texts(body)
    _stops(body)
    return body


def _stops(body: _Body) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(400, f"stop: each at most {MAX_STOP_CHARS} characters (one has {longest})", param="stop")
    return stops


def fits_bytes(s: Served) -> int:
    """The most UTF-8 bytes a text may have and still fit the context (see NORMALIZER_SHRINK)."""
    return s.capacity * s.max_token_bytes * NORMALIZER_SHRINK


def _check_size(s: Served, field: str, texts: list[str]) -> None:
    """400 before tokenizing a text that cannot fit the context, however the tokenizer splits it."""
    size = sum(len(t.encode("utf-8")) for t in texts)  # no surrogates: _texts checked
    if size > fits_bytes(s):
        raise ApiError(400, f"{field}: {size} bytes of UTF-8 cannot fit the model's context of {s.capacity} tokens "
                       f"(at most {fits_bytes(s)} bytes); shorten it", param=field, code="context_length_exceeded")


def _job(s: Served, body: _Body, ids: list[int], max_tokens: int | None, field: str, stop_ids: list[int],
         stop_strings: list[str]) -> Job:
    if not ids:
        raise ApiError(400, f"{field}: empty after tokenization", param=field)
    if len(ids) >= s.capacity:
        raise ApiError(400, f"{field}: {len(ids)} tokens, but the model's context holds {s.capacity}; shorten it",
                       param=field, code="context_length_exceeded")
    room = s.capacity + 1 - len(ids)  # the last token is picked, never fed back
    return Job(ids, min(max_tokens or room, room), body.temperature, body.top_p if body.top_p < 1 else None,
               body.seed, stop_ids, stop_strings, asyncio.get_running_loop())


def _submit(s: Served, job: Job) -> None:
    try:
        s.scheduler.submit(job)
    except QueueFull:
        raise ApiError(429, "the server's queue is full; retry later", type_="rate_limit_exceeded",
                       headers={"Retry-After": "1"}) from None


def _usage(job: Job) -> dict:
    return {"prompt_tokens": len(job.ids), "completion_tokens": job.tokens,
            "total_tokens": len(job.ids) + job.tokens}


async def _collect(job: Job, request: Request) -> str:
    """The whole text of a non-streaming request. Every DISCONNECT_POLL_S its client is asked whether it
    is still there (nothing else tells a handler that is not sending); one that left frees its slot."""
    parts, asked = [], time.monotonic()
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                kind, value = None, None
            if time.monotonic() - asked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    return ""  # nobody to answer; the finally frees the slot
                asked = time.monotonic()
            if kind == "text":
                parts.append(value)
            elif kind == "error":
                raise ApiError(500, f"generation failed: {value}", type_="server_error")
            elif kind == "done":
                return "".join(parts)
    finally:
        job.cancel()  # nothing after done; a client gone before it frees the slot


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(job: Job, chunk, include_usage: bool):
    """SSE of `chunk(text, finish_reason)` objects; `data: [DONE]` at the end. A client that goes
    away cancels this generator: the finally frees its slot before the next decode step."""
    try:
        first = chunk(None, None)
        if first is not None:
            yield _sse(first)
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield _sse(chunk(value, None))
            elif kind == "error":
                yield _sse({"error": {"message": f"generation failed: {value}", "type": "server_error",
                                      "param": None, "code": None}})
                return
            else:
                yield _sse(chunk("", job.finish_reason if job.finish_reason in ("stop", "length") else "stop"))
                if include_usage:
                    last = chunk("", None)
                    last["choices"] = []
                    yield _sse({**last, "usage": _usage(job)})
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancel()


ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions")


class _Gate:
    """Pure ASGI middleware (it leaves `receive` alone, so a handler still sees its client go away):
    the API key and draining checks of every /v1/ route, and the request counter by route and status."""

    def __init__(self, app, served: Served):
        self.app, self.s = app, served

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s, path = self.s, scope["path"]
        route = path if path in ROUTES else "other"  # a label per route, not per path a client makes up

        async def counted(message):
            if message["type"] == "http.response.start" and path.startswith("/v1/"):
                s.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        if path.startswith("/v1/"):
            refusal = None
            if s.api_key is not None:
                header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                given = header[7:] if header[:7].lower() == "bearer " else ""
                if not hmac.compare_digest(given.encode(), s.api_key.encode()):
                    refusal = _error(401, "missing or incorrect API key (Authorization: Bearer ...)",
                                     code="invalid_api_key")
            if refusal is None and s.draining and scope["method"] == "POST":
                refusal = _error(503, "the server is shutting down", type_="server_error")
            if refusal is not None:
                return await refusal(scope, receive, counted)
        await self.app(scope, receive, counted)


def build_app(s: Served) -> FastAPI:
    app = FastAPI(title="llmpipe", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return _error(err.status, err.message, err.param, err.type, err.code, err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        return _error(err.status_code, str(err.detail), type_="invalid_request_error")

    @app.exception_handler(Exception)
    async def any_error(request: Request, err: Exception):  # never a traceback to the client
        return _error(500, "internal error", type_="server_error")

    app.add_middleware(_Gate, served=s)

    @app.get("/health")
    async def health():
        if s.draining:  # a load balancer stops sending here
            return JSONResponse({"status": "draining", "model": s.name}, status_code=503)
        return {"status": "ok", "model": s.name}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.name, "object": "model", "created": s.created,
                                            "owned_by": "llmpipe"}]}

    def check_model(body: _Body) -> None:
        if body.model != s.name:
            raise ApiError(404, f"model: {body.model!r} is not served here (this server serves {s.name!r})",
                           param="model", code="model_not_found")

    def completion_ids(raw: bytes) -> tuple[CompletionBody, list[int]]:  # in a worker thread
        body = _parse(CompletionBody, _json(raw))
        check_model(body)
        _check_size(s, "prompt", [body.prompt])
        return body, s.tokenizer.encode(body.prompt).ids

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, ids = await run_in_threadpool(completion_ids, await _read_body(request, s.body_timeout))
        job = _job(s, body, ids, body.max_tokens, "prompt", s.eos_ids, _stops(body))
        _submit(s, job)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish):
            if text is None:
                return None
            return {"id": rid, "object": "text_completion", "created": created, "model": s.name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return StreamingResponse(_stream(job, chunk, bool((body.stream_options or {}).get("include_usage"))),
                                     media_type="text/event-stream")
        text = await _collect(job, request)
        return {**chunk(text, job.finish_reason), "usage": _usage(job)}

    def chat_ids(raw: bytes) -> tuple[ChatBody, list[int]]:  # in a worker thread
        body = _parse(ChatBody, _json(raw))
        check_model(body)
        if s.template is None:
            raise ApiError(400, f"{s.name} has no chat template (it was trained on text); use /v1/completions",
                           param="messages")
        _check_size(s, "messages", [m.content for m in body.messages])
        msgs = [m.model_dump() for m in body.messages]
        try:
            t = s.template
            text = t.template.render(msgs, add_generation_prompt=True, bos_token=t.bos_token, eos_token=t.eos_token)
        except UserError as err:
            raise ApiError(400, f"messages: {err}", param="messages") from None
        return body, s.tokenizer.encode(text).ids

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body, ids = await run_in_threadpool(chat_ids, await _read_body(request, s.body_timeout))
        job = _job(s, body, ids, body.max_completion_tokens or body.max_tokens, "messages", s.chat_stop_ids,
                   [*s.chat_stop_strings, *_stops(body)])
        _submit(s, job)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish):
            delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return StreamingResponse(_stream(job, chunk, bool((body.stream_options or {}).get("include_usage"))),
                                     media_type="text/event-stream")
        answer = await _collect(job, request)
        return {"id": rid, "object": "chat.completion", "created": created, "model": s.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": None,
                             "finish_reason": job.finish_reason}],
                "usage": _usage(job)}

    return app
