"""Upgrading from the previous release re-runs nothing it finished (issue 36 item 19).

The previous release is commit 4ae7198 of this repository, the last before per-stage revisions and before
data.external_symlinks, data.max_record_bytes and data.tokenizer.doc_chars were added to the fingerprint.
Its llmpipe package is taken out of git history into a temporary folder and runs prepare_data in a
subprocess (PYTHONPATH at that tree), as a user of that release did; then today's code runs the same
config on the same folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from llmpipe import config as config_mod
from llmpipe import stages
from tests.conftest import ROOT

PREVIOUS = "4ae7198"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


# `git archive 4ae7198 llmpipe | gzip -9n`: the same package, for a clone without that history (a shallow one)
FIXTURE = ROOT / "tests" / "fixtures" / "llmpipe-4ae7198.tar.gz"


def _files(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _previous_release(tmp: Path) -> Path:
    """The previous release's llmpipe package, checked out of git into `tmp` (or, in a clone without that
    commit, out of the fixture archived from it)."""
    archive = FIXTURE
    found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"],
                           capture_output=True, check=False)
    if found.returncode == 0:
        archive = tmp / "old.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), PREVIOUS, "llmpipe"], check=True)
        assert _files(archive) == _files(FIXTURE)  # the fixture a shallow clone uses is that release's package
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "old", filter="data")
    return tmp / "old"


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """(config path, run folder) of a run whose prepare_data the previous release made."""
    tmp = tmp_path_factory.mktemp("upgrade")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(8):  # small documents, so tokenizer training and packing take a second
        lines = (" ".join(WORDS[(i * 7 + j * 3 + k) % len(WORDS)] for k in range(30)) for j in range(20))
        (corpus / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    cfg = {"run": {"name": "old", "artifacts_dir": str(tmp / "artifacts"), "device": "cpu", "seed": 7},
           "data": {"inputs": [str(corpus / "*.txt")], "seq_len": 32, "val_fraction": 0.2,
                    "tokenizer": {"vocab_size": 300}},
           "model": {"flavor": "debug"}, "train": {"nproc_per_node": 1, "max_steps": 2}}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    old = _previous_release(tmp)  # the working folder too: `python -m` puts it first on sys.path
    env = {**os.environ, "PYTHONPATH": str(old), "PREFECT_HOME": str(tmp / ".prefect")}
    # prepare_data as `llmpipe stage prepare_data` runs it, then the fingerprints that release expects next
    script = ("import json, sys; from llmpipe import cli, config, stages; rc = cli.main(['stage', 'prepare_data', "
              "sys.argv[1]]); print('FINGERPRINTS', json.dumps(stages.fingerprints(config.load(sys.argv[1])))); "
              "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, cwd=old, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = tmp / "artifacts" / "old"
    manifest = json.loads((stages.stage_dir(run_dir, "prepare_data") / "manifest.json").read_text())
    assert "external_symlinks" not in manifest["config"]["data"]  # really the previous release's
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("FINGERPRINTS ")]
    return path, run_dir, json.loads(line.split(" ", 1)[1])


def test_prepare_data_made_by_the_previous_release_is_taken_as_done_and_not_rerun(old_run):
    path, run_dir, _ = old_run
    folder = stages.stage_dir(run_dir, "prepare_data")
    before = json.loads((folder / "manifest.json").read_text())
    cfg = config_mod.load(path)
    assert stages.fingerprints(cfg)["prepare_data"] != before["fingerprint"]  # today's way differs
    assert stages.state(cfg, "prepare_data")[0] == "done"
    manifest, executed = stages.run_stage("prepare_data", cfg)
    assert not executed
    assert manifest.outputs == before["outputs"]  # the same files, not rewritten
    assert manifest.fingerprint == stages.fingerprints(cfg)["prepare_data"]
    assert manifest.changes[-1]["adopted"] == {"fingerprint": before["fingerprint"], "llmpipe": "0.1.0"}
    assert stages.state(cfg, "prepare_data")[0] == "done"  # now by today's fingerprint


def test_a_training_the_previous_release_finished_on_that_data_is_not_retrained(old_run):
    path, _, previous = old_run
    cfg = config_mod.load(path)
    stages.run_stage("prepare_data", cfg)  # adopted
    # the train stage's fingerprint is what that release gave its finished training: it is skipped as done
    assert stages.fingerprints(cfg)["train"] == previous["train"]


@pytest.mark.parametrize("override", ["data.max_record_bytes=4096", "data.seq_len=64"])
def test_a_result_field_changed_since_the_previous_release_still_reruns_its_stage(old_run, override):
    path, _, _ = old_run
    assert stages.state(config_mod.load(path, [override]), "prepare_data")[0] == "stale"


def _attempt(folder: Path, data: str, data_files: str | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "attempt.json").write_text(json.dumps({"data": data, "data_files": data_files}))
    (folder / "model_config.json").write_text(json.dumps({"model": {"dim": 8}}))
    return folder


def test_a_warm_start_compares_data_by_tokenizer_and_shards_not_the_descriptive_keys_of_data_meta(old_run, tmp_path):
    import shutil

    from llmpipe.manifest import Manifest, file_entry
    from llmpipe.train import warm

    _, run_dir, _ = old_run
    old = stages.stage_dir(run_dir, "prepare_data")
    again = shutil.copytree(old, tmp_path / "01_prepare_data")
    meta = json.loads((again / "data_meta.json").read_text())
    (again / "data_meta.json").write_text(json.dumps({**meta, "external_symlinks": 0}, indent=2) + "\n")
    first = Manifest.load(old)
    second = Manifest.load(again)
    second.outputs["meta"] = file_entry(again, "data_meta.json")
    assert first.content_digest() != second.content_digest()  # what the train fingerprint sees: a rerun
    files = warm.data_digest(again, second)
    assert warm.data_digest(old, first) == files
    earlier = _attempt(tmp_path / "earlier", first.content_digest(), warm.data_digest(old, first))
    assert warm._why_not(earlier, {"dim": 8}, second.content_digest(), files) == (None, json.loads(
        (earlier / "attempt.json").read_text()))
    (again / "val.bin").write_bytes((again / "val.bin").read_bytes()[:-2] + b"\x01\x00")  # one token differs
    second.outputs["val_bin"] = file_entry(again, "val.bin")
    assert warm._why_not(earlier, {"dim": 8}, second.content_digest(), warm.data_digest(again, second))[0] == (
        "its data (tokenizer and shards) differ")
