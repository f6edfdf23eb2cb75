"""`llmpipe serve` (issue 26) as a user meets it: one real server process on a free loopback port, driven by
the official `openai` client and httpx. The run is a small hand-made one (the tiny flavor with a 2048-slot
cache; consolidate's and export_onnx's folders with a chatml template, a benchmark manifest whose gate
rejected int8), built once for the module; its output head gives eos and the end-of-turn token a zero row,
so greedy text never ends before max_tokens and a long generation is long on purpose."""

from __future__ import annotations

import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from llmpipe.chat.template import BUILTIN_TEMPLATES
from llmpipe.checkpoint.template_digest import METRIC, RENDER, digest
from llmpipe.cli import main
from llmpipe.data.shards import token_dtype, write_shard
from llmpipe.export import onnx as export
from llmpipe.manifest import Manifest, file_entry
from llmpipe.models.llama import FLAVORS, Transformer
from llmpipe.models.llama import io as model_io
from llmpipe.stages import stage_dir
from llmpipe.tools.generate import run_generate

CACHE = 2048
ARGS = replace(FLAVORS["tiny"], vocab_size=300, max_seq_len=CACHE)
CHATML = BUILTIN_TEMPLATES["chatml"]
TEXT = ("def main(x):\n    return x + 1\n" * 10 + "<|im_start|>user\nWhat is 7 * 6?<|im_end|>\n"
        "<|im_start|>assistant\n42<|im_end|>\n") * 4


def _publish(folder: Path, stage: str, outputs: dict[str, str], **metrics) -> None:
    entries = {name: file_entry(folder, rel) for name, rel in outputs.items()}
    Manifest(stage, "completed", "test", entries, metrics=metrics).write(folder)


def build_run(run: Path) -> Path:
    """consolidate (weights, model config, tokenizer, chatml template), export_onnx (prefill + static
    decoder of CACHE slots, the template) and a benchmark manifest (fp32 and fp16 passed, int8 rejected)."""
    from llmpipe.data.tokenizer import train_tokenizer

    tok = train_tokenizer([TEXT], vocab_size=ARGS.vocab_size, extra_special=["<|im_start|>", "<|im_end|>"])
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    with torch.no_grad():
        for name in ("<|endoftext|>", "<|im_end|>"):
            model.output.weight[tok.token_to_id(name)] = 0.0  # logit 0: below the best of 299 others
    model.eval()
    sha = digest(CHATML)
    folder = stage_dir(run, "prepare_data")  # the validation text `llmpipe bench serve` takes prompts from
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    write_shard(folder / "val.bin", [tok.encode(TEXT).ids], token_dtype(ARGS.vocab_size))
    folder = stage_dir(run, "consolidate")
    folder.mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if "freqs" not in k}
    save_file(weights, str(folder / model_io.WEIGHTS))
    model_io.write_args(folder, ARGS, "float32")
    tok.save(str(folder / model_io.TOKENIZER))
    (folder / "chat_template.jinja").write_text(CHATML)
    _publish(folder, "consolidate", {"model": model_io.WEIGHTS, "model_config": model_io.CONFIG,
                                     "tokenizer": model_io.TOKENIZER, "chat_template": "chat_template.jinja"},
             **{METRIC: sha, RENDER: {"bos_token": "", "eos_token": "<|endoftext|>"}})
    folder = stage_dir(run, "export_onnx")
    folder.mkdir(parents=True)
    export.export_prefill(model, folder / "model.onnx", opset=17)
    export.export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=CACHE)
    (folder / "chat_template.jinja").write_text(CHATML)
    _publish(folder, "export_onnx", {"model": "model.onnx", "decoder_static": "decoder_static.onnx",
                                     "chat_template": "chat_template.jinja"},
             static_decoder_cache_len=CACHE, **{METRIC: sha})
    folder = stage_dir(run, "benchmark")
    folder.mkdir(parents=True)
    (folder / "results.json").write_text("{}")
    _publish(folder, "benchmark", {"results": "results.json"}, rejected=["int8"],
             ppl={"fp32": 10.0, "fp16": 10.0, "int8": 11.0})
    return run


# --------------------------------------------------------------------------- one server for the module

KEY = "sk-test-6f1d0c9a"
MODEL = "run/fp32"
LONG = 2000  # tokens: a generation that lasts seconds (the eos rows are zero)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`llmpipe serve` as a subprocess on a free loopback port, ready once GET /health answers 200."""

    def __init__(self, run: Path, log: Path, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "llmpipe", "serve", str(run), "--port", str(self.port), "--threads", "1", *args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    def wait_for(self, **want: float) -> dict[str, float]:
        """Poll /metrics until every `name=value` holds (names without the llmpipe_ prefix)."""
        deadline = time.monotonic() + 30
        while True:
            m = self.metrics()
            if all(m.get(f"llmpipe_{k}") == v for k, v in want.items()):
                return m
            assert time.monotonic() < deadline, (want, m)
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return build_run(tmp_path_factory.mktemp("serve") / "run")


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "key").write_text(KEY + "\n")
    srv = Server(run, folder / "server.log", "--max-batch", "2", "--max-queue", "1",
                 "--api-key-file", str(folder / "key"), "--body-timeout", "1")
    yield srv
    srv.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _post(server, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    kw.setdefault("timeout", 60)
    return httpx.post(f"{server.url}{path}", content=data, headers={**headers, "Content-Type": "application/json"},
                      **kw)


# --------------------------------------------------------------------------- the OpenAI API


def test_models_lists_the_run_and_its_variant(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_the_openai_client_completes_a_prompt_with_and_without_streaming(client):
    whole = client.completions.create(model=MODEL, prompt="def main(", max_tokens=24, temperature=0)
    assert whole.model == MODEL
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens + 24 == whole.usage.total_tokens
    chunks = list(client.completions.create(model=MODEL, prompt="def main(", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_the_openai_client_chats_with_and_without_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 * 6?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_greedy_text_through_the_server_equals_llmpipe_generates(client, run):
    served = client.completions.create(model=MODEL, prompt="def main(x):", max_tokens=40, temperature=0)
    local = run_generate(run, "def main(x):", 40, "fp32", out=io.StringIO())
    assert served.choices[0].text == local["text"]
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 7 * 6?"}],
                                            max_tokens=20, temperature=0)
    local = run_generate(run, None, 20, "fp32", out=io.StringIO(), chat="What is 7 * 6?")
    assert answer.choices[0].message.content == local["text"]


def test_stop_sequences_cut_the_text_and_a_seed_repeats_a_sample(client):
    text = client.completions.create(model=MODEL, prompt="def", max_tokens=30, temperature=0).choices[0].text
    stop = text[12:15]
    cut = client.completions.create(model=MODEL, prompt="def", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    draws = [client.completions.create(model=MODEL, prompt="def", max_tokens=30, temperature=1.0, top_p=0.9,
                                       seed=5).choices[0].text for _ in range(2)]
    assert draws[0] == draws[1]


def test_concurrent_requests_decode_together_and_each_gets_its_text_alone(client):
    """Two prompts of different lengths in one batch (rows at different positions) give each the
    greedy text it gets alone."""
    alone, together = alone_and_together(client, MODEL, ["def main(x):\n    return", "What"], 60)
    assert together == alone


def alone_and_together(client: openai.OpenAI, model: str, prompts: list[str], max_tokens: int):
    """(greedy texts of `prompts` asked one at a time, the same asked all at once from threads)."""
    ask = lambda p: client.completions.create(model=model, prompt=p, max_tokens=max_tokens,  # noqa: E731
                                              temperature=0).choices[0].text
    alone = [ask(p) for p in prompts]
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(prompts[i])))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return alone, [together[i] for i in range(len(prompts))]


# --------------------------------------------------------------------------- security and bad input


def test_a_missing_or_wrong_api_key_is_401_with_the_error_object(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for key in (None, "sk-wrong", KEY + "x"):
        r = _post(server, "/v1/completions", body, key=key)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert _post(server, "/v1/completions", body).status_code == 200


BAD = [
    ("not json", b"{\"model\": ", 400, None, "the body is not valid JSON"),
    ("not an object", [1, 2], 400, None, "the body must be a JSON object"),
    ("NaN temperature", b'{"model": "run/fp32", "prompt": "x", "temperature": NaN}', 400, None,
     "the body is not valid JSON"),
    ("wrong type", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "max_tokens: "),
    ("prompt not text", {"model": MODEL, "prompt": 5}, 400, "prompt", "prompt: "),
    ("no model", {"prompt": "x"}, 400, "model", "model: "),
    ("max_tokens 0", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens: "),
    ("negative temperature", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature",
     "temperature: "),
    ("top_p 0", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "top_p: "),
    ("n 2", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n", "n: "),
    ("five stops", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "stop: at most 4 non-empty strings"),
    ("unknown model", {"model": "other/fp32", "prompt": "x"}, 404, "model",
     "model: 'other/fp32' is not served here (this server serves 'run/fp32')"),
    ("prompt too long", {"model": MODEL, "prompt": "def main(x): " * 2000}, 400, "prompt", "prompt: "),
    ("body too large", {"model": MODEL, "prompt": "x" * (2 << 20)}, 413, None,
     "request body larger than 1048576 bytes"),
    # issue 36: a stop string is held back token by token, so each is bounded (the streamer's work with it)
    ("four long stops", {"model": MODEL, "prompt": "x", "stop": ["ab" * 30000] * 4}, 400, "stop",
     "stop: each at most 256 characters (one has 60000)"),
    ("a lone surrogate", b'{"model": "run/fp32", "prompt": "a\\ud800b"}', 400, "prompt",
     "prompt: not valid Unicode text (a lone surrogate U+D800 at character 1)"),
    ("a surrogate stop", b'{"model": "run/fp32", "prompt": "a", "stop": "\\udfff"}', 400, "stop",
     "stop: not valid Unicode text (a lone surrogate U+DFFF at character 0)"),
    ("bytes beyond the context", {"model": MODEL, "prompt": "x" * 1_000_000}, 400, "prompt",
     "prompt: 1000000 bytes of UTF-8 cannot fit the model's context of 2048 tokens (at most "),
    ("logprobs", {"model": MODEL, "prompt": "x", "logprobs": 5}, 400, "logprobs",
     "logprobs: 5 is not supported by this server (it can only be null or false)"),
    ("echo", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo",
     "echo: true is not supported by this server (it can only be null or false)"),
    ("best_of", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of",
     "best_of: 3 is not supported by this server (it can only be null or 1)"),
    ("n 3", {"model": MODEL, "prompt": "x", "n": 3}, 400, "n", "n: 3 is not supported by this server"),
    ("a penalty", {"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty",
     "presence_penalty: 0.5 is not supported by this server (it can only be null or 0)"),
]


@pytest.mark.parametrize("body,status,param,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_with_openais_error_object(server, body, status, param, message):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"].startswith(message)
    assert "Traceback" not in r.text


def test_a_prompt_longer_than_the_context_says_both_numbers(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "def main(x): " * 2000})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"].endswith(f"but the model's context holds {CACHE}; shorten it")


def test_what_a_client_may_leave_at_its_default_is_accepted(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "logprobs": None, "echo": False, "best_of": 1, "n": 1,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None}
    assert _post(server, "/v1/completions", body).status_code == 200


def test_a_chat_message_with_a_lone_surrogate_or_asking_for_tools_or_logprobs_is_400_naming_the_field(server):
    surrogate = b'{"model": "run/fp32", "messages": [{"role": "user", "content": "\\ud83d"}]}'
    r = _post(server, "/v1/chat/completions", surrogate)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages.0.content")
    assert r.json()["error"]["message"] == ("messages.0.content: not valid Unicode text (a lone surrogate U+D83D "
                                            "at character 0)")
    msgs = [{"role": "user", "content": "hi"}]
    for field, value in (("logprobs", True), ("tools", [{"type": "function"}]), ("n", 2),
                         ("response_format", {"type": "json_object"})):
        r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, field: value})
        assert (r.status_code, r.json()["error"]["param"]) == (400, field), r.text
        assert r.json()["error"]["message"].startswith(f"{field}: {json.dumps(value)} is not supported")
    assert "Traceback" not in server.log.read_text()


def test_health_answers_while_large_requests_are_parsed_rendered_and_tokenized(server):
    """Two chat bodies of 24,000 messages, just under 1 MiB (each refused in the end: too long for the context),
    take the server seconds to parse, render and tokenize; that work runs in worker threads, so most of ten /health
    requests sent one after another meanwhile are answered before both large requests are. On the event loop
    a /health could be answered only before each large one began (two or three at most); here nine or ten
    are (at least five asserted: the GIL is shared, so a /health is slower while they run)."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(24_000)]
    big = {"model": MODEL, "messages": msgs}
    done: list[int] = []
    senders = [threading.Thread(target=lambda: done.append(_post(server, "/v1/chat/completions", big).status_code))
               for _ in range(2)]
    for t in senders:
        t.start()
    answered_before = 0
    try:
        for _ in range(10):
            assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
            answered_before += len(done) < 2
    finally:
        for t in senders:
            t.join()
    assert done == [400, 400]
    assert answered_before >= 5


def test_a_body_that_does_not_arrive_in_time_is_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
        reply = b""
        while b'"code"' not in reply:  # the status line and the body may come in separate packets
            data = sock.recv(65536)
            assert data, reply
            reply += data
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408 ")
    assert '"message":"the request body did not arrive within 1 s"' in reply


def test_connections_beyond_the_limit_get_503_at_once(server):
    from llmpipe.tools.serve import connection_limit

    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(connection_limit(2, 1))]
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health", timeout=30).status_code != 200:  # uvicorn sees them close
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_bad_chat_messages_are_a_4xx_with_openais_error_object(server):
    for messages, param in (([], "messages"), ([{"role": "robot", "content": "x"}], "messages.0.role"),
                            ([{"role": "user"}], "messages.0.content")):
        r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_a_full_queue_is_429_with_retry_after(server):
    """--max-batch 2 --max-queue 1: two decode, one waits, the fourth is refused."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        body = {"model": MODEL, "prompt": "def", "max_tokens": LONG, "temperature": 0, "stream": True}
        streams = []
        try:
            for want in ({"batch_size": 1}, {"batch_size": 2}, {"batch_size": 2, "queue_length": 1}):
                streams.append(http.stream("POST", "/v1/completions", json=body))
                streams[-1].__enter__()
                server.wait_for(**want)
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_exceeded"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    server.wait_for(batch_size=0, queue_length=0)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    before = server.metrics()["llmpipe_completion_tokens_total"]
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        body = {"model": MODEL, "prompt": "def", "max_tokens": LONG, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
    after = server.wait_for(batch_size=0)["llmpipe_completion_tokens_total"]
    assert after - before < LONG  # freed before its max_tokens
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_client_that_gives_up_on_a_whole_completion_frees_its_slot(server):
    before = server.metrics()["llmpipe_completion_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", {"model": MODEL, "prompt": "def", "max_tokens": LONG, "temperature": 0},
              timeout=httpx.Timeout(60, read=0.3))
    after = server.wait_for(batch_size=0)["llmpipe_completion_tokens_total"]
    assert after - before < LONG


def test_health_and_metrics_count_requests_and_tokens(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "model": MODEL}
    m = server.metrics()
    assert m["llmpipe_completion_tokens_total"] > 0
    assert m["llmpipe_time_to_first_token_seconds_count"] > 0
    text = httpx.get(f"{server.url}/metrics").text
    assert 'llmpipe_requests_total{route="/v1/completions",status="401"}' in text
    assert "llmpipe_time_per_output_token_seconds_bucket" in text


# --------------------------------------------------------------------------- what may be served


def test_a_variant_the_gate_rejected_or_a_run_without_benchmark_is_refused_in_one_line(run, tmp_path, capsys):
    assert main(["serve", str(run), "--variant", "int8"]) == 1
    bench = stage_dir(run, "benchmark")
    assert capsys.readouterr().err == (f"error: int8 was rejected by the benchmark's quality gate "
                                       f"({bench / 'results.md'}); refusing to serve it (--allow-ungated to "
                                       "serve anyway)\n")
    copy = shutil.copytree(run, tmp_path / "run")
    shutil.rmtree(stage_dir(copy, "benchmark"))
    assert main(["serve", str(copy)]) == 1
    assert capsys.readouterr().err == (f"error: {copy}: the benchmark stage has not completed, so no quality gate "
                                       "has passed; refusing to serve it (--allow-ungated to serve anyway)\n")


def test_a_variant_the_evaluation_rejected_is_refused_in_one_line(run, tmp_path, capsys):
    copy = shutil.copytree(run, tmp_path / "run")
    folder = stage_dir(copy, "evaluate")
    folder.mkdir()
    (folder / "results.md").write_text("| task | metric |\n")
    _publish(folder, "evaluate", {"table": "results.md"}, rejected=["fp32"])
    assert main(["serve", str(copy), "--variant", "fp32"]) == 1
    assert capsys.readouterr().err == (f"error: fp32 was rejected by the evaluation's gate ({folder / 'results.md'}); "
                                       "refusing to serve it (--allow-ungated to serve anyway)\n")


def test_a_tampered_benchmark_or_a_bad_option_is_refused_before_anything_loads(run, tmp_path, capsys):
    copy = shutil.copytree(run, tmp_path / "run")
    bench = stage_dir(copy, "benchmark")
    (bench / "results.json").write_text('{"rejected": []}')
    assert main(["serve", str(copy)]) == 1
    assert capsys.readouterr().err == (f"error: {bench}: output results has 16 bytes, manifest says 2; refusing "
                                       "to serve it (--allow-ungated to serve anyway)\n")
    for argv, line in ((["--max-batch", "0"], "--max-batch 0: must be between 1 and 256"),
                       (["--port", "70000"], "--port 70000: must be between 0 and 65535"),
                       (["--body-timeout", "0"], "--body-timeout 0: must be between 0.1 and 600 seconds"),
                       (["--api-key-file", str(tmp_path / "none")], f"--api-key-file {tmp_path / 'none'}: "
                                                                    "No such file or directory")):
        assert main(["serve", str(run), *argv]) == 2
        assert capsys.readouterr().err == f"error: {line}\n"
    with socket.socket() as taken:  # a port another process listens on: one line before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(run), "--port", str(port)]) == 1
        assert capsys.readouterr().err == (f"error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already "
                                           "in use)\n")


def _text_run(run: Path, tmp_path: Path) -> Path:
    """The run without its chat template and without a benchmark (a text run, ungated)."""
    copy = shutil.copytree(run, tmp_path / "text")
    shutil.rmtree(stage_dir(copy, "benchmark"))
    for stage in ("consolidate", "export_onnx"):
        folder = stage_dir(copy, stage)
        (folder / "chat_template.jinja").unlink()
        m = Manifest.read(folder)
        del m.outputs["chat_template"]
        m.metrics = {k: v for k, v in m.metrics.items() if k not in (METRIC, RENDER)}
        m.write(folder)
    return copy


def test_a_text_run_served_ungated_refuses_chat_with_the_error_object(run, tmp_path):
    srv = Server(_text_run(run, tmp_path), tmp_path / "text.log", "--allow-ungated")
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions",
                       json={"model": "text/fp32", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        assert r.json()["error"] == {"message": "text/fp32 has no chat template (it was trained on text); use "
                                     "/v1/completions", "type": "invalid_request_error", "param": "messages",
                                     "code": None}
        assert httpx.post(f"{srv.url}/v1/completions", json={"model": "text/fp32", "prompt": "x"}).status_code == 200
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    assert "serve: serving UNGATED (--allow-ungated): " in srv.log.read_text()


# --------------------------------------------------------------------------- llmpipe bench serve


def _bench(run: Path, *args: str) -> int:
    return main(["bench", "serve", str(run), "--requests", "3", "--prompt-tokens", "8", "--max-tokens", "5", *args])


def test_bench_serve_measures_a_running_server_by_its_url_counting_every_request_and_token(server, run, tmp_path):
    (tmp_path / "key").write_text(KEY)
    out = tmp_path / "bench.json"
    assert _bench(run, "--url", server.url, "--concurrency", "1,2", "--api-key-file", str(tmp_path / "key"),
                  "--json", str(out)) == 0
    got = json.loads(out.read_text())
    assert got["model"] == MODEL and [r["concurrency"] for r in got["rows"]] == [1, 2]
    for r in got["rows"]:
        assert (r["requests"], r["errors"]) == (3, 0)
        # the eos rows are zero: every request streams exactly max_tokens, all of them counted
        assert r["output_tokens_per_s"] * r["wall_s"] == pytest.approx(3 * 5)
        assert r["requests_per_s"] * r["wall_s"] == pytest.approx(3)
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"]
        assert 0 < r["tpot_ms"]["p50"] <= r["tpot_ms"]["p99"]


def test_bench_serve_starts_the_runs_own_server_and_stops_it(run, tmp_path):
    out = tmp_path / "bench.json"
    assert _bench(run, "--concurrency", "2", "--json", str(out)) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["requests"], r["errors"]) for r in rows] == [(2, 3, 0)]
    log = (run / "serve-bench.log").read_text()
    assert "serve: run/fp32" in log and "Finished server process" in log  # uvicorn's last line: it exited


@pytest.mark.parametrize("args, line", [
    (["--concurrency", "0"], "error: --concurrency '0': each between 1 and 1024"),
    (["--concurrency", "1,x"], "error: --concurrency '1,x': a comma-separated list of integers, e.g. 1,4,8,16"),
    (["--rate", "-2"], "error: --rate -2.0: must be a positive number of requests per second"),
    (["--prompt-tokens", "100000"], "error: --prompt-tokens 100000: the validation split holds"),
])
def test_bench_serve_refuses_bad_options_in_one_line(run, capsys, args, line):
    assert _bench(run, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


def test_bench_serve_names_a_url_nothing_answers(run, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    assert _bench(run, "--url", url) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --url {url}: "), err


# --------------------------------------------------------------------------- last: the shared server stops


def test_sigterm_drains_in_flight_requests_and_exits_0(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        body = {"model": MODEL, "prompt": "def", "max_tokens": LONG, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            late = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": MODEL, "prompt": "x"})
            assert late.status_code == 503
            assert late.json()["error"]["message"] == "the server is shutting down"
            health = httpx.get(f"{server.url}/health")  # a load balancer stops sending here
            assert (health.status_code, health.json()["status"]) == (503, "draining")
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == LONG
    assert server.proc.wait(timeout=60) == 0
    assert KEY not in server.log.read_text()
