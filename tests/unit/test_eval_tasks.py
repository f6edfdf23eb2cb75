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


# --------------------------------------------------------------------------- issue 36: what a task file may hold

PAYLOAD = "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}"


@pytest.mark.parametrize("key,template,why", [
    ("doc_to_text", PAYLOAD, "attribute '__globals__'"),
    ("doc_to_target", "{% set x = joiner().__call__ %}{{x}}", "attribute '__call__'"),
    ("doc_to_choice", "{{ question|attr('__class__') }}", "name '__class__'"),
    ("description", "{{ lipsum }}", "jinja's global 'lipsum'"),
    ("doc_to_text", "{{ question[ }}", "does not parse: unexpected '}', expected ']'"),
])
def test_a_task_template_that_reaches_past_the_documents_fields_is_refused_and_runs_nothing(
        tmp_path, project, monkeypatch, key, template, why):
    monkeypatch.chdir(project)
    (project / "evil.yaml").write_text(f"task: evil\ndataset_path: json\n{key}: \"{template}\"\n")
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, "evil.yaml")
    assert str(err.value) == (f"evaluate.tasks: {project / 'evil.yaml'}: {key}: a template may read the "
                              f"document's fields only, not {why} ({template[:60]!r})")
    assert not (project / "PWNED").exists()


def test_field_references_methods_and_statements_of_real_tasks_are_accepted(tmp_path, project):
    """lm_eval's own arc_easy calls a method (`choices.label.index(answerKey)`); the sandbox bounds that."""
    (project / "ok.yaml").write_text("task: ok\ndataset_path: json\ndoc_to_text: \"Q: {{question}}\\nA:\"\n"
                                     "doc_to_choice: \"{{choices.text}}\"\n"
                                     "doc_to_target: \"{{choices.label.index(answerKey)}}\"\n"
                                     "description: \"{% if subject %}{{subject|upper}}{% endif %}\"\n")
    assert list(_plan(tmp_path, "ok.yaml").yamls) == ["ok"]


def test_yaml_anchors_and_aliases_are_refused_before_they_expand(tmp_path, project):
    bomb = "task: t\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    (project / "bomb.yaml").write_text(bomb)  # 9^9 strings once expanded
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, "bomb.yaml")
    assert str(err.value) == (f"evaluate.tasks: {project / 'bomb.yaml'}: line 2: YAML anchors and aliases (&name, "
                              "*name) are not accepted; write the task out in full")


@pytest.mark.parametrize("source,message", [
    ("dataset_path: {outside}", "dataset_path: {outside} is outside the project and the run; refusing to read it"),
    ("dataset_path: ../elsewhere", "dataset_path: ../elsewhere is outside the project and the run; refusing to "
                                   "read it"),
    ("dataset_path: https://example.com/x.json", "dataset_path: 'https://example.com/x.json' is a URL; only local "
                                                 "data or the Hugging Face cache are read"),
    ("dataset_path: json\ndataset_kwargs:\n  data_dir: {outside}", "dataset_kwargs.data_dir: {outside} is outside "
                                                                   "the project and the run; refusing to read it"),
    ("dataset_path: json\ndataset_kwargs:\n  cache_dir: ../elsewhere", "dataset_kwargs.cache_dir: ../elsewhere is "
                                                                       "outside the project and the run; refusing "
                                                                       "to read it"),
    ("dataset_path: json\ndataset_kwargs:\n  trust_remote_code: true", "dataset_kwargs.trust_remote_code: not "
                                                                       "accepted"),
    ("dataset_path: json\ndataset_kwargs:\n  data_files: zip://x.jsonl::file:///etc/passwd",
     "dataset_kwargs.data_files: zip://x.jsonl::file:///etc/passwd is a URL; only local files are read"),
])
def test_a_dataset_source_outside_the_project_and_the_run_is_refused(tmp_path, project, monkeypatch, source, message):
    monkeypatch.chdir(project)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (project / "src.yaml").write_text("task: t\n" + source.format(outside=outside) + "\n")
    with pytest.raises(eval_tasks.EvalTaskError) as err:
        _plan(tmp_path, "src.yaml")
    assert str(err.value) == f"evaluate.tasks: {project / 'src.yaml'}: " + message.format(outside=outside)


def test_lm_evals_templates_render_sandboxed_during_the_stage(tmp_path, monkeypatch):
    """The stage's second guard: lm_eval's own template environment swapped for a sandbox while it runs."""
    from jinja2.exceptions import SecurityError
    from lm_eval import utils

    monkeypatch.chdir(tmp_path)
    plain = utils.env
    with eval_tasks.sandboxed_templates():
        assert utils.apply_template("Q: {{question}}", {"question": "2 + 2?"}) == "Q: 2 + 2?"
        with pytest.raises(SecurityError):
            utils.apply_template(PAYLOAD, {})
        with pytest.raises(SecurityError):  # what the load-time check cannot see: a name made at run time
            utils.apply_template("{{ cycler|attr('_' ~ '_init__') }}", {})
        with pytest.raises(SecurityError):  # the chat templates' bounds on single calls
            utils.apply_template("{{ '%01500000000d' % 1 }}", {})
    assert utils.env is plain
    assert not (tmp_path / "PWNED").exists()
