"""No checkpoint llmpipe reads can run code: a pickle payload in DCP's .metadata or in a .pt file,
`"files": {}` in meta.json, or a file meta.json does not list makes the checkpoint unusable; the
newest verified one before it is used instead, and consolidate refuses it.

One FSDP2 training (1 gloo rank, 4 steps, checkpoints at steps 2 and 4) is shared by the module;
each test tampers with a copy of it.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmpipe.checkpoint import consolidate as consolidate_stage
from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint.dcp import DCP_DIR
from llmpipe.checkpoint.trust import SafeReader
from llmpipe.manifest import sha256_file
from llmpipe.stages import StageError
from tests.conftest import cached_runs

pytestmark = pytest.mark.slow


class _Payload:
    """Unpickling this runs `touch marker`: what a hostile checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    runs = cached_runs(tmp_path_factory, "trust", {"train__micro_batch_size": 4, "train__grad_accum_steps": 1,
                                                   "train__max_steps": 4})
    return runs("fsdp", nproc=1, train__parallel={"data": "fsdp"},
                train__checkpoint={"every_steps": 2, "keep_last": 3})


@pytest.fixture
def copy(fsdp_run, tmp_path) -> Path:
    """The run's checkpoints folder, copied: (step-000002, step-000004) both verified."""
    root = tmp_path / "checkpoints"
    shutil.copytree(fsdp_run / "checkpoints", root)
    assert [p.name for p in ckpt.list_steps(root)] == ["step-000002", "step-000004"]
    assert ckpt.latest_valid(root) == root / "step-000004"
    return root


def _relist(folder: Path) -> None:
    """Rewrite meta.json so it lists the folder's files with their current sha256 and sizes (a careful
    forger)."""
    meta = ckpt.read_meta(folder)
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ckpt.META]
    meta["files"] = {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}
    meta["bytes"] = {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}
    (folder / ckpt.META).write_text(json.dumps(meta))


def _consolidate(folder: Path, out: Path):
    """consolidate's run on `folder` as the checkpoint of a text run (no chat template; the tokenizer and
    data meta it copies stand in as the checkpoint's meta.json: only the weights are under test)."""
    cfg = SimpleNamespace(consolidate=SimpleNamespace(dtype="fp32", hf_layout=False),
                          data=SimpleNamespace(tokenizer=SimpleNamespace(eos_token="<|endoftext|>")),
                          model=SimpleNamespace(init_from=None))
    ctx = SimpleNamespace(cfg=cfg, work_dir=out, input_path=lambda stage, name: folder / ckpt.META,
                          inputs={"prepare_data": (folder, SimpleNamespace(metrics={}))})
    return consolidate_stage.run(ctx)


def test_a_dcp_metadata_pickle_payload_with_empty_files_is_refused_and_resume_falls_back(copy, tmp_path):
    newest, marker = copy / "step-000004", tmp_path / "marker"
    (newest / DCP_DIR / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (newest / ckpt.META).write_text(json.dumps({"format": "dcp", "step": 4, "files": {}}))
    assert "lists no files" in ckpt.verify(newest)
    _relist(newest)  # even with every file listed and hashed, the payload is refused by name
    problem = ckpt.verify(newest)
    assert f"{newest / DCP_DIR / '.metadata'} cannot be read safely" in problem
    assert "posix.system" in problem or "os.system" in problem
    assert ckpt.latest_valid(copy) == copy / "step-000002"
    with pytest.raises(StageError, match=r"step-000004/dcp/\.metadata cannot be read safely"):
        _consolidate(newest, tmp_path / "out")
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        SafeReader(newest / DCP_DIR).read_metadata()  # the loaders' own reader refuses it too
    assert not marker.exists()


def test_a_pt_file_with_a_pickle_payload_is_refused_and_names_the_file(copy, tmp_path):
    newest, marker = copy / "step-000004", tmp_path / "marker"
    target = next(p for p in sorted(newest.rglob("*.pt")))
    target.write_bytes(pickle.dumps(_Payload(marker)))
    _relist(newest)
    assert f"{target} cannot be read safely" in ckpt.verify(newest)
    assert ckpt.latest_valid(copy) == copy / "step-000002"
    assert not marker.exists()


def test_an_unlisted_extra_file_makes_the_checkpoint_unusable(copy, tmp_path):
    newest = copy / "step-000004"
    (newest / DCP_DIR / "extra.distcp").write_bytes(b"x")
    assert ckpt.verify(newest) == f"{newest / DCP_DIR / 'extra.distcp'} is not listed in {ckpt.META}"
    assert ckpt.latest_valid(copy) == copy / "step-000002"
    with pytest.raises(StageError, match="extra.distcp is not listed"):
        _consolidate(newest, tmp_path / "out")


def test_a_genuine_dcp_checkpoint_still_verifies_and_consolidates(copy, tmp_path):
    (tmp_path / "out").mkdir()
    result = _consolidate(copy / "step-000004", tmp_path / "out")
    assert result.metrics["step"] == 4 and result.metrics["tensors"] > 0
