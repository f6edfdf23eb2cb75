"""The registry keeps a verdict per variant and trusts nothing the run folder says without checking it
(issue 35 item 6, issue 36 items 5, 8, 9). A real MLflow SQLite store, read back with MLflow's own client;
the run folders are stage folders with real files and manifests (tests/unit/test_verdicts.py)."""

from __future__ import annotations

import json
import logging

import pytest

from llmpipe import tracking
from llmpipe.cli import main
from llmpipe.stages import stage_dir
from llmpipe.tracking import registry
from llmpipe.tracking.client import TrackingError
from tests.conftest import make_cfg
from tests.unit.test_verdicts import benchmarked, model

NAME = "shared"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    return root, f"sqlite:///{root / 'mlflow.db'}"


def _cfg(store, run: str):
    root, uri = store
    return make_cfg(root / run, check="fields", run={"name": run, "artifacts_dir": str(root / "artifacts")},
                    tracking={"mlflow": {"enabled": True, "tracking_uri": uri, "model_name": NAME}})


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri, registry_uri=uri)


def _version(cfg) -> str:
    return tracking.backfill(cfg)["versions"][registry._manifest(cfg, "consolidate").content_digest()]["version"]


def test_the_registry_keeps_a_verdict_per_variant_and_promotes_the_variant_that_passed(store, capsys):
    cfg = _cfg(store, "mixed")
    benchmarked(cfg.run_dir(), b"model", rejected=("int8",))
    version = _version(cfg)
    tags = _client(store[1]).get_model_version(NAME, version).tags
    assert (tags["llmpipe.gates.variant.fp32"], tags["llmpipe.gates.variant.int8"]) == ("passed", "failed")
    assert (tags["llmpipe.gates"], tags["llmpipe.gates.passed_variants"]) == ("passed", "fp32")
    assert str(_client(store[1]).get_model_version_by_alias(NAME, "candidate").version) == version
    capsys.readouterr()
    assert main(["promote", f"{NAME}/{version}", "--variant", "int8", "--tracking-uri", store[1]]) == 1
    assert capsys.readouterr().err == (f"error: {NAME}/{version}: its int8 variant's gates are failed; not promoted "
                                       "to @production (--force promotes anyway, recorded on the version)\n")
    assert main(["promote", f"{NAME}/{version}", "--variant", "fp32", "--tracking-uri", store[1]]) == 0
    assert capsys.readouterr().out == f"promote: {NAME}/{version} -> @production (fp32: gates passed)\n"


def test_a_retrained_model_is_not_passed_on_the_earlier_model_s_verdict(store):
    cfg = _cfg(store, "retrained")
    benchmarked(cfg.run_dir(), b"first")
    first = _version(cfg)
    model(cfg.run_dir(), b"second")  # retrained; its benchmark has not run (or failed)
    second = _version(cfg)
    assert second != first
    assert _client(store[1]).get_model_version(NAME, second).tags["llmpipe.gates"] == "pending"


def test_an_edited_mlflow_json_cannot_judge_another_run_s_version(store, caplog):
    other = _cfg(store, "other")
    model(other.run_dir(), b"never benchmarked")
    theirs = _version(other)
    cfg = _cfg(store, "editor")
    benchmarked(cfg.run_dir(), b"passing model")
    ours = _version(cfg)
    state_file = cfg.run_dir() / "mlflow.json"
    state = json.loads(state_file.read_text())
    for entry in next(iter(state["stores"].values()))["versions"].values():
        entry["version"] = theirs  # point our passing model's entry at their version
    state_file.write_text(json.dumps(state))
    caplog.set_level(logging.WARNING, "llmpipe.tracking")
    assert _version(cfg) == ours
    assert f"tracking: mlflow.json's model version entry {NAME}/{theirs} is not this run's consolidated model " \
           "(another name, run or model); not used" in caplog.messages
    assert _client(store[1]).get_model_version(NAME, theirs).tags["llmpipe.gates"] == "pending"


def test_a_link_planted_in_a_run_folder_sends_nothing_outside_the_run_to_the_artifact_store(store, tmp_path):
    cfg = _cfg(store, "planted")
    model(cfg.run_dir(), b"model")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the run's")
    link = stage_dir(cfg.run_dir(), "consolidate") / "notes.txt"
    link.symlink_to(secret)
    (cfg.run_dir() / "report.html").symlink_to(secret)
    with pytest.raises(TrackingError) as err:
        tracking.backfill(cfg)
    assert str(err.value) == f"{link}: a link out of the run folder (to {secret}); not uploaded"
    state = json.loads((cfg.run_dir() / "mlflow.json").read_text())
    run_id = next(iter(state["stores"].values()))["run_id"]
    assert "report.html" not in {a.path for a in _client(store[1]).list_artifacts(run_id)}


def test_models_uri_refuses_a_run_folder_that_now_holds_another_model(store):
    cfg = _cfg(store, "rerun")
    benchmarked(cfg.run_dir(), b"first")
    version = _version(cfg)
    was = registry._manifest(cfg, "consolidate").content_digest()
    registry.promote(store[1], NAME, version, "stable", force=False)
    now = model(cfg.run_dir(), b"second")[0].content_digest()
    with pytest.raises(TrackingError) as err:
        registry.resolve(f"models:/{NAME}@stable", store[1])
    assert str(err.value) == (f"models:/{NAME}@stable is version {version}, consolidated model {was[:12]}, but its run "
                              f"folder {cfg.run_dir()} now holds consolidated model {now[:12]}; refusing to load "
                              "another model than the version")
