"""evaluate's bad input is one line each, before any model loads: at config load (limit <= 0, a gate for a
variant the benchmark does not make, a task listed twice), and when the stage resolves its tasks (a task YAML
that does not parse, runs code, lies outside the project and the run or reads data from outside, a task name
lm_eval does not know, a dataset that is not on this machine offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpipe import config as config_mod
from llmpipe.config import ConfigError
from llmpipe.eval import tasks as eval_tasks
from tests.conftest import make_cfg

lm_eval = pytest.importorskip("lm_eval")


@pytest.mark.parametrize("section,expected", [
    ({"limit": 0}, "evaluate.limit: Input should be greater than 0 (got 0)"),
    ({"limit": -3}, "evaluate.limit: Input should be greater than 0 (got -3)"),
    ({"tasks": ["local", "local"]}, "evaluate.tasks: a task is listed twice"),
    ({"tasks": []}, "evaluate.tasks: List should have at least 1 item"),
    ({"gates": {"bf16": {"max_drop": 0.1}}}, "evaluate.gates.bf16: unknown key"),
    ({"gates": {"int8": {"max_drop": -1}}}, "evaluate.gates.int8.max_drop: Input should be greater than or equal to 0"),
])
def test_bad_evaluate_settings_are_one_line_at_load(tmp_path, section, expected):
    with pytest.raises(ConfigError) as err:
        make_cfg(tmp_path, check="fields", evaluate=section)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_gate_for_a_variant_the_benchmark_does_not_make_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError) as err:
        make_cfg(tmp_path, check="fields", benchmark={"variants": ["fp32", "int8"]},
                 evaluate={"gates": {"fp16": {"max_drop": 0.1}}})
    assert str(err.value) == ("config: evaluate.gates.fp16: fp16 is not a deployed variant "
                              "(benchmark.variants: fp32, int8)")
    cfg = make_cfg(tmp_path, check="fields", benchmark={"variants": ["fp32", "int8"]},
                   evaluate={"gates": {"int8": {"max_drop": 0.1}}})  # a deployed one is fine
    # a recorded config (train's config.yaml, a manifest's) spells every default gate out and loads again
    assert config_mod.from_dict(cfg.to_dict(), check="fields").evaluate.gates.fp16.max_drop == 0.03


def _plan(tmp_path: Path, entry: str):
    cfg = make_cfg(tmp_path, check="fields", evaluate={"tasks": [entry]})
    return eval_tasks.plan(cfg, root=tmp_path / "project")


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "project").mkdir()
    return tmp_path / "project"


def test_a_task_yaml_that_does_not_parse_or_runs_code_is_one_line(tmp_path, project):
    (project / "broken.yaml").write_text("task: [unclosed\n")
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, "broken.yaml")
    assert str(err.value).startswith(f"evaluate.tasks: {project / 'broken.yaml'}: not a task YAML: ")
    assert "\n" not in str(err.value)
    (project / "code.yaml").write_text("task: t\nprocess_docs: !function utils.process_docs\n")
    with pytest.raises(eval_tasks.EvalTaskError, match=r"`!function` runs Python and is not accepted here"):
        _plan(tmp_path, "code.yaml")
    (project / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, "list.yaml")
    assert str(err.value) == f"evaluate.tasks: {project / 'list.yaml'}: not a task YAML (a mapping with a `task` name)"
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, "missing.yaml")
    assert str(err.value) == f"evaluate.tasks: {project / 'missing.yaml'}: task file not found"


def test_a_task_yaml_outside_the_project_and_the_run_or_reading_data_from_outside_is_refused(tmp_path, project):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "t.yaml").write_text("task: t\ndataset_path: json\n")
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, str(outside / "t.yaml"))
    assert str(err.value).startswith(f"evaluate.tasks: {outside / 't.yaml'}: outside the project ({project}) ")
    (project / "link.yaml").symlink_to(outside / "t.yaml")  # a link inside pointing out is outside too
    with pytest.raises(eval_tasks.EvalTaskError, match="outside the project"):
        _plan(tmp_path, "link.yaml")
    (project / "reads.yaml").write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        "    test: ../elsewhere/secret.jsonl\n")
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, "reads.yaml")
    assert str(err.value) == (f"evaluate.tasks: {project / 'reads.yaml'}: its data file "
                              f"{project / '../elsewhere/secret.jsonl'} is outside the project and the run; "
                              "refusing to read it")


def test_a_dataset_that_is_not_on_disk_fails_offline_in_one_line_naming_it(tmp_path, project, monkeypatch):
    from llmpipe.eval.stage import check_tasks, offline, task_manager, task_specs

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    offline()
    (project / "hub.yaml").write_text("task: hub_task\ndataset_path: someone/not_downloaded\noutput_type: "
                                      "multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\n"
                                      "doc_to_choice: ['a', 'b']\n")
    plan = _plan(tmp_path, "hub.yaml")
    specs = task_specs(plan, {}, [project])
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        check_tasks(specs, task_manager(plan))
    msg = str(err.value)
    assert msg.startswith("evaluate.tasks: hub_task: its dataset someone/not_downloaded could not be loaded offline ")
    assert msg.endswith("put it in the local Hugging Face cache first (docs/guides/evaluate.md)") and "\n" not in msg


def test_an_unknown_task_name_is_one_line(tmp_path):
    from lm_eval.tasks import TaskManager

    from llmpipe.eval.stage import check_tasks, task_specs

    plan = _plan(tmp_path, "hellaswagg")
    assert plan.names == ["hellaswagg"]
    # NOTE: the stage indexes lm_eval's ~15k built-in tasks for a name (half a minute here); an index without
    # them answers the same question for a name that is in neither
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        check_tasks(task_specs(plan, {}, [tmp_path]), TaskManager(include_defaults=False))
    assert str(err.value) == ("evaluate.tasks: unknown task 'hellaswagg' (not an lm_eval task, group or tag; "
                              "`lm-eval ls tasks` lists them)")
