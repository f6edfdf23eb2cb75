"""`llmpipe bench serve RUN [--url URL]`: the run's own `llmpipe serve` (or any OpenAI-compatible server)
under load; the measurement and its definitions are llmpipe.bench.serving's."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from llmpipe.bench.serving import LocalServer, check_options, first_model, measure, prompts_from_run, table
from llmpipe.errors import ConfigError


def check_url(url: str) -> None:
    """--url: an http(s) address with a host (and a port in range): one line, before any prompt is made."""
    from urllib.parse import urlparse

    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018  raises ValueError for a port out of range or not a number
    except ValueError as err:
        raise ConfigError(f"--url {url}: not a valid URL ({err})") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"--url {url}: not an http(s) URL with a host (e.g. http://127.0.0.1:8000)")


def bench_serve(run_dir: Path, url: str | None, variant: str, levels: list[int], rate: float | None, requests: int,
                prompt_tokens: int, max_tokens: int, seed: int, api_key_file: str | None, json_out: Path | None,
                allow_ungated: bool = False) -> int:
    """`llmpipe bench serve`: prompts from the run, the run's server (or --url) measured; prints the table."""
    from llmpipe.manifest import write_json_atomic
    from llmpipe.tools.serve import read_key

    check_options(requests, prompt_tokens, max_tokens, rate)
    if url is not None:
        check_url(url)
    api_key = read_key(api_key_file) if api_key_file else None
    if json_out is not None and not Path(json_out).parent.is_dir():
        raise ConfigError(f"--json: folder {Path(json_out).parent} does not exist")
    prompts = prompts_from_run(run_dir, requests, prompt_tokens, seed)
    say = lambda text: print(f"bench serve: {text}", file=sys.stderr, flush=True)  # noqa: E731
    if url is None:
        extra = ["--allow-ungated"] if allow_ungated else []
        if api_key_file:
            extra += ["--api-key-file", api_key_file]
        log_path = run_dir / "serve-bench.log"
        say(f"starting llmpipe serve {run_dir.name} --variant {variant} --max-batch {max(levels)} (log: {log_path})")
        with LocalServer(run_dir, variant, max(levels), log_path, extra) as server:
            model = first_model(server.url, api_key)
            rows = measure(server.url, model, prompts, levels, max_tokens, rate, seed, api_key, say)
    else:
        model = first_model(url, api_key)
        rows = measure(url, model, prompts, levels, max_tokens, rate, seed, api_key, say)
    print(f"{model} at {url or 'a local llmpipe serve'}: {requests} requests of {prompt_tokens} prompt tokens, "
          f"up to {max_tokens} new tokens each, greedy, streamed")
    print(table(rows))
    if json_out is not None:
        write_json_atomic(Path(json_out), {"model": model, "url": url, "requests": requests,
                                           "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "seed": seed,
                                           "rows": [asdict(r) for r in rows]})
    return 0
