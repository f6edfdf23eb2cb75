"""prepare_data's work units on Prefect's task runners: a local process pool and Dask (a 2-worker
LocalCluster), each giving the same bytes as the stage run without Prefect, one process."""

from __future__ import annotations

import pytest
import yaml

from llmpipe import stages
from llmpipe.config import load
from tests.unit.test_prepare_units import _digests, make_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    make_corpus(root / "in")
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "serial", "artifacts_dir": str(root / "artifacts"), "seed": 5},
        "data": {"inputs": [str(root / "in" / "*")], "seq_len": 16, "val_fraction": 0.1,
                 "tokenizer": {"vocab_size": 300}, "workers": 1, "unit_bytes": 1 << 16}}))
    cfg = load(str(config))
    stages.run_stage("prepare_data", cfg)  # no Prefect, one process: the reference
    return str(config), _digests(stages.stage_dir(cfg.run_dir(), "prepare_data"))


@pytest.mark.parametrize("engine", ["local", "dask"])
def test_units_run_on_the_engine_through_prefect_with_the_same_bytes(setup, engine):
    from prefect.client.orchestration import get_client

    from flows.train_to_deploy import train_to_deploy

    config, reference = setup
    overrides = [f"run.name={engine}", f"data.engine={engine}", "data.workers=2"]
    results = train_to_deploy(config=config, overrides=overrides, only=["prepare_data"])
    assert results["prepare_data"]["executed"]
    cfg = load(config, overrides)
    assert _digests(stages.stage_dir(cfg.run_dir(), "prepare_data")) == reference
    with get_client(sync_client=True) as client:  # one task run per work unit, in Prefect
        runs = client.read_task_runs()
    units = results["prepare_data"]["metrics"]["units"]
    assert sum(1 for r in runs if r.name.startswith("tokenize_unit")) >= units
