"""A flow that serves the newest run that passed: `llmpipe serve --latest-passing` as a child process.

It picks, under `artifacts_dir`, the run whose benchmark finished last with `variant` through its gates
(llmpipe.tools.serve.latest_passing, in the child, so the pick and the serving are one command a person
can also run), and serves it until the flow run is cancelled or the server stops. Deployed from
prefect.yaml as `serve-latest/latest-passing`: run it after the nightly training, and each run serves
the latest good model (cancel the previous flow run first, or give each its own port).

    prefect deployment run 'serve-latest/latest-passing' --param port=8000
"""

from __future__ import annotations

import subprocess
import sys

from prefect import flow, get_run_logger

import flows  # noqa: F401  (sets Prefect defaults before prefect is imported)
from llmpipe.train.launch import _die_with_parent


@flow(name="serve-latest", log_prints=True, retries=0)
def serve_latest(artifacts_dir: str = "artifacts", variant: str = "fp32", host: str = "127.0.0.1",
                 port: int = 8000, max_batch: int = 8, api_key_file: str | None = None) -> int:
    """Serve the latest run that passed until the server exits; its exit status (0 after a drain)."""
    argv = [sys.executable, "-m", "llmpipe", "serve", "--latest-passing", "--artifacts-dir", artifacts_dir,
            "--variant", variant, "--host", host, "--port", str(port), "--max-batch", str(max_batch)]
    if api_key_file:
        argv += ["--api-key-file", api_key_file]
    logger = get_run_logger()
    logger.info("serving the latest run under %s that passed with %s on %s:%d", artifacts_dir, variant, host, port)
    # the server dies with this flow run's process (a cancelled run kills it), and drains on SIGTERM
    proc = subprocess.Popen(argv, preexec_fn=_die_with_parent)  # noqa: S603 (an argv list, no shell)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    if code != 0:
        raise RuntimeError(f"llmpipe serve --latest-passing exited with {code}")
    return code
