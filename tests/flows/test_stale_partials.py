"""`llmpipe run` starts by removing what killed attempts of non-resumable stages left behind."""

from __future__ import annotations

import pytest

from llmpipe import stages
from tests.flows.test_pipeline import _write_config

pytestmark = pytest.mark.slow


def test_the_flow_removes_a_killed_export_s_partial_folder_when_it_starts(tmp_path, monkeypatch):
    from flows.train_to_deploy import train_to_deploy

    run_dir = tmp_path / "artifacts" / "flowtest"
    export, train = stages.partial_dir(run_dir, "export_onnx"), stages.partial_dir(run_dir, "train")
    for partial in (export, train):
        partial.mkdir(parents=True)
        (partial / "model.onnx").write_bytes(b"\0" * 1000)
    monkeypatch.setenv("LLMPIPE_FAIL_STAGE", "prepare_data")  # the flow need not get further than its start
    with pytest.raises(Exception, match="prepare_data: failure injected by LLMPIPE_FAIL_STAGE"):
        train_to_deploy(config=str(_write_config(tmp_path)), only=["prepare_data"])
    assert not export.exists() and (train / "model.onnx").is_file()
