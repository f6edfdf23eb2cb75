"""train.compile's checks before launch (a compiler for inductor, torchair on NPU) and what a comm hook
does to the train stage's fingerprint."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from llmpipe import device as dev
from llmpipe import preflight, stages
from llmpipe.config import ConfigError
from tests.unit.test_stages import _cfg


def test_inductor_without_a_cpp_compiler_is_one_line_before_launch(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "train.compile=true", "run.device=cpu")
    preflight.check_launch(cfg)  # g++ is on this machine's PATH
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError) as err:
        preflight.check_launch(cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("train.compile: inductor on cpu needs a C++ compiler"), msg
    preflight.check_launch(_cfg(tmp_path, "run.device=cpu"))  # without compile nothing is asked


def test_npu_without_torchair_is_refused_with_the_reason(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torchair(name, *a, **kw):
        if name == "torchair":
            raise ImportError("No module named 'torchair'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torchair)
    with pytest.raises(RuntimeError, match="train.compile on NPU needs torchair .*No module named 'torchair'"):
        dev.compile_backend(SimpleNamespace(type="npu", index=0))  # torch.device("npu") needs torch_npu


def test_a_compressing_hook_moves_trains_fingerprint_and_compile_does_not(tmp_path):
    base = stages.fingerprints(_cfg(tmp_path))
    assert stages.fingerprints(_cfg(tmp_path, "train.compile=true")) == base  # operational
    assert stages.fingerprints(_cfg(tmp_path, "train.parallel.comm_hook=none")) == base
    fp16 = stages.fingerprints(_cfg(tmp_path, "train.parallel.comm_hook=fp16"))
    assert fp16["train"] != base["train"] and fp16["prepare_data"] == base["prepare_data"]
    a = stages.fingerprints(_cfg(tmp_path, "train.parallel.comm_hook=powersgd"))
    b = stages.fingerprints(_cfg(tmp_path, "train.parallel.comm_hook=powersgd", "train.parallel.powersgd_rank=8"))
    assert len({a["train"], b["train"], fp16["train"]}) == 3
