"""A gate's verdict counts only for the model it judged (issue 36 item 5, issue 35 item 6): serve, `serve
--latest-passing` and generate refuse a stale or rejecting verdict, each with one line.

The run folders are stage folders with real files and manifests (what the stages write), so these tests
exercise the verdict rules themselves; the stages that make such folders are exercised elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpipe.cli import main
from llmpipe.manifest import Manifest, file_entry
from llmpipe.stages import stage_dir
from llmpipe.tools.serve import gate_problem, latest_passing


def stage(run_dir: Path, name: str, content: bytes, inputs: dict[str, Manifest] = (), finished: str = "",
          **metrics) -> Manifest:
    """Stage `name`'s folder with one output file holding `content`, and its manifest recording the content
    digests of `inputs` (as the stage contract records what a stage read)."""
    folder = stage_dir(run_dir, name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "out.bin").write_bytes(content)
    m = Manifest(name, "completed", f"fp-{name}", {"out": file_entry(folder, "out.bin")}, metrics=metrics,
                 finished_at=finished, inputs={k: v.content_digest() for k, v in dict(inputs).items()})
    m.write(folder)
    return m


def model(run_dir: Path, weights: bytes) -> tuple[Manifest, Manifest]:
    """consolidate and export_onnx of a model whose weights are `weights`."""
    cons = stage(run_dir, "consolidate", weights)
    return cons, stage(run_dir, "export_onnx", b"graph of " + weights, {"consolidate": cons})


def benchmarked(run_dir: Path, weights: bytes, rejected: tuple[str, ...] = (), finished: str = "") -> Manifest:
    cons, export = model(run_dir, weights)
    return stage(run_dir, "benchmark", b"results " + weights, {"export_onnx": export, "consolidate": cons},
                 finished, rejected=list(rejected), ppl={"fp32": 10.0, "int8": 10.5})


def test_after_a_retrain_whose_benchmark_has_not_run_serve_refuses_the_old_verdict_as_stale(tmp_path, capsys):
    run = tmp_path / "tiny"
    old = benchmarked(run, b"first model")
    assert gate_problem(run, "fp32") is None
    _, export = model(run, b"retrained model")  # retrained, consolidated, exported; benchmark failed or not run
    was = old.inputs["export_onnx"][:12]
    assert main(["serve", str(run), "--variant", "fp32", "--port", "0"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: the benchmark verdict is stale: it judged export_onnx {was}, but the run's export_onnx is now "
        f"{export.content_digest()[:12]} (run benchmark again); refusing to serve it (--allow-ungated to serve "
        "anyway)"]


def test_after_a_failed_evaluate_rerun_serve_refuses_the_old_evaluation_as_stale(tmp_path, capsys):
    run = tmp_path / "tiny"
    cons, _ = model(run, b"first model")
    old = stage(run, "evaluate", b"scores", {"consolidate": cons}, rejected=[])
    benchmarked(run, b"retrained model")  # the new model's benchmark passed; its evaluation failed to run
    now = Manifest.load(stage_dir(run, "consolidate")).content_digest()
    assert main(["serve", str(run), "--variant", "fp32", "--port", "0"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: the evaluate verdict is stale: it judged consolidate {old.inputs['consolidate'][:12]}, but the "
        f"run's consolidate is now {now[:12]} (run evaluate again); refusing to serve it (--allow-ungated to serve "
        "anyway)"]


def test_latest_passing_skips_a_newer_run_whose_verdict_is_stale(tmp_path):
    older = tmp_path / "a"
    benchmarked(older, b"model a", finished="2026-11-01T02:00:00+00:00")
    newer = tmp_path / "b"
    benchmarked(newer, b"model b", finished="2026-12-01T02:00:00+00:00")
    assert latest_passing(tmp_path, "fp32") == newer
    model(newer, b"model b retrained")
    assert latest_passing(tmp_path, "fp32") == older


def test_generate_refuses_a_variant_the_benchmark_rejected_with_serve_s_override_flag(tmp_path, capsys):
    run = tmp_path / "tiny"
    benchmarked(run, b"model", rejected=("int8",))
    assert main(["generate", str(run), "--variant", "int8", "--prompt", "x"]) == 1
    results = stage_dir(run, "benchmark") / "results.md"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: int8 was rejected by the benchmark's quality gate ({results}); refusing to generate with it "
        "(--allow-ungated to generate anyway)"]


@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_generate_is_not_refused_for_a_stale_or_accepted_verdict(tmp_path, variant):
    from llmpipe.verdicts import rejection

    run = tmp_path / "tiny"
    benchmarked(run, b"model", rejected=("int8",))
    model(run, b"retrained")  # int8's rejection was about the earlier model
    assert rejection(run, variant) is None
