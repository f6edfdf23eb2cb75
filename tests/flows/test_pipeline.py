"""The whole tiny pipeline through the Prefect flow: six stages, rerun skips all, a changed export
setting re-runs export_onnx and later stages only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmpipe.config import STAGES
from llmpipe.manifest import Manifest
from llmpipe.stages import stage_dir

pytestmark = pytest.mark.slow
LLMPIPE = str(Path(sys.executable).with_name("llmpipe"))


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
        "benchmark": {"shapes": [[1, 32]], "warmup": 1, "iters": 3, "threads": 1,
                      "llm": {"prompt_lens": [16, 32], "batches": [1, 2], "decode_prompt_len": 16, "new_tokens": 8,
                              "repeats": 1, "sample_tokens": 16},
                      "quality": {"samples": 4, "continuation_prompts": 2, "continuation_tokens": 8},
                      "serving": {"enabled": True, "concurrency": [1, 2], "requests": 3, "prompt_tokens": 16,
                                  "max_tokens": 4}},
        "evaluate": {"limit": 8},
    }
    path = folder / "flowtest.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def outputs_of(snapshot: dict[str, int], stage: str) -> dict[str, int]:
    """A _snapshot without the benchmark's manifest files (a done stage records operational changes there)."""
    return {p: t for p, t in snapshot.items()
            if stage != "benchmark" or Path(p).name not in ("manifest.json", ".verified.json")}


def _snapshot(run_dir: Path, stage: str) -> dict[str, float]:
    folder = stage_dir(run_dir, stage)
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
    assert {"ttft_ms", "tpot_ms", "decode_tokens_per_s"} <= set(Manifest.read(run_dir / "06_benchmark").metrics)
    assert set(bench["quality"]["variants"]) == {"fp32", "fp16", "int8"}
    for v in bench["quality"]["variants"].values():
        assert {"ppl", "kl", "top1", "continuation"} <= set(v)
    assert parity["static_decoder"]["identical_tokens"] and parity["static_decoder"]["runs"][0]["new_tokens"] == 64
    # benchmark.serving: a real `llmpipe serve` of the run, started and stopped by the stage, under load
    serving = bench["serving"]
    assert serving["model"] == "flowtest/fp32"
    assert [(r["concurrency"], r["requests"], r["errors"]) for r in serving["rows"]] == [(1, 3, 0), (2, 3, 0)]
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 for r in serving["rows"])
    assert "Finished server process" in (run_dir / "06_benchmark" / "serving.log").read_text()  # it was stopped
    html = (run_dir / "report.html").read_text()
    assert "Serving: flowtest/fp32 under load" in html and "serving.png" in html
    assert "loss curve" in html and "Benchmark" in html
    assert "ttft.png" in html and "tpot.png" in html and "Parity chain" in html and "Generated samples" in html
    from llmpipe import config as config_mod
    from llmpipe.tools import report

    md = report.markdown(config_mod.load(first_run[0]))
    assert "| benchmark | done | completed |" in md and "| convert_om | done | skipped |" in md
    for stage in STAGES:
        folder = stage_dir(run_dir, stage)
        assert Manifest.read(folder).verify(folder) is None


def test_the_hf_folder_loads_in_transformers_with_the_run_s_eos_and_a_generation_config(first_run):
    """Issue 24 item 6, on a pre-trained run: tokenizer_config.json, special_tokens_map.json and
    generation_config.json sit beside config.json, and transformers reads the run's eos from them."""
    transformers = pytest.importorskip("transformers")
    _, run_dir, _ = first_run
    hf = run_dir / "03_consolidate" / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token, tokenizer.bos_token) == \
           ("<|endoftext|>", 0, "<|endoftext|>", None)
    assert tokenizer.chat_template is None and tokenizer.model_max_length == 512
    assert transformers.GenerationConfig.from_pretrained(hf).eos_token_id == [0]
    assert {"hf/tokenizer_config.json", "hf/special_tokens_map.json", "hf/generation_config.json"} <= \
           set(Manifest.read(run_dir / "03_consolidate").outputs)


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
    code = ("import sys, llmpipe.cli, llmpipe.stages, llmpipe.tools.report, llmpipe.train.stage, "
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
    digests = {s: Manifest.read(stage_dir(run_dir, s)).outputs for s in STAGES[:k]}
    monkeypatch.setenv("LLMPIPE_FAIL_STAGE", stage)
    with pytest.raises(Exception, match=f"{stage}: failure injected by LLMPIPE_FAIL_STAGE"):
        train_to_deploy(config=config, overrides=[change])
    monkeypatch.delenv("LLMPIPE_FAIL_STAGE")
    results = train_to_deploy(config=config, overrides=[change])
    executed = [s for s, r in results.items() if r["executed"]]
    # The changed stage runs; a later one runs again only if the bytes it reads changed.
    assert executed[0] == stage and set(executed) <= set(STAGES[k:])
    for s in set(STAGES[k:]) - set(executed):
        recorded = Manifest.read(stage_dir(run_dir, s)).inputs
        assert all(recorded[d] == Manifest.read(stage_dir(run_dir, d)).content_digest()
                   for d in recorded)
    assert {s: _snapshot(run_dir, s) for s in STAGES[:k]} == earlier  # byte-for-byte untouched
    for s in STAGES[:k]:
        folder = stage_dir(run_dir, s)
        assert Manifest.read(folder).outputs == digests[s] and Manifest.read(folder).verify(folder) is None


def test_generate_streams_text_and_greedy_onnx_matches_pytorch_for_64_tokens(first_run, capsys):
    """`llmpipe generate`: the ONNX static decoder (onnxruntime) and PyTorch eager pick the same 64
    greedy tokens from the trained model; the closing line gives the counts and the speeds."""
    from llmpipe.cli import main
    from llmpipe.tools.generate import run_generate

    _, run_dir, _ = first_run
    assert main(["generate", "flowtest", "--artifacts-dir", str(run_dir.parent), "--prompt", "def main(",
                 "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def main(") and "new tokens, time to first token" in out
    runs = {v: run_generate(run_dir, "import json\n", 64, v, out=open(os.devnull, "w")) for v in ("torch", "fp32")}
    assert runs["fp32"]["tokens"] == runs["torch"]["tokens"]
    assert len(runs["fp32"]["tokens"]) == 64 or runs["fp32"]["tokens"][-1] == 0  # 64, or stopped at EOS
    sampled = run_generate(run_dir, "import json\n", 12, "int8", temperature=0.9, top_k=20, top_p=0.9, seed=1,
                           out=open(os.devnull, "w"))
    again = run_generate(run_dir, "import json\n", 12, "int8", temperature=0.9, top_k=20, top_p=0.9, seed=1,
                         out=open(os.devnull, "w"))
    assert sampled["tokens"] == again["tokens"]  # seeded sampling repeats


def test_generate_refuses_a_prompt_longer_than_the_context_in_one_line(first_run, capsys):
    from llmpipe.cli import main

    _, run_dir, _ = first_run
    assert main(["generate", str(run_dir), "--prompt", "x = 1\n" * 400]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --prompt: ") and "holds 512; shorten the prompt" in err[0]


def test_a_quality_gate_beyond_reach_fails_the_benchmark_then_the_relaxed_rerun_runs_only_it(first_run):
    """Gate int8 beyond reach: `llmpipe run` ends with one error line naming the variant, the metric,
    the value and the limit; relaxing it re-runs the benchmark stage only."""
    from flows.train_to_deploy import train_to_deploy

    config, run_dir, _ = first_run
    train_to_deploy(config=config)  # up to date
    int8 = json.loads((run_dir / "06_benchmark" / "results.json").read_text())["quality"]["variants"]["int8"]
    assert int8["top1"] < 1.0 or int8["ppl_increase"] > 0  # the premise: int8 moves something
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_LEVEL"}
    gate = ["--set", "benchmark.quality.int8.max_ppl_increase=0", "--set", "benchmark.quality.int8.min_top1=1",
            "--set", "benchmark.require=[int8]"]
    out = subprocess.run([LLMPIPE, "run", config, *gate], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: benchmark: required variant int8 (benchmark.require) "
                                                     "failed; 1 of 3 failed their quality gates: int8: "), errors
    assert "benchmark.quality.int8." in errors[0]
    # The console (issue 38): a line per stage start and end, no Prefect task-run lines, no stage detail;
    # the detail is in the stage's log and Prefect's lines in the run's.
    console = out.stdout.splitlines() + out.stderr.splitlines()
    assert [ln for ln in console if "Finished in state" in ln or " p50 " in ln] == []
    assert len(console) <= 20, console
    assert {"prepare_data: up to date", "benchmark: running"} <= {ln.split(" (")[0] for ln in console}
    assert " p50 " in (run_dir / "logs" / "06_benchmark.log").read_text()
    assert "Finished in state Completed()" in (run_dir / "logs" / "run.log").read_text()
    results = train_to_deploy(config=config, overrides=["benchmark.quality.int8.min_top1=0.5"])
    assert [s for s, r in results.items() if r["executed"]] == ["benchmark"]


def test_the_evaluation_scores_the_reference_and_every_variant_and_the_report_shows_the_table(first_run):
    """Issue 27: the seventh stage ran lm_eval on hf/ (HFLM) and on each deployed variant (llmpipe's engines):
    fp32 ONNX scores what HFLM scores within the stderr; the tables reach results.md and the report."""
    from llmpipe import config as config_mod
    from llmpipe.tools import report

    config, run_dir, results = first_run
    assert results["evaluate"]["executed"] and stage_dir(run_dir, "evaluate").name == "07_evaluate"
    folder = stage_dir(run_dir, "evaluate")
    out = json.loads((folder / "results.json").read_text())
    assert list(out["lm_eval"]) == ["reference", "fp32", "fp16", "int8"]
    assert out["reference"] == "hf/ through lm_eval's HFLM"
    tasks = out["summary"]["tasks"]
    assert set(tasks) == {"llmpipe_choice", "llmpipe_ppl"}
    acc = tasks["llmpipe_choice"]["acc"]
    assert abs(acc["fp32"]["value"] - acc["reference"]["value"]) <= acc["reference"]["stderr"]
    bpb = tasks["llmpipe_ppl"]["bits_per_byte"]
    assert abs(bpb["fp32"]["delta"]) <= 1e-4 and bpb["reference"]["value"] > 0
    assert out["lm_eval"]["int8"]["results"]["llmpipe_choice"]["acc,none"] == acc["int8"]["value"]  # untouched
    assert out["summary"]["verdicts"] == {"fp32": "accepted", "fp16": "accepted", "int8": "accepted"}
    assert "| llmpipe_choice | acc | " in (folder / "results.md").read_text()
    assert (folder / "scores.png").stat().st_size > 0 and (folder / "tasks" / "llmpipe_choice.yaml").is_file()
    assert "Evaluation (lm-evaluation-harness)" in (run_dir / "report.html").read_text()
    assert "## Evaluation" in report.markdown(config_mod.load(config))


def test_an_evaluation_gate_beyond_reach_fails_with_one_line_then_the_relaxed_rerun_runs_only_evaluate(first_run):
    from flows.train_to_deploy import train_to_deploy

    config, run_dir, _ = first_run
    train_to_deploy(config=config)  # up to date
    tasks = json.loads((run_dir / "07_evaluate" / "results.json").read_text())["summary"]["tasks"]
    # the premise: some variant scores below the reference somewhere (bits per byte rising is a drop)
    drops = [((c["reference"]["value"] - c[v]["value"]) * (1 if m.startswith("acc") else -1), v)
             for ms in tasks.values() for m, c in ms.items() if "perplexity" not in m for v in ("fp32", "fp16", "int8")]
    drop, variant = max(drops)
    assert drop > 0
    before = {s: _snapshot(run_dir, s) for s in STAGES}
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_LEVEL"}
    # a variant that is not required would be recorded as rejected: requiring it makes its failure the stage's
    # (an operational field: the finished benchmark stays)
    required = f"benchmark.require=[{variant}]"
    gate = ["--set", f"evaluate.gates.{variant}.max_drop=0", "--set", required]
    out = subprocess.run([LLMPIPE, "run", config, *gate], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: evaluate: required {variant} (benchmark.require) "
                                                     "failed; "), errors
    assert f"{variant} fails its evaluation gate: " in errors[0]
    assert f"; evaluate.gates.{variant}.max_drop)" in errors[0]
    # nothing half-written, the last result kept; the benchmark's manifest alone records the operational change
    # (benchmark.require) it was run under, as any done stage's does
    after = {s: outputs_of(_snapshot(run_dir, s), s) for s in STAGES}
    assert after == {s: outputs_of(before[s], s) for s in STAGES}
    changes = json.loads((stage_dir(run_dir, "benchmark") / "manifest.json").read_text())["changes"]
    assert "benchmark.require" in changes[-1]["operational"]
    results = train_to_deploy(config=config, overrides=[f"evaluate.gates.{variant}.max_drop=1", required])
    assert [s for s, r in results.items() if r["executed"]] == ["evaluate"]


def test_a_run_made_before_the_evaluate_stage_gets_only_it_executed(first_run):
    """A run whose six stages were made before the evaluation existed: the next run executes evaluate alone,
    every earlier folder keeps its name and its bytes."""
    import shutil

    from flows.train_to_deploy import train_to_deploy

    config, run_dir, _ = first_run
    train_to_deploy(config=config)
    shutil.rmtree(stage_dir(run_dir, "evaluate"))
    names = sorted(p.name for p in run_dir.iterdir())
    before = {s: _snapshot(run_dir, s) for s in STAGES[:-1]}
    results = train_to_deploy(config=config)
    assert [s for s, r in results.items() if r["executed"]] == ["evaluate"]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*names, "07_evaluate"])
    assert {s: _snapshot(run_dir, s) for s in STAGES[:-1]} == before
