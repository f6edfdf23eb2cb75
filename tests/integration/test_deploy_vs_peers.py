"""benchmarks/deploy_vs_peers.py run as a user runs it (a subprocess), on the debug flavor with few tokens: every
engine decodes, the fp32 engines pick PyTorch's tokens, the physical bound is stated, and the ratios are printed
with their paired spread. Timing itself is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmpipe.export import fused
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(fused.unavailable_reason() is not None, reason=str(fused.unavailable_reason()))]

ENGINES = ["torch", "fused-fp32", "fused-int4", "genai-fp32", "genai-int4"]


def test_the_comparison_runs_every_engine_on_one_model_and_prints_the_ratios(tmp_path):
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "deploy_vs_peers.py"), "--flavors", "debug", "--repeats", "2",
         "--new-tokens", "4", "--cache", "64", "--decode-prompt", "8", "--ttft-prompts", "16", "--batches", "1,2",
         "--engines", ",".join(ENGINES), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    res = json.loads(out.read_text())["results"]["debug"]
    assert list(res["best"]) == ENGINES
    for name in ENGINES:
        assert res["best"][name]["decode_b1"] > 0 and res["best"][name]["decode_b2"] > 0, name
        assert len(res["samples"][name]["decode_b1"]) == 2, name
    for name in ("fused-fp32", "genai-fp32"):  # the same model decodes the same tokens, engine by engine
        assert res["greedy_agreement_with_torch"][name] == 1.0, name
    # a decode step reads every weight but the embedding table: genai's int4 (blocks of 32) about a sixth of fp32's
    # bytes; the pipeline's (blocks of 32, the head at 8 bits, which dominates the debug flavor's weights): under a
    # third
    weights = res["step_weight_bytes"]
    assert weights["fused-fp32"] == weights["genai-fp32"]
    assert 0.1 < weights["genai-int4"] / weights["fused-fp32"] < 0.25, weights
    assert 0.1 < weights["fused-int4"] / weights["fused-fp32"] < 0.34, weights
    assert "bound: weight bytes per step / " in proc.stdout
    assert "fastest gated variant (fused-" in proc.stdout and "/genai-int4 b1 " in proc.stdout
    assert "fused-fp32/genai-fp32 b2 " in proc.stdout and "(paired: median " in proc.stdout
