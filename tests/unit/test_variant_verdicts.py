"""What the real model exposed (issue 35, item 6): a rejected variant is recorded, not fatal, unless required or
nothing is left; evaluate scores only what the benchmark accepted and has a gate for each; the benchmark's
data-dependent sizes are checked before training; `llmpipe plan` names an init_from model by its folder.
(The benchmark stage's own behaviour is in test_bench.py, test_quality.py and test_quantize.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import numpy as np
import pytest

from llmpipe.config import BenchmarkSection, ConfigError, EvalGatesSection
from llmpipe.data.shards import token_dtype, write_shard
from llmpipe.eval.stage import benchmark_accepted, enforce
from llmpipe.stages import StageError
from llmpipe.train.stage import check_data_sizes
from tests.conftest import make_cfg, make_data_dir


def test_a_required_variant_must_be_one_the_benchmark_makes(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"^config: benchmark: require: int4 is not in benchmark.variants "
                                          r"\['fp32', 'int8'\]"):
        make_cfg(tmp_path, benchmark={"variants": ["fp32", "int8"], "require": ["int4"]})
    assert make_cfg(tmp_path).benchmark.require == []  # the default: nothing required, one deployable variant


def test_evaluate_has_a_gate_for_every_variant_the_benchmark_can_make():
    variants = get_args(get_args(BenchmarkSection.model_fields["variants"].annotation)[0])
    gates = EvalGatesSection()
    assert {v: getattr(gates, v).max_drop for v in variants} == {
        "fp32": 0.03, "fp16": 0.03, "int8": 0.06, "int4": 0.10, "int8w": 0.03, "int8s": 0.03}


def test_evaluate_scores_only_the_variants_the_benchmark_accepted(tmp_path: Path):
    cfg = make_cfg(tmp_path, benchmark={"variants": ["fp32", "int8", "int4", "int8w"]})
    bench = SimpleNamespace(metrics={"rejected": ["int8", "int4"]})  # the benchmark manifest's metrics
    ctx = SimpleNamespace(cfg=cfg, inputs={"benchmark": (tmp_path, bench)})
    scored, notes = benchmark_accepted(ctx)
    assert scored == ["fp32", "int8w"]
    assert notes == ["int8: not evaluated (rejected by the benchmark's quality gate)",
                     "int4: not evaluated (rejected by the benchmark's quality gate)"]


def test_an_evaluation_failure_is_fatal_only_when_required_or_when_nothing_is_left():
    summary = {"verdicts": {"fp32": "accepted", "int8w": "rejected", "int4": "rejected"}}
    failures = ["int8w fails its evaluation gate: a", "int4 fails its evaluation gate: b"]
    enforce(summary, failures, True, [])  # recorded: fp32 is deployable
    with pytest.raises(StageError) as err:
        enforce(summary, failures, True, ["int4"])
    assert str(err.value) == ("evaluate: required int4 (benchmark.require) failed; 2 of 3 failed their evaluation "
                              "gates: int8w fails its evaluation gate: a; int4 fails its evaluation gate: b")
    with pytest.raises(StageError, match="^evaluate: no variant is left deployable; 1 of 1 failed"):
        enforce({"verdicts": {"fp32": "rejected"}}, failures[:1], True, [])
    enforce({"verdicts": {"fp32": "rejected"}}, failures[:1], False, ["fp32"])  # evaluate.enforce: false


def test_the_benchmark_sizes_that_depend_on_the_data_are_checked_before_training_with_the_numbers(tmp_path: Path):
    data = make_data_dir(tmp_path / "data")
    cfg = make_cfg(tmp_path, benchmark={"variants": ["fp32", "int8s"], "quantize": {"calibration_samples": 500}})
    with pytest.raises(StageError) as err:
        check_data_sizes(cfg, data)
    assert str(err.value).startswith("benchmark.quantize.calibration_samples: the benchmark needs 500 validation "
                                     "window(s) of 32 tokens, but the validation shard (")
    assert "lower it (or calibration_seq_len), or raise data.val_fraction" in str(err.value)
    check_data_sizes(make_cfg(tmp_path, benchmark={"variants": ["fp32", "int8s"]}), data)  # 32 windows fit
    small = tmp_path / "small"
    make_data_dir(small)
    write_shard(small / "val.bin", [np.arange(1, 11)], token_dtype(256))  # 10 tokens: no window of 32
    with pytest.raises(StageError, match=r"^benchmark.quality.samples: the benchmark needs 1 validation window\(s\) "
                                         r"of 32 tokens, but the validation shard \(10 tokens\) holds 0; lower "
                                         r"benchmark.quality.seq_len$"):
        check_data_sizes(make_cfg(tmp_path), small)


def test_plan_names_an_init_from_model_by_its_folder(tmp_path: Path, smollm2_hf: Path):
    from llmpipe.tools import plan

    cfg = make_cfg(tmp_path, model={"init_from": str(smollm2_hf)},
                   data={"tokenizer": {"path": str(smollm2_hf / "tokenizer.json")}})
    p = plan.plan(cfg, 1)
    assert p.flavor == f"{smollm2_hf} (init_from)"
    assert f"model    {smollm2_hf} (init_from): 0.1" in plan.format_table(p)
    assert json.loads((smollm2_hf / "config.json").read_text())["num_hidden_layers"] == p.n_layers


def test_evaluate_re_runs_when_the_benchmark_rejects_other_variants_and_not_otherwise(tmp_path: Path):
    from llmpipe.eval.tasks import fingerprint_extra
    from llmpipe.manifest import Manifest
    from llmpipe.stages import stage_dir

    cfg = make_cfg(tmp_path)
    folder = stage_dir(cfg.run_dir(), "benchmark")
    folder.mkdir(parents=True)
    Manifest("benchmark", "completed", "fp", metrics={"rejected": []}).write(folder)
    assert "benchmark_rejected" not in fingerprint_extra(cfg)  # nothing rejected: the fingerprint of before
    Manifest("benchmark", "completed", "fp", metrics={"rejected": ["int8"]}).write(folder)
    assert fingerprint_extra(cfg)["benchmark_rejected"] == ["int8"]
