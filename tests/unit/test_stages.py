"""The stage contract: config-derived fingerprints, skip when done, atomic publish, clean failure."""

from __future__ import annotations

import json
import os

import pytest

from llmpipe import cli, stages
from llmpipe import config as config_mod
from llmpipe.manifest import Manifest


def _cfg(tmp_path, *overrides):
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(6):
        if not (corpus / f"doc{i}.txt").exists():
            (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (40 + i))
    tree = {"run": {"name": "s", "artifacts_dir": str(tmp_path / "artifacts")},
            "data": {"inputs": [str(corpus / "*.txt")], "seq_len": 16, "val_fraction": 0.2,
                     "tokenizer": {"vocab_size": 300}}}
    for o in overrides:
        config_mod.apply_override(tree, o)
    return config_mod.from_dict(tree)


def test_a_config_change_moves_its_own_stage_and_downstream_follows_the_bytes(tmp_path):
    a = stages.fingerprints(_cfg(tmp_path))
    b = stages.fingerprints(_cfg(tmp_path, "export.parity_atol=0.01"))
    assert [s for s in a if a[s] != b[s]] == ["export_onnx"]  # later stages wait for its new bytes
    c = stages.fingerprints(_cfg(tmp_path, "data.seq_len=32"))
    assert [s for s in a if a[s] != c[s]] == ["prepare_data"]


def test_new_bytes_upstream_make_downstream_stale_and_same_bytes_do_not(tmp_path):
    cfg = _cfg(tmp_path)
    stages.run_stage("prepare_data", cfg)
    before = stages.fingerprints(cfg)
    stages.run_stage("prepare_data", cfg, force=True)  # deterministic: the same bytes again
    assert stages.fingerprints(cfg) == before
    changed = _cfg(tmp_path, "data.seq_len=32")
    stages.run_stage("prepare_data", changed)  # data_meta.json records seq_len: new bytes
    after = stages.fingerprints(changed)
    assert after["train"] != before["train"] and after["consolidate"] != before["consolidate"]
    assert after["export_onnx"] == before["export_onnx"]  # reads consolidate, not yet re-run


def test_stage_runs_once_then_skips_and_reruns_when_outputs_change(tmp_path):
    cfg = _cfg(tmp_path)
    m1, ran1 = stages.run_stage("prepare_data", cfg)
    m2, ran2 = stages.run_stage("prepare_data", cfg)
    assert ran1 and not ran2 and m1.fingerprint == m2.fingerprint
    folder = stages.stage_dir(cfg.run_dir(), "prepare_data")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {"stage", "status", "fingerprint", "outputs", "metrics", "config", "versions", "started_at",
            "finished_at"} <= manifest.keys()
    assert manifest["outputs"]["train_bin"]["sha256"]
    # a damaged output is detected and the stage runs again
    (folder / "val.bin").write_bytes(b"junk")
    assert stages.state(cfg, "prepare_data")[0].startswith("corrupt: output val_bin has 4 bytes")
    _, ran3 = stages.run_stage("prepare_data", cfg)
    assert ran3 and Manifest.read(folder).verify(folder) is None


def test_a_stage_needs_its_inputs(tmp_path):
    with pytest.raises(stages.StageError, match="train needs prepare_data, which is missing"):
        stages.run_stage("train", _cfg(tmp_path))


def test_failed_stage_leaves_nothing_behind(tmp_path):
    cfg = _cfg(tmp_path, f"data.inputs=['{tmp_path}/none/*.txt']")
    with pytest.raises(stages.StageError, match=r"data.inputs\[0\]"):
        stages.run_stage("prepare_data", cfg)
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").rglob("*"))


def test_select():
    assert stages.select("export_onnx") == ["export_onnx", "convert_om", "benchmark", "evaluate"]
    assert stages.select(only=["benchmark", "train"]) == ["train", "benchmark"]
    with pytest.raises(config_mod.ConfigError, match="unknown stage 'trian'"):
        stages.select(only=["trian"])


def test_cli_bad_input_is_one_line_and_nonzero(tmp_path, capsys):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"run: {{artifacts_dir: {tmp_path / 'artifacts'}}}\ndata: {{inputs: ['{tmp_path}/x/*.txt']}}\n")
    assert cli.main(["stage", "prepare_data", str(cfg_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: data.inputs[0]") and "matched no files" in err[-1]
    assert not (tmp_path / "artifacts" / "tiny").exists()
    assert cli.main(["stage", "prepare_data", str(cfg_path), "--set", "train.max_steps=-1"]) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: {cfg_path}: train.max_steps: Input should be greater than or equal to 0 (got -1)"


def test_cli_stage_and_status(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg.to_dict()))  # JSON is YAML
    assert cli.main(["stage", "prepare_data", str(path)]) == 0
    assert cli.main(["stage", "prepare_data", str(path)]) == 0
    assert "up to date (skipped)" in capsys.readouterr().out
    assert cli.main(["status", "s", "--artifacts-dir", str(tmp_path / "artifacts")]) == 0
    out = capsys.readouterr().out
    assert "prepare_data   done" in out and "train          missing" in out


def test_editing_the_corpus_reruns_prepare_data(tmp_path):
    cfg = _cfg(tmp_path)
    before = stages.fingerprints(cfg)
    (tmp_path / "corpus" / "doc0.txt").write_text("changed text, different size")
    after = stages.fingerprints(cfg)
    assert [s for s in before if before[s] != after[s]] == ["prepare_data"]


def test_upgrading_llmpipe_changes_no_fingerprint_and_reruns_nothing(tmp_path, monkeypatch):
    import llmpipe

    cfg = _cfg(tmp_path)
    stages.run_stage("prepare_data", cfg)
    before = stages.fingerprints(cfg)
    monkeypatch.setattr(llmpipe, "__version__", "9.9.9")
    assert stages.fingerprints(cfg) == before
    _, executed = stages.run_stage("prepare_data", cfg)
    assert not executed


def test_revision_1_fingerprints_are_byte_identical_to_those_llmpipe_0_1_0_wrote(tmp_path):
    from llmpipe.config import result_section
    from llmpipe.manifest import fingerprint

    cfg = _cfg(tmp_path)
    # a stage still at revision 1 with no extra (export_onnx was one until its revision 2, issue 25)
    name = next(n for n, s in stages.SPECS.items() if s.revision == 1 and not s.extra)
    spec = stages.SPECS[name]  # 0.1.0's payload, as its stages.fingerprints built it:
    old = {"stage": name, "config": {s: result_section(cfg, s) for s in spec.sections},
           "inputs": dict.fromkeys(spec.inputs, "missing"), "llmpipe": "0.1.0"}
    assert stages.fingerprints(cfg)[name] == fingerprint(old)


def test_bumping_a_stage_s_revision_makes_it_stale_and_it_reruns(tmp_path, monkeypatch):
    import dataclasses

    cfg = _cfg(tmp_path)
    stages.run_stage("prepare_data", cfg)
    before = stages.fingerprints(cfg)
    bumped = dataclasses.replace(stages.SPECS["prepare_data"], revision=2)
    monkeypatch.setitem(stages.SPECS, "prepare_data", bumped)
    after = stages.fingerprints(cfg)
    assert [s for s in before if before[s] != after[s]] == ["prepare_data"]  # the rest follows its bytes
    assert stages.state(cfg, "prepare_data")[0] == "stale"
    _, executed = stages.run_stage("prepare_data", cfg)
    assert executed and stages.state(cfg, "prepare_data")[0] == "done"


def test_adding_a_stage_renames_no_folder_and_changes_no_fingerprint(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    stages.run_stage("prepare_data", cfg)
    folders = {s: stages.stage_dir(cfg.run_dir(), s) for s in stages.SPECS}
    before = stages.fingerprints(cfg)
    # an evaluation stage entering the pipeline after train, as the next issues add one
    evaluate = stages.StageSpec("evaluate", ("benchmark",), ("train",), "llmpipe.bench.run:run", number=7)
    specs = list(stages.SPECS.values())
    specs.insert(2, evaluate)
    monkeypatch.setattr(stages, "SPECS", {s.name: s for s in specs})
    monkeypatch.setattr(stages, "STAGES", tuple(s.name for s in specs))
    assert {s: stages.stage_dir(cfg.run_dir(), s) for s in folders} == folders
    assert stages.stage_dir(cfg.run_dir(), "evaluate").name == "07_evaluate"
    after = stages.fingerprints(cfg)
    assert {s: after[s] for s in before} == before
    assert stages.state(cfg, "prepare_data")[0] == "done"


def _leftover(run_dir, name):
    partial = stages.partial_dir(run_dir, name)
    partial.mkdir(parents=True)
    (partial / "model.onnx").write_bytes(b"\0" * 1000)
    return partial


def test_a_run_removes_a_killed_export_s_partial_folder_and_keeps_train_s(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    export, train = _leftover(cfg.run_dir(), "export_onnx"), _leftover(cfg.run_dir(), "train")
    caplog.set_level("INFO", logger="llmpipe.stages")
    stages.run_stage("prepare_data", cfg)
    assert not export.exists() and (train / "model.onnx").is_file()  # train's holds checkpoints
    assert f"removing {export}, left by an interrupted export_onnx attempt" in caplog.text


def test_a_stale_partial_folder_that_is_a_symlink_is_unlinked_not_followed(tmp_path):
    cfg = _cfg(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the run's")
    cfg.run_dir().mkdir(parents=True)
    stages.partial_dir(cfg.run_dir(), "consolidate").symlink_to(elsewhere)
    stages.run_stage("prepare_data", cfg)
    assert not stages.partial_dir(cfg.run_dir(), "consolidate").is_symlink()
    assert (elsewhere / "keep.txt").read_text() == "not the run's"


def test_partial_folders_are_left_alone_while_another_process_holds_the_run(tmp_path):
    import socket

    from llmpipe.lock import LOCK, LockError

    cfg = _cfg(tmp_path)
    export = _leftover(cfg.run_dir(), "export_onnx")
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "started": "now"}  # alive, not us
    (cfg.run_dir() / LOCK).write_text(json.dumps(holder))
    with pytest.raises(LockError, match=f"is in use by pid {os.getppid()}"):
        stages.run_stage("prepare_data", cfg)
    assert (export / "model.onnx").is_file()


def test_a_stage_run_inside_a_held_run_lock_removes_no_partial_folder(tmp_path):
    from llmpipe.lock import run_lock

    cfg = _cfg(tmp_path)
    export = _leftover(cfg.run_dir(), "export_onnx")
    with run_lock(cfg.run_dir()) as taken:  # as the flow holds it: its start did the cleaning
        assert taken
        stages.run_stage("prepare_data", cfg)
    assert (export / "model.onnx").is_file()
