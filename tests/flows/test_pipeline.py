"""The whole tiny pipeline through the Prefect flow: six stages, rerun skips all, a changed export
setting re-runs export_onnx and later stages only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmpipe.config import STAGES
from llmpipe.manifest import Manifest

pytestmark = pytest.mark.slow


def _write_config(folder: Path) -> Path:
    cfg = {
        "run": {"name": "flowtest", "artifacts_dir": str(folder / "artifacts"), "device": "cpu", "seed": 3},
        "data": {"inputs": ["{stdlib}/json/*.py", "{stdlib}/email/*.py"], "seq_len": 64, "val_fraction": 0.2,
                 "tokenizer": {"vocab_size": 512}},
        "model": {"flavor": "debug"},
        "train": {"nproc_per_node": 2, "micro_batch_size": 4, "grad_accum_steps": 2, "max_steps": 30,
                  "threads_per_proc": 1, "optim": {"lr": 3.0e-3}, "schedule": {"warmup_steps": 3},
                  "checkpoint": {"every_steps": 10, "keep_last": 2}, "eval": {"every_steps": 10, "batches": 4}},
        "export": {"parity_shapes": [[1, 16], [2, 48]]},
        "benchmark": {"shapes": [[1, 32]], "warmup": 1, "iters": 3, "threads": 1},
    }
    path = folder / "flowtest.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _snapshot(run_dir: Path, stage: str) -> dict[str, float]:
    folder = run_dir / f"{STAGES.index(stage) + 1:02d}_{stage}"
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    from flows.train_to_deploy import train_to_deploy

    folder = tmp_path_factory.mktemp("flow")
    config = str(_write_config(folder))
    results = train_to_deploy(config=config)
    return config, folder / "artifacts" / "flowtest", results


def test_all_six_stages_run(first_run):
    _, run_dir, results = first_run
    assert list(results) == list(STAGES)
    assert all(r["executed"] for r in results.values())
    assert results["convert_om"]["status"] == "skipped"
    om = Manifest.read(run_dir / "05_convert_om")
    assert "ATC" in om.reason and "not found" in om.reason
    train = Manifest.read(run_dir / "02_train").metrics
    assert train["world_size"] == 2
    assert train["val_loss"] < train["val_loss_start"] - 0.5  # it learned something
    parity = json.loads((run_dir / "04_export_onnx" / "parity.json").read_text())
    assert parity["max_abs_diff"] <= 1e-3
    bench = json.loads((run_dir / "06_benchmark" / "results.json").read_text())
    variants = {r["variant"] for r in bench["rows"]}
    assert {"fp32", "fp16", "int8"} <= variants
    html = (run_dir / "report.html").read_text()
    assert "loss curve" in html and "Benchmark" in html
    from llmpipe import config as config_mod
    from llmpipe import report

    md = report.markdown(config_mod.load(first_run[0]))
    assert "| benchmark | done | completed |" in md and "| convert_om | done | skipped |" in md
    for stage in STAGES:
        folder = run_dir / f"{STAGES.index(stage) + 1:02d}_{stage}"
        assert Manifest.read(folder).verify(folder) is None


def test_rerun_skips_every_stage(first_run):
    from flows.train_to_deploy import train_to_deploy

    config, run_dir, _ = first_run
    before = {s: _snapshot(run_dir, s) for s in STAGES}
    results = train_to_deploy(config=config)
    assert not any(r["executed"] for r in results.values())
    assert {s: _snapshot(run_dir, s) for s in STAGES} == before


def test_changed_export_setting_reruns_export_and_later_only(first_run):
    from flows.train_to_deploy import train_to_deploy

    config, run_dir, _ = first_run
    before = {s: _snapshot(run_dir, s) for s in STAGES[:3]}
    results = train_to_deploy(config=config, overrides=["export.parity_atol=0.002"])
    executed = [s for s, r in results.items() if r["executed"]]
    assert executed == ["export_onnx", "convert_om", "benchmark"]
    assert {s: _snapshot(run_dir, s) for s in STAGES[:3]} == before  # untouched


def test_llmpipe_library_never_imports_prefect():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    offenders = [str(p) for p in (root / "llmpipe").rglob("*.py")
                 if "import prefect" in p.read_text() or "from prefect" in p.read_text()]
    assert offenders == []
    code = ("import sys, llmpipe.cli, llmpipe.stages, llmpipe.report, llmpipe.train.stage, "
            "llmpipe.checkpoint.consolidate, llmpipe.export.onnx, llmpipe.bench.run, llmpipe.data.prepare; "
            "assert 'prefect' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize("stage,change", [("consolidate", "consolidate.hf_layout=false"),
                                          ("benchmark", "benchmark.iters=2")])
def test_injected_failure_then_rerun_executes_that_stage_onward(first_run, monkeypatch, stage, change):
    """A changed setting makes `stage` due; it fails (injected); the rerun runs it and later stages only."""
    from flows.train_to_deploy import train_to_deploy

    config, run_dir, _ = first_run
    train_to_deploy(config=config)  # start from an up-to-date run
    k = STAGES.index(stage)
    earlier = {s: _snapshot(run_dir, s) for s in STAGES[:k]}
    digests = {s: Manifest.read(run_dir / f"{STAGES.index(s) + 1:02d}_{s}").outputs for s in STAGES[:k]}
    monkeypatch.setenv("LLMPIPE_FAIL_STAGE", stage)
    with pytest.raises(Exception, match=f"{stage}: failure injected by LLMPIPE_FAIL_STAGE"):
        train_to_deploy(config=config, overrides=[change])
    monkeypatch.delenv("LLMPIPE_FAIL_STAGE")
    results = train_to_deploy(config=config, overrides=[change])
    executed = [s for s, r in results.items() if r["executed"]]
    # The changed stage runs; a later one runs again only if the bytes it reads changed.
    assert executed[0] == stage and set(executed) <= set(STAGES[k:])
    for s in set(STAGES[k:]) - set(executed):
        recorded = Manifest.read(run_dir / f"{STAGES.index(s) + 1:02d}_{s}").inputs
        assert all(recorded[d] == Manifest.read(run_dir / f"{STAGES.index(d) + 1:02d}_{d}").content_digest()
                   for d in recorded)
    assert {s: _snapshot(run_dir, s) for s in STAGES[:k]} == earlier  # byte-for-byte untouched
    for s in STAGES[:k]:
        folder = run_dir / f"{STAGES.index(s) + 1:02d}_{s}"
        assert Manifest.read(folder).outputs == digests[s] and Manifest.read(folder).verify(folder) is None
