"""Manifests and stage outputs are untrusted: content verified before use, schema-checked, paths
kept inside their stage folder, status consistent with outputs (issue 10, items 1 and 9-11)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from llmpipe import cli, stages
from llmpipe import manifest as manifest_mod
from llmpipe.manifest import Manifest, file_entry, sha256_file
from tests.unit.test_stages import _cfg


def _flip_byte(path, offset=100):
    """Corrupt one byte in place: same size, as silent damage or a careless edit would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def prepared(tmp_path):
    cfg = _cfg(tmp_path)
    stages.run_stage("prepare_data", cfg)
    return cfg, stages.stage_dir(cfg.run_dir(), "prepare_data")


def _edit_manifest(folder, **changes):
    data = json.loads((folder / "manifest.json").read_text())
    data.update(changes)
    (folder / "manifest.json").write_text(json.dumps(data))


def test_a_same_size_corrupted_input_stops_the_consumer_naming_the_file(prepared):
    cfg, folder = prepared
    st = os.stat(folder / "train.bin")
    _flip_byte(folder / "train.bin")
    os.utime(folder / "train.bin", ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: ctime still moves
    assert stages.state(cfg, "prepare_data")[0] == \
        f"corrupt: output train_bin ({folder / 'train.bin'}) sha256 differs from the manifest"
    with pytest.raises(stages.StageError, match=r"train needs prepare_data, which is corrupt: output train_bin"):
        stages.run_stage("train", cfg)
    assert not stages.stage_dir(cfg.run_dir(), "train").exists()
    assert not any(p.name.endswith(".partial") for p in cfg.run_dir().iterdir())


def test_a_plain_rerun_repairs_a_corrupted_stage_and_downstream_identity_follows_its_bytes(prepared):
    cfg, folder = prepared
    before = stages.fingerprints(cfg)
    _flip_byte(folder / "val.bin")
    manifest, executed = stages.run_stage("prepare_data", cfg)
    assert executed and manifest.verify(folder, rehash=True) is None
    assert stages.fingerprints(cfg) == before  # deterministic: the same bytes, nothing downstream stale


def test_status_says_corrupt_for_a_same_size_corruption(prepared, capsys):
    cfg, folder = prepared
    args = ["status", "s", "--artifacts-dir", str(cfg.run.artifacts_dir)]
    assert cli.main(args) == 0
    assert "prepare_data   done" in capsys.readouterr().out
    _flip_byte(folder / "tokenizer.json", offset=10)
    assert cli.main(args) == 0
    assert "prepare_data   corrupt: output tokenizer" in capsys.readouterr().out


def test_verified_digests_are_reused_until_a_file_changes(prepared, monkeypatch):
    _, folder = prepared
    manifest = Manifest.load(folder)
    hashed = []
    real = manifest_mod.sha256_file
    monkeypatch.setattr(manifest_mod, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert manifest.verify(folder) is None and hashed == []  # digests cached when the stage published
    (folder / "val.idx").touch()  # a write (here: timestamps) invalidates that file's entry only
    assert manifest.verify(folder) is None and [p.name for p in hashed] == ["val.idx"]
    assert manifest.verify(folder, rehash=True) is None and len(hashed) == 1 + len(manifest.outputs)


def test_a_corrupt_digest_cache_only_costs_a_rehash(prepared):
    _, folder = prepared
    (folder / manifest_mod.VERIFIED).write_text('{"train.bin": [1, 2, 3, 4, "0"], "x": "junk"')
    _flip_byte(folder / "train.bin")
    assert "train_bin" in Manifest.load(folder).verify(folder)
    (folder / manifest_mod.VERIFIED).write_text(json.dumps({"train.bin": [*[0] * 4, "f" * 64]}))
    assert "train_bin" in Manifest.load(folder).verify(folder)


@pytest.mark.parametrize("edit,why", [
    ({"outputs": ["model.onnx"]}, "outputs: Input should be a valid dictionary"),
    ({"status": "done"}, "status: Input should be 'completed' or 'skipped'"),
    ({"outputs": {"meta": {"path": "data_meta.json", "bytes": -1, "sha256": "0" * 64}}}, "bytes"),
    ({"outputs": {"meta": {"path": "data_meta.json", "bytes": 1, "sha256": "nothex"}}}, "sha256"),
    ({"surprise": 1}, "surprise: Unexpected keyword argument"),
])
def test_a_malformed_manifest_makes_the_stage_invalid_and_it_reruns(prepared, edit, why):
    cfg, folder = prepared
    _edit_manifest(folder, **edit)
    st, manifest = stages.state(cfg, "prepare_data")
    assert st.startswith(f"invalid: {folder / 'manifest.json'}") and why in st and manifest is None
    with pytest.raises(stages.StageError, match="train needs prepare_data, which is invalid"):
        stages.run_stage("train", cfg)
    manifest, executed = stages.run_stage("prepare_data", cfg)
    assert executed and stages.state(cfg, "prepare_data")[0] == "done"


def test_manifest_that_is_not_json_is_invalid_not_a_crash(prepared):
    cfg, folder = prepared
    (folder / "manifest.json").write_text('{"stage": "prepare_data", ')
    assert stages.state(cfg, "prepare_data")[0].startswith("invalid: ") and "not valid JSON" in \
        stages.state(cfg, "prepare_data")[0]


def test_output_paths_cannot_leave_the_stage_folder(prepared, tmp_path):
    cfg, folder = prepared
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    entry = {"path": "../../../../" + str(secret).lstrip("/"), "bytes": secret.stat().st_size,
             "sha256": sha256_file(secret)}
    outputs = json.loads((folder / "manifest.json").read_text())["outputs"]
    _edit_manifest(folder, outputs={**outputs, "tokenizer": entry})
    assert "is not a relative path inside the stage folder" in stages.state(cfg, "prepare_data")[0]
    # the same through a symlink: the path is relative, but what it names is outside
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(secret)
    _edit_manifest(folder, outputs={**outputs, "tokenizer": {**entry, "path": "tokenizer.json"}})
    st = stages.state(cfg, "prepare_data")[0]
    assert st.startswith("corrupt: ") and "resolves outside" in st
    with pytest.raises(stages.StageError, match="train needs prepare_data, which is corrupt: .*resolves outside"):
        stages.run_stage("train", cfg)


def test_a_stage_cannot_publish_an_output_outside_its_folder(tmp_path):
    (tmp_path / "stage").mkdir()
    (tmp_path / "outside.txt").write_text("x")
    with pytest.raises(stages.StageError, match="resolves outside its folder"):
        stages._expand_outputs(tmp_path / "stage", {"x": "../outside.txt"})


def _convert_om_folder(cfg, **fields):
    folder = stages.stage_dir(cfg.run_dir(), "convert_om")
    folder.mkdir(parents=True)
    Manifest(**{"stage": "convert_om", "fingerprint": stages.fingerprints(cfg)["convert_om"],
                "status": "skipped", "reason": "ATC not found", **fields}).write(folder)
    return folder


def test_a_skipped_convert_om_is_done_as_recorded(tmp_path):
    cfg = _cfg(tmp_path)
    _convert_om_folder(cfg)
    assert stages.state(cfg, "convert_om")[0] == "done"


@pytest.mark.parametrize("fields,why", [
    ({"status": "completed", "reason": None}, "status is completed, but output om is not listed"),
    ({"reason": None}, "status is skipped without a reason"),
    ({"stage": "benchmark"}, "manifest is for stage 'benchmark'"),
])
def test_a_manifest_status_must_agree_with_its_outputs(tmp_path, fields, why):
    cfg = _cfg(tmp_path)
    folder = _convert_om_folder(cfg, **fields)
    st, _ = stages.state(cfg, "convert_om")
    assert st == f"invalid: {folder / 'manifest.json'}: {why}"


def test_a_completed_convert_om_must_list_its_om(tmp_path):
    cfg = _cfg(tmp_path)
    folder = _convert_om_folder(cfg)
    (folder / "atc.log").write_text("ok")
    _edit_manifest(folder, status="completed", reason=None, outputs={"log": file_entry(folder, "atc.log")})
    assert stages.state(cfg, "convert_om")[0].endswith("status is completed, but output om is not listed")


def test_only_a_stage_that_may_skip_can_be_skipped(prepared):
    cfg, folder = prepared
    _edit_manifest(folder, status="skipped", reason="why not", outputs={})
    assert stages.state(cfg, "prepare_data")[0].endswith("status is skipped, but prepare_data is never skipped")
    shutil.rmtree(folder)


def test_a_full_disk_during_a_stage_is_one_line_naming_the_stage_folder(tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a plain write() raises it: no filename

    cfg = _cfg(tmp_path)
    monkeypatch.setattr(stages, "_injected_failure", lambda name: full())
    with pytest.raises(stages.StageError, match=r"prepare_data: .*\.01_prepare_data\.partial: no space left on device"):
        stages.run_stage("prepare_data", cfg)
    assert not stages.stage_dir(cfg.run_dir(), "prepare_data").exists()


def _nest_manifest(folder, depth=100_000):
    """A manifest.json nested `depth` lists deep: json.loads raises RecursionError on it."""
    (folder / "manifest.json").write_text("[" * depth + "]" * depth)


def test_a_deeply_nested_manifest_makes_status_list_the_stage_invalid(prepared, capsys):
    cfg, folder = prepared
    _nest_manifest(folder)
    path = folder.parent.parent / "c.yaml"
    path.write_text(json.dumps(cfg.to_dict()))
    assert cli.main(["status", "s", "--artifacts-dir", str(cfg.run.artifacts_dir), "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"prepare_data   invalid: {folder / 'manifest.json'}: nested more than 64 levels deep" in out


def test_a_deeply_nested_manifest_leaves_the_report_working(prepared):
    from llmpipe.tools import report

    cfg, folder = prepared
    _nest_manifest(folder)
    page = report.write(cfg).read_text()
    assert f"invalid: {folder / 'manifest.json'}: nested more than 64 levels deep" in page
    assert "| prepare_data | invalid: " in report.markdown(cfg)


def test_a_deeply_nested_manifest_is_run_again(prepared):
    cfg, folder = prepared
    _nest_manifest(folder)
    with pytest.raises(stages.StageError, match="train needs prepare_data, which is invalid: .*nested more than 64"):
        stages.run_stage("train", cfg)
    manifest, executed = stages.run_stage("prepare_data", cfg)
    assert executed and stages.state(cfg, "prepare_data")[0] == "done"


def test_a_manifest_nested_within_json_s_reach_but_past_the_limit_is_invalid(prepared):
    cfg, folder = prepared
    _edit_manifest(folder, metrics={"a": json.loads("[" * 200 + "]" * 200)})
    assert stages.state(cfg, "prepare_data")[0] == \
        f"invalid: {folder / 'manifest.json'}: nested more than 64 levels deep"


def test_a_manifest_over_the_size_limit_is_invalid_without_being_read_whole(prepared, monkeypatch):
    cfg, folder = prepared
    size = (folder / "manifest.json").stat().st_size
    monkeypatch.setattr(manifest_mod, "MAX_JSON_BYTES", size - 1)  # the real limit is 64 MiB
    assert stages.state(cfg, "prepare_data")[0] == f"invalid: {folder / 'manifest.json'}: more than {size - 1} bytes"
    monkeypatch.setattr(manifest_mod, "MAX_JSON_BYTES", size)
    assert stages.state(cfg, "prepare_data")[0] == "done"


def test_a_deeply_nested_digest_cache_only_costs_a_rehash(prepared):
    _, folder = prepared
    (folder / manifest_mod.VERIFIED).write_text("[" * 100_000 + "]" * 100_000)
    assert Manifest.load(folder).verify(folder) is None
    assert json.loads((folder / manifest_mod.VERIFIED).read_text())["train.bin"][4] == sha256_file(folder / "train.bin")
