"""What a config, a model folder or a command line can tell is refused in one line before the expensive
stages (issue 36 items 10, 11, 12, 14): evaluate's files at preflight, non-finite or non-positive RoPE,
norm and LoRA numbers at load, synth-chat's counts against what exists, and `llmpipe plan` of an
init_from config; a NaN greedy run is never called identical to its reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from llmpipe import cli
from tests.unit.test_hf_bounds import _hf_folder


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _config(tmp_path: Path, **sections) -> Path:
    tree = {"run": {"name": "early", "artifacts_dir": str(tmp_path / "artifacts"), "device": "cpu"},
            "data": {"inputs": [str(tmp_path / "*.txt")], "seq_len": 32}, "model": {"flavor": "debug"},
            "train": {"nproc_per_node": 1, "max_steps": 2}, **sections}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_a_missing_evaluate_task_file_stops_llmpipe_run_before_prepare_data(tmp_path, capsys):
    path = _config(tmp_path, evaluate={"tasks": ["local", str(tmp_path / "nothere.yaml")]})
    assert cli.main(["run", str(path)]) == 2
    assert _one_line(capsys) == f"error: {path}: evaluate.tasks: {tmp_path / 'nothere.yaml'}: task file not found"
    assert not (tmp_path / "artifacts").exists()


def test_a_chat_questions_file_of_the_wrong_shape_stops_llmpipe_run_before_prepare_data(tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}]}) + "\n")
    path = _config(tmp_path, data={"inputs": [str(tmp_path / "*.jsonl")], "seq_len": 32, "format": "chat",
                                   "chat_template": "chatml"},
                   evaluate={"tasks": ["local"], "chat_questions": str(questions)})
    assert cli.main(["run", str(path)]) == 2
    assert _one_line(capsys) == (f"error: {path}: evaluate.chat_questions: {questions}: line 1 is not a conversation "
                                 "with a user question and an assistant answer")
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("field, value, expected", [
    ("rope_theta", float("nan"), "rope_theta: nan must be a finite number > 0"),
    ("rope_theta", -10000.0, "rope_theta: -10000.0 must be a finite number > 0"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps: nan must be a finite number > 0"),
    ("rms_norm_eps", 0.0, "rms_norm_eps: 0.0 must be a finite number > 0"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 0, "low_freq_factor": 1, "high_freq_factor": 4,
                      "original_max_position_embeddings": 64}, "rope_scaling.factor: 0.0 must be a finite number > 0"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8, "low_freq_factor": float("inf"), "high_freq_factor": 4,
                      "original_max_position_embeddings": 64},
     "rope_scaling.low_freq_factor: inf must be a finite number > 0"),
])
def test_an_init_from_config_json_with_unusable_rope_or_norm_numbers_is_one_line_at_load(tmp_path, capsys, field,
                                                                                         value, expected):
    folder = _hf_folder(tmp_path / "hf", **{field: value})
    path = _config(tmp_path, model={"init_from": str(folder)})
    assert cli.main(["plan", str(path)]) == 2
    assert _one_line(capsys) == f"error: {path}: model.init_from: {folder / 'config.json'}: {expected}"


@pytest.mark.parametrize("key, value", [("train.lora.alpha", ".inf"), ("model.rope_theta", ".inf")])
def test_an_infinite_lora_alpha_or_rope_theta_in_the_config_is_one_line_at_load(tmp_path, capsys, key, value):
    path = _config(tmp_path, train={"nproc_per_node": 1, "max_steps": 2, "lora": {"rank": 4}})
    assert cli.main(["plan", str(path), "--set", f"{key}={value}"]) == 2
    assert _one_line(capsys) == f"error: {path}: {key}: Input should be a finite number (got inf)"


def test_a_nan_greedy_run_is_never_called_identical_to_its_reference():
    from llmpipe.export.onnx import engine_parity
    from llmpipe.infer.decode import TorchEngine
    from llmpipe.models.llama import FLAVORS, Transformer

    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))  # every logit NaN: both sides argmax to token 0
    report = engine_parity(model, TorchEngine(model), length=32, seed=0, new_tokens=3, prompt_len=4)
    assert report["identical_tokens"] is False
    assert all(r["finite_logits"] is False for r in report["runs"])


def test_llmpipe_plan_of_an_init_from_config_takes_the_vocabulary_from_the_folder(tmp_path, capsys):
    folder = _hf_folder(tmp_path / "hf")  # vocab 300; data.tokenizer.vocab_size stays at its default 8192
    path = _config(tmp_path, model={"init_from": str(folder)})
    assert cli.main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 300


@pytest.mark.parametrize("argv, expected", [
    (["--arithmetic", "5000"], "error: synth-chat: --arithmetic 5000: only 4096 distinct arithmetic questions exist "
                               "(sums and differences of 0..50, products of 0..12)"),
    (["--words", "10001"], "error: synth-chat: --words 10001: at most 10000 made-up words (each comes with a "
                           "classify question on a distinct number of 0..9999)"),
])
def test_synth_chat_asked_for_more_than_exists_is_one_line_and_writes_nothing(tmp_path, capsys, argv, expected):
    assert cli.main(["synth-chat", str(tmp_path / "out"), *argv]) == 2
    assert _one_line(capsys) == expected
    assert not (tmp_path / "out").exists()


def test_synth_chat_can_ask_for_every_arithmetic_question_there_is():
    from llmpipe.chat import synth

    train, val = synth.make_conversations(0, synth.ARITHMETIC_SPACE, 0.1, n_words=10)
    assert sum(synth.family(r) == "arithmetic" for r in train + val) == synth.ARITHMETIC_SPACE


@pytest.mark.parametrize("content, why", [
    ('{"stores": ', "invalid: not valid JSON (Expecting value: line 1 column 12 (char 11))"),
    ('{"stores": {"sqlite:///x": []}}', "invalid: stores.sqlite:///x: expected an object (remove the file to start "
                                        "a new MLflow run)"),
    ('{"stores": {"sqlite:///x": {"versions": {"d": 3}}}}', "invalid: stores.sqlite:///x.versions: expected an object "
     "of {name, version} entries (remove the file to start a new MLflow run)"),
])
def test_a_malformed_mlflow_json_is_one_line_naming_the_file(tmp_path, content, why):
    from llmpipe.tracking import registry
    from llmpipe.tracking.client import TrackingError
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, check="fields")
    cfg.run_dir().mkdir(parents=True)
    (cfg.run_dir() / "mlflow.json").write_text(content)
    with pytest.raises(TrackingError) as err:
        registry.current_version(cfg)
    assert str(err.value) == f"{cfg.run_dir() / 'mlflow.json'}: {why}"


@pytest.mark.parametrize("url, expected", [
    ("notaurl", "--url notaurl: not an http(s) URL with a host (e.g. http://127.0.0.1:8000)"),
    ("http://127.0.0.1:99999", "--url http://127.0.0.1:99999: not a valid URL (Port out of range 0-65535)"),
])
def test_bench_serve_with_an_invalid_url_is_one_line(tmp_path, capsys, url, expected):
    from tests.unit.test_verdicts import benchmarked

    benchmarked(tmp_path / "run", b"model")
    assert cli.main(["bench", "serve", str(tmp_path / "run"), "--url", url]) == 2
    assert _one_line(capsys) == f"error: {expected}"


def test_a_malformed_genai_config_json_is_one_line_naming_the_file(tmp_path):
    from llmpipe.infer.fused import GraphConfig, GraphConfigError

    (tmp_path / "genai_config.json").write_text('{"model": {"decoder": {}}}')
    with pytest.raises(GraphConfigError) as err:
        GraphConfig.read(tmp_path)
    assert str(err.value) == f"{tmp_path / 'genai_config.json'}: invalid: KeyError: 'num_key_value_heads'"


@pytest.mark.parametrize("content, why", [
    ("[1, 2]", "invalid: expected an object, found list"),
    (b"\xff\xfe{}", "invalid: unreadable ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
])
def test_a_malformed_init_from_config_json_is_one_line_naming_the_file(tmp_path, capsys, content, why):
    folder = _hf_folder(tmp_path / "hf")
    (folder / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    path = _config(tmp_path, model={"init_from": str(folder)})
    assert cli.main(["plan", str(path)]) == 2
    assert _one_line(capsys) == f"error: {path}: model.init_from: {folder / 'config.json'}: {why}"
