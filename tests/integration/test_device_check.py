"""benchmarks/device_check.py on a machine without an accelerator: the command a lent GPU or NPU will run,
run here as a user would (a subprocess), its table and JSON read back: the cheap rows run, every row that
needs the accelerator says why it was skipped, and bad options are one line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "benchmarks" / "device_check.py"

ORDER = ["process_group", "train_eager", "train_fsdp2", "train_compile", "memory_vs_plan", "ort_prefill_cpu_fp32",
         "ort_decode_cpu_fp32", "ort_prefill_device_fp16", "ort_decode_device_fp16", "ort_decode_cpu_growing",
         "ort_prefill_optimised_cpu_fp32", "ort_decode_optimised_cpu_fp32", "ort_optimised_device", "torch_decode",
         "generate"]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-check") / "check.json"
    proc = _run("--device", "cpu", "--steps", "2", "--cache", "64", "--json", str(out))
    return proc, json.loads(out.read_text()) if out.is_file() else None


def test_on_a_cpu_the_check_runs_the_cheap_rows_and_exits_zero(checked):
    proc, report = checked
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {r["key"]: r for r in report["rows"]}
    assert [r["key"] for r in report["rows"]] == ORDER
    ran = {k for k, r in rows.items() if r["status"] == "ok"}
    assert ran == {"process_group", "train_eager", "train_fsdp2", "ort_prefill_cpu_fp32", "ort_decode_cpu_fp32",
                   "ort_decode_cpu_growing", "ort_prefill_optimised_cpu_fp32", "ort_decode_optimised_cpu_fp32",
                   "torch_decode", "generate"}
    assert rows["process_group"]["detail"]["backend"] == "gloo"
    assert "all_reduce on cpu gave [1.0, 2.0, 3.0]" in rows["process_group"]["result"]
    for key in ("train_eager", "train_fsdp2"):
        assert rows[key]["detail"]["tokens_per_s"] > 0
        assert rows[key]["detail"]["steady_steps"] == 1  # 2 steps, the first left out
        assert 0 < rows[key]["detail"]["mfu"] < 1  # against this CPU's measured GEMM peak
    for key in ("ort_decode_cpu_fp32", "ort_decode_cpu_growing", "ort_decode_optimised_cpu_fp32", "torch_decode"):
        assert rows[key]["detail"]["rows"][0]["decode_tokens_per_s"] > 0
    # ORT fp32 follows PyTorch fp32 greedy decoding token for token (export_onnx's parity, through generate)
    assert rows["generate"]["detail"]["same_prefix"] == len(rows["generate"]["detail"]["torch_tokens"]) == 16


def test_every_row_that_needs_the_accelerator_says_why_it_was_skipped(checked):
    proc, report = checked
    rows = {r["key"]: r for r in report["rows"]}
    no_device = "skipped: no accelerator here (torch sees no CUDA or NPU device)"
    assert rows["ort_prefill_device_fp16"]["result"] == rows["ort_decode_device_fp16"]["result"] == no_device
    assert rows["memory_vs_plan"]["result"].startswith("skipped: no accelerator: a CPU's peak RSS")
    assert rows["train_compile"]["result"].startswith("skipped: on CPU inductor compiles C++")
    assert "--compile-on-cpu" in rows["train_compile"]["result"]
    assert rows["ort_optimised_device"]["result"] == no_device
    # the printed table is the JSON's: one line per row, the skip reasons stated
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(lines) == len(ORDER)
    assert f"| skipped | {no_device} |" in proc.stdout
    assert "10 ok, 5 skipped, 0 failed" in proc.stdout


def _module():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_check", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["--flavor", "llama-2b"], "error: --flavor: unknown flavor 'llama-2b' (known: debug, tiny, small, llama-1b, "
                               "llama-7b, llama-13b, llama-70b, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, "
                               "qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, llama3.2-1b, llama3.2-3b, "
                               "smollm2-135m, smollm2-360m)"),
    (["--device", "cpu", "--steps", "1"], "error: --steps 1: must be >= 2"),
    (["--device", "cpu", "--seq", "4096"], "error: --seq 4096: exceeds debug's max_seq_len 512"),
    (["--device", "cpu", "--json", "/nonexistent-folder/x.json"], "error: --json: folder /nonexistent-folder does "
                                                                   "not exist"),
])
def test_a_bad_option_is_one_line_and_exit_status_two_before_any_work(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        _module().main(args)
    assert stop.value.code == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [message] and out.out == ""
