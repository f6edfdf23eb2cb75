"""MFU: one FLOPs count (training, profiler and planner alike), peaks from the table by the name a device
reports, null with the reason for an unknown one, and the CPU's measured GEMM peak cached per machine."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from llmpipe import device, mfu
from llmpipe.models.llama.model import ModelArgs
from llmpipe.tools import plan
from llmpipe.train import metrics, profile
from llmpipe.train import stage as train_stage
from llmpipe.train.loop import train
from tests.conftest import make_cfg, make_data_dir

# -- the FLOPs count ---------------------------------------------------------------------------------


def test_flops_per_token_by_hand():
    a = ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=10, ffn_dim=12)
    # a block: q, o 8x8; k, v 8x4 (one kv head of 4); SwiGLU 3 x 8x12; two norms of 8
    block = 64 + 64 + 32 + 32 + 3 * 96 + 16
    n = 2 * block + 8 + 8 * 10  # blocks, final norm, output head (the embedding is not counted)
    assert n == 1080 == a.num_params(embeddings=False)
    assert mfu.flops_per_token(a, 16) == 6 * 1080 + 12 * 2 * 8 * 16 == 9552


def test_mfu_is_achieved_over_peak_and_null_without_a_peak():
    assert mfu.mfu(1000.0, 9552.0, 9552e3) == 1.0
    assert mfu.mfu(500.0, 9552.0, 9552e3) == 0.5
    assert mfu.mfu(1000.0, 9552.0, None) is None
    assert mfu.mfu(1000.0, 9552.0, 0.0) is None


# -- peaks from the table ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),  # the plain FP32 rate: PyTorch leaves TF32 off
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),  # the SXM part
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H20", "bf16", 148.0),  # not the H200's
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L4", "bf16", 121.0),  # not the L40's
    ("NVIDIA A10", "bf16", 125.0),
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("Ascend910B1", "bf16", 363.7),
    ("Ascend910B2", "bf16", 353.9),
    ("Ascend910B3", "fp16", 294.9),
    ("Ascend910B4", "bf16", 245.8),
    ("Ascend910A", "fp16", 256.0),
])
def test_table_peak_by_reported_name(name, precision, tflops):
    peak = mfu.table_peak(name, precision)
    assert peak.tflops == tflops and "dense peak" in peak.source


def test_h100_sxm_is_the_989_of_the_datasheet():
    assert mfu.table_peak("NVIDIA H100 80GB HBM3", "bf16").tflops == pytest.approx(989, abs=0.5)


@pytest.mark.parametrize("name", ["NVIDIA B200", "NVIDIA A10G", "Ascend910B", "Ascend910_9391", "AMD Instinct MI300X"])
def test_unknown_accelerator_has_no_peak_and_says_why(name):
    assert mfu.table_peak(name, "bf16") == mfu.Peak(None, f"unknown accelerator {name!r}: set train.peak_tflops")


def test_no_figure_for_a_dtype_the_chip_lacks():
    peak = mfu.table_peak("Tesla V100-SXM2-32GB", "bf16")  # Volta has no bf16
    assert peak.tflops is None
    assert peak.source == ("no bf16 figure for NVIDIA V100 SXM2 ('Tesla V100-SXM2-32GB') in llmpipe.mfu's table: "
                           "set train.peak_tflops")
    assert mfu.table_peak("Ascend910B2", "fp32").tflops is None  # no documented fp32 cube rate


def test_accelerator_resolved_by_the_name_it_reports(monkeypatch, tmp_path):
    monkeypatch.setattr(device, "device_name", lambda d: "NVIDIA A100-SXM4-40GB")
    assert mfu.resolve_peak(torch.device("cuda", 0), "bf16", calibration_dir=tmp_path).tflops == 312.0
    monkeypatch.setattr(device, "device_name", lambda d: "Some New Chip")
    assert mfu.resolve_peak(torch.device("cuda", 0), "bf16").source == \
        "unknown accelerator 'Some New Chip': set train.peak_tflops"


def test_override_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(mfu, "measure_gemm_tflops", _never)
    monkeypatch.setattr(device, "device_name", lambda d: "Some New Chip")
    for dev_ in (torch.device("cpu"), torch.device("cuda", 0)):
        assert mfu.resolve_peak(dev_, "bf16", override=123.0, calibration_dir=tmp_path) == \
            mfu.Peak(123.0, "train.peak_tflops")
    assert not list(tmp_path.iterdir())


# -- the CPU calibration -----------------------------------------------------------------------------

def _never(*args, **kwargs):
    raise AssertionError("measured, but should not have")


def _counting(rates):
    calls = []

    def measure(precision, threads, budget_s=None):
        calls.append((precision, threads))
        return rates[threads]
    return measure, calls


def test_calibration_is_cached_and_reused(monkeypatch, tmp_path):
    measure, calls = _counting({1: 0.25})
    monkeypatch.setattr(mfu, "measure_gemm_tflops", measure)
    first = mfu.cpu_peak("fp32", 1, tmp_path)
    second = mfu.resolve_peak(torch.device("cpu"), "fp32", calibration_dir=tmp_path, threads=1)
    assert calls == [("fp32", 1)]  # the second read the file
    assert first == second and first.tflops == 0.25
    assert first.source.startswith(f"measured GEMM peak, fp32 on 1 thread(s) of {device.cpu_model()}")
    (cached,) = tmp_path.glob("gemm-*.json")
    data = json.loads(cached.read_text())
    assert (data["cpu"], data["threads"], data["dtype"], data["torch"], data["tflops"]) == \
        (device.cpu_model(), 1, "fp32", torch.__version__, 0.25)
    mfu.cpu_peak("bf16", 1, tmp_path)  # another dtype, another thread count: measured apart
    measure_2, _ = _counting({1: 0.25, 2: 0.5})
    monkeypatch.setattr(mfu, "measure_gemm_tflops", measure_2)
    assert mfu.cpu_peak("fp32", 2, tmp_path).tflops == 0.5
    assert calls == [("fp32", 1), ("bf16", 1)] and len(list(tmp_path.glob("gemm-*.json"))) == 3


@pytest.mark.parametrize("content", [
    b"not json {", b"\xff\xfe\x00", b"[]", b"null",
    json.dumps({"tflops": float("nan")}).encode(),
    "{key} \"tflops\": -1}}", "{key} \"tflops\": 1e9}}", "{key} \"tflops\": true}}", "{key} \"tflops\": \"0.3\"}}",
    "{key} \"tflops\": NaN}}", "{key} \"tflops\": Infinity}}",
])
def test_a_bad_cache_file_is_measured_again(monkeypatch, tmp_path, caplog, content):
    measure, calls = _counting({1: 0.25})
    monkeypatch.setattr(mfu, "measure_gemm_tflops", measure)
    mfu.cpu_peak("fp32", 1, tmp_path)
    (path,) = tmp_path.glob("gemm-*.json")
    if isinstance(content, str):  # the right key with a bad figure
        key = json.dumps(mfu._key("fp32", 1))[:-1] + ","
        content = content.replace("{key}", key).encode()
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="llmpipe.mfu"):
        assert mfu.cpu_peak("fp32", 1, tmp_path).tflops == 0.25
    assert len(calls) == 2 and "ignoring the GEMM calibration" in caplog.text
    assert json.loads(path.read_text())["tflops"] == 0.25  # rewritten


def test_a_calibration_for_another_machine_is_measured_again(monkeypatch, tmp_path, caplog):
    measure, calls = _counting({1: 0.25})
    monkeypatch.setattr(mfu, "measure_gemm_tflops", measure)
    mfu.cpu_peak("fp32", 1, tmp_path)
    (path,) = tmp_path.glob("gemm-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "cpu": "Another CPU", "tflops": 9.0}))
    assert mfu.cpu_peak("fp32", 1, tmp_path).tflops == 0.25 and len(calls) == 2
    assert "cpu differ from this machine's" in caplog.text


def test_threads_slower_than_one_thread_are_a_busy_machine_not_cached(monkeypatch, tmp_path, caplog):
    measure, calls = _counting({2: 0.001, 1: 0.1})  # as seen on 2 busy cores
    monkeypatch.setattr(mfu, "measure_gemm_tflops", measure)
    peak = mfu.cpu_peak("fp32", 2, tmp_path)
    assert peak.tflops == 0.2 and "not cached" in peak.source and "not cached" in caplog.text
    assert not list(tmp_path.glob("gemm-*.json"))
    mfu.cpu_peak("fp32", 2, tmp_path)
    assert len(calls) == 4  # measured again


def test_real_gemm_measurement_restores_the_thread_count():
    before = torch.get_num_threads()
    assert mfu.measure_gemm_tflops("fp32", 1, budget_s=0.01) > 0
    assert torch.get_num_threads() == before


def test_the_train_stage_measures_once_for_the_ranks(monkeypatch, tmp_path):
    measure, calls = _counting({1: 0.25})
    monkeypatch.setattr(mfu, "measure_gemm_tflops", measure)
    cfg = make_cfg(tmp_path)  # threads_per_proc 1
    train_stage.calibrate_cpu(cfg)
    assert list((tmp_path / "artifacts" / mfu.CALIBRATION_DIR).glob("gemm-*.json"))
    monkeypatch.setattr(mfu, "measure_gemm_tflops", _never)  # a rank reads what the stage measured
    peak = mfu.resolve_peak(torch.device("cpu"), "fp32", None, mfu.calibration_dir(cfg.run.artifacts_dir), threads=1)
    assert peak.tflops == 0.25 and calls == [("fp32", 1)]
    train_stage.calibrate_cpu(make_cfg(tmp_path, train__peak_tflops=2.0))  # an override needs no measurement


# -- one number for training, the profiler and the planner -------------------------------------------

def test_training_and_the_planner_count_the_same_flops(monkeypatch, tmp_path):
    monkeypatch.setattr(mfu, "measure_gemm_tflops", lambda precision, threads, budget_s=None: 0.05)
    cfg = make_cfg(tmp_path, train__max_steps=3)
    data = make_data_dir(tmp_path / "data", vocab=plan.setup_from_config(cfg).args.vocab_size)
    summary = train(cfg, data, tmp_path / "out")
    fpt = plan.plan(cfg).flops_per_token  # the same model: the planner's vocabulary is the data's
    assert summary["peak_tflops"] == 0.05 and summary["peak_source"].startswith("measured GEMM peak, fp32")
    records = [r for r in metrics.read(tmp_path / "out" / metrics.METRICS) if "loss" in r]
    assert len(records) == 3
    for r in records:
        assert r["mfu"] == pytest.approx(mfu.mfu(r["tokens_per_s"], fpt, 0.05e12), rel=1e-12)
    assert summary["mfu"] == pytest.approx(mfu.mfu(summary["tokens_per_s"], fpt, 0.05e12), rel=1e-12)


def test_unknown_peak_gives_null_mfu_in_records_summary_and_log(monkeypatch, tmp_path, data_dir, caplog):
    unknown = mfu.Peak(None, "unknown accelerator 'X': set train.peak_tflops")
    monkeypatch.setattr(mfu, "resolve_peak", lambda *args, **kwargs: unknown)
    cfg = make_cfg(tmp_path, train__max_steps=2)
    with caplog.at_level(logging.INFO, logger="llmpipe.train"):
        summary = train(cfg, data_dir, tmp_path / "out")
    assert (summary["mfu"], summary["peak_tflops"], summary["peak_source"]) == (None, None, unknown.source)
    assert all(r["mfu"] is None for r in metrics.read(tmp_path / "out" / metrics.METRICS) if "loss" in r)
    assert "tok/s  mfu n/a" in caplog.text and "unknown accelerator 'X': set train.peak_tflops" in caplog.text


def test_profiler_breakdown_uses_the_same_mfu():
    step = SimpleNamespace(name="ProfilerStep#1", time_range=SimpleNamespace(start=0.0, end=2e6), thread=1)
    (row,) = profile.breakdown([step], tokens_per_step=1000, flops_per_token=9552.0, peak_flops=1e9)
    assert row["tokens_per_s"] == 500.0 and row["mfu"] == mfu.mfu(500.0, 9552.0, 1e9)
    (row,) = profile.breakdown([step], tokens_per_step=1000, flops_per_token=9552.0, peak_flops=None)
    assert row["mfu"] is None


def test_planner_defaults_to_the_planning_devices_table_peak(tmp_path):
    cfg = make_cfg(tmp_path, train__precision={"dtype": "bf16"})
    p = plan.plan(cfg)
    assert p.peak_tflops == mfu.table_peak(device.PLAN_DEVICE, "bf16").tflops == 353.9
    assert p.peak_source == "Ascend 910B2 bf16 dense peak (CANN platform_config Ascend910B2.ini)"
    assert p.step_s == pytest.approx(plan.train_time_s(p.flops_per_step, p.world_size, 353.9, p.mfu))
    over = plan.plan(cfg, peak_tflops=100.0)
    assert (over.peak_tflops, over.peak_source) == (100.0, "--peak-tflops")
    assert plan.plan(make_cfg(tmp_path, train__peak_tflops=50.0)).peak_source == "train.peak_tflops"


def test_planner_without_a_peak_gives_no_times_and_says_why(tmp_path):
    p = plan.plan(make_cfg(tmp_path, train__precision={"dtype": "fp32"}))  # the 910B: no fp32 figure
    assert p.peak_tflops is None and (p.step_s, p.train_days, p.train_years_one_device) == (None, None, None)
    table = plan.format_table(p)
    assert "n/a" in table and "no fp32 figure for Ascend 910B2" in table
    json.dumps(p.to_dict())
