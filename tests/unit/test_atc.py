"""convert_om (llmpipe.export.atc): argv builder, ATC discovery, error parsing, and the stage run
against tests/fakes/atc, a script standing in for CANN's `atc` (which cannot exist here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmpipe import config, stages
from llmpipe.config import ConvertOmSection
from llmpipe.export import atc
from llmpipe.manifest import Manifest, file_entry
from llmpipe.stages import StageContext, StageError

FAKES = Path(__file__).resolve().parents[1] / "fakes"
FAKE_ATC = FAKES / "atc"

E10001_LOG = """\
ATC start working now, please wait for a moment.
W11001: Op [MatMul_3] does not hit the high-priority operator information library.
ATC run failed, Please check the detail log, Try 'atc --help' for more information
E10001: Value [linux] for parameter [--framework] is invalid. Reason: The value is not supported.
        Solution: try again with a valid argument.
        TraceBack (most recent call last):
        E19999: an internal code inside the traceback, not a block of its own
        Solution: not this one either
"""

EZ3003_LOG = """\
ATC run failed, Please check the detail log, Try 'atc --help' for more information
EZ3003: No supported Ops kernel and engine are found for [MatMulV2], optype [MatMulV2].
        Possible Cause: The operator is not supported by the system.
        Solution: 1. Check that the OPP component is installed properly.
        TraceBack (most recent call last):
        Assert ((SelectEngine(node_ptr)) == ge::SUCCESS) failed[FUNC:InferShapeAndType]
E19010: No parser is registered for Op [Foo], optype [Foo].
ERROR: not a code, only shouting
"""


@pytest.fixture(autouse=True)
def _no_real_cann(tmp_path, monkeypatch):
    """Keep a real CANN install (and the torch import behind llmpipe.device) out of every test."""
    monkeypatch.setattr(atc, "_toolkit_dirs", lambda: [str(tmp_path / "cann" / "latest")])
    for var in ("FAKE_ATC_MODE", "FAKE_ATC_RECORD"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def no_path_atc(tmp_path, monkeypatch):
    """PATH without any `atc` on it."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def python_on_path(monkeypatch):
    """The fake's `#!/usr/bin/env python3` finds this interpreter whatever PATH a machine has."""
    here = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join([here, os.environ.get("PATH", "")]))


def make_cfg(tmp_path: Path, **convert_om) -> config.RunConfig:
    return config.from_dict({"run": {"name": "t", "artifacts_dir": str(tmp_path / "artifacts")},
                             "data": {"inputs": ["x"]}, "convert_om": convert_om})


def make_ctx(tmp_path: Path, **convert_om) -> StageContext:
    """A StageContext whose export_onnx input is a dummy model.onnx."""
    cfg = make_cfg(tmp_path, **convert_om)
    folder = tmp_path / "04_export_onnx"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"not really onnx")
    manifest = Manifest(stage="export_onnx", status="completed", fingerprint="x",
                        outputs={"model": file_entry(folder, "model.onnx")})
    work = tmp_path / ".05_convert_om.partial"
    work.mkdir()
    return StageContext(cfg, "convert_om", tmp_path, work, {"export_onnx": (folder, manifest)}, "fp")


# --------------------------------------------------------------------------- build_argv


def test_build_argv_typical_config():
    section = ConvertOmSection(soc_version="Ascend910B", input_shape="input_ids:1,-1",
                               dynamic_dims="32;64;128", precision_mode_v2="fp16",
                               op_select_implmode="high_performance", log="error")
    assert atc.build_argv(section, "/opt/atc", Path("/m/model.onnx"), Path("/w/model")) == [
        "/opt/atc", "--framework=5", "--model=/m/model.onnx", "--output=/w/model", "--soc_version=Ascend910B",
        "--input_format=ND", "--input_shape=input_ids:1,-1", "--dynamic_dims=32;64;128",
        "--precision_mode_v2=fp16", "--op_select_implmode=high_performance", "--log=error",
    ]


def test_build_argv_defaults_and_precision_mode_v1():
    assert atc.build_argv(ConvertOmSection(), "atc", "m.onnx", "out") == [
        "atc", "--framework=5", "--model=m.onnx", "--output=out", "--soc_version=Ascend910B",
        "--input_format=ND", "--precision_mode_v2=fp16", "--log=error"]
    v1 = ConvertOmSection(precision_mode="allow_fp32_to_fp16", precision_mode_v2=None, log="info")
    argv = atc.build_argv(v1, "atc", "m.onnx", "out")
    assert "--precision_mode=allow_fp32_to_fp16" in argv
    assert not any(a.startswith("--precision_mode_v2") for a in argv)
    assert argv[-1] == "--log=info"


def test_precision_modes_are_exclusive():
    with pytest.raises(config.ConfigError, match="precision_mode or precision_mode_v2"):
        config.from_dict({"data": {"inputs": ["x"]},
                          "convert_om": {"precision_mode": "force_fp16", "precision_mode_v2": "fp16"}})
    fields = {**ConvertOmSection().model_dump(), "precision_mode": "force_fp16"}
    both = ConvertOmSection.model_construct(**fields)  # skips the validator, as a hand-built section could
    with pytest.raises(ValueError, match="not both"):
        atc.build_argv(both, "atc", "m.onnx", "out")


def test_dynamic_dims_over_several_inputs():
    section = ConvertOmSection(input_shape="input_ids:1,-1;attention_mask:1,-1", dynamic_dims="32,32;64,64")
    assert "--dynamic_dims=32,32;64,64" in atc.build_argv(section, "atc", "m.onnx", "out")


@pytest.mark.parametrize("input_shape, dynamic_dims, expected", [
    (None, "32;64", r"convert_om.dynamic_dims \('32;64'\) needs convert_om.input_shape"),
    ("input_ids:1,128", "32;64", "'input_ids:1,128' has none"),
    ("input_ids:1,-1", "32,1;64,1", r"gear 1 \('32,1'\) has 2 values, but convert_om.input_shape "
                                    "'input_ids:1,-1' has 1 -1 dims"),
    ("input_ids:-1,-1", "32;64", r"gear 1 \('32'\) has 1 values, .* has 2 -1 dims"),
    ("input_ids:1,-1", "32", "ATC takes 2 to 100 gears, got 1"),
    ("input_ids:1,-1", "32;x", r"gear 2 \('x'\) must be positive integers"),
])
def test_dynamic_dims_validation(input_shape, dynamic_dims, expected):
    section = ConvertOmSection(input_shape=input_shape, dynamic_dims=dynamic_dims)
    with pytest.raises(ValueError, match=expected):
        atc.build_argv(section, "atc", "m.onnx", "out")


# --------------------------------------------------------------------------- find_atc


def test_find_atc_via_atc_path(tmp_path):
    assert atc.find_atc(ConvertOmSection(atc_path=str(FAKE_ATC))) == str(FAKE_ATC)
    plain = tmp_path / "atc"
    plain.write_text("not executable")
    for bad in (plain, tmp_path / "missing"):
        with pytest.raises(StageError, match="convert_om.atc_path"):
            atc.find_atc(ConvertOmSection(atc_path=str(bad)))


def test_find_atc_via_path(monkeypatch):
    monkeypatch.setenv("PATH", str(FAKES))
    assert atc.find_atc(ConvertOmSection()) == str(FAKE_ATC)


def test_find_atc_in_cann_toolkit(tmp_path, no_path_atc):
    binary = tmp_path / "cann" / "latest" / "compiler" / "bin" / "atc"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert atc.find_atc(ConvertOmSection()) == str(binary)


def test_find_atc_none_when_absent(no_path_atc):
    assert atc.find_atc(ConvertOmSection()) is None


def test_fingerprint_extra(tmp_path, monkeypatch, no_path_atc):
    assert atc.fingerprint_extra(make_cfg(tmp_path)) == {"atc": None}
    assert atc.fingerprint_extra(make_cfg(tmp_path, atc_path=str(tmp_path / "gone"))) == {"atc": None}
    link = tmp_path / "bin" / "atc"
    link.parent.mkdir()
    link.symlink_to(FAKE_ATC)  # like CANN's ascend-toolkit/latest -> <version>
    monkeypatch.setenv("PATH", str(link.parent))
    assert atc.fingerprint_extra(make_cfg(tmp_path)) == {"atc": os.path.realpath(FAKE_ATC)}


# --------------------------------------------------------------------------- parse_errors


def test_parse_errors_e10001_block_without_traceback():
    assert atc.parse_errors(E10001_LOG) == [atc.AtcError(
        "E10001", "Value [linux] for parameter [--framework] is invalid. Reason: The value is not supported.",
        "try again with a valid argument.")]


def test_parse_errors_several_blocks():
    errors = atc.parse_errors(EZ3003_LOG)
    assert [e.code for e in errors] == ["EZ3003", "E19010"]
    assert errors[0].message == ("No supported Ops kernel and engine are found for [MatMulV2], "
                                 "optype [MatMulV2].")
    assert errors[0].solution == "1. Check that the OPP component is installed properly."
    assert errors[1].solution == ""
    assert str(errors[1]) == "E19010: No parser is registered for Op [Foo], optype [Foo]."


def test_failure_summary_without_code_is_last_line():
    assert atc.failure_summary("ATC start working now\nSegmentation fault (core dumped)\n\n") == \
        "Segmentation fault (core dumped)"
    assert atc.failure_summary("") == "(ATC printed nothing)"


# --------------------------------------------------------------------------- the fake itself


@pytest.mark.parametrize("extra, reason", [
    (["--bogus=1"], "parameter [--bogus] is invalid"),
    (["--precision_mode=force_fp16", "--precision_mode_v2=fp16"], "cannot be configured at the same time"),
])
def test_fake_atc_rejects_like_atc(tmp_path, python_on_path, extra, reason):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"x")
    argv = [str(FAKE_ATC), "--framework=5", f"--model={onnx}", f"--output={tmp_path / 'o'}",
            "--soc_version=Ascend910B", *extra]
    code, text = atc.run_atc(argv, tmp_path / "atc.log", timeout_s=60)
    assert code == 1
    assert atc.parse_errors(text)[0].code == "E10001"
    assert reason in atc.failure_summary(text)


# --------------------------------------------------------------------------- run(ctx)


def test_run_skipped_when_atc_absent(tmp_path, no_path_atc):
    result = atc.run(make_ctx(tmp_path))
    assert result.status == "skipped" and result.outputs == {}
    assert "ATC (CANN toolkit) not found on PATH or in" in result.reason
    assert str(tmp_path / "cann" / "latest") in result.reason
    assert "convert_om.required: true" in result.reason


def test_run_required_but_absent_fails(tmp_path, no_path_atc):
    with pytest.raises(StageError, match="convert_om.required is true but ATC was not found"):
        atc.run(make_ctx(tmp_path, required=True))


def test_run_success_with_fake_atc(tmp_path, monkeypatch, python_on_path):
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_ATC_RECORD", str(record))
    monkeypatch.setenv("FAKE_ATC_MODE", "success")
    ctx = make_ctx(tmp_path, atc_path=str(FAKE_ATC), input_shape="input_ids:1,-1", dynamic_dims="64;128")
    result = atc.run(ctx)

    assert result.status == "completed"
    assert result.outputs == {"om": "model.om", "log": "atc.log", "argv": "argv.json"}
    assert (ctx.work_dir / "model.om").stat().st_size > 0
    expected = atc.build_argv(ctx.cfg.convert_om, str(FAKE_ATC),
                              (tmp_path / "04_export_onnx" / "model.onnx").resolve(),
                              ctx.work_dir.resolve() / "model")
    argv = json.loads((ctx.work_dir / "argv.json").read_text())
    assert argv == expected == json.loads(record.read_text())
    assert "ATC run success" in (ctx.work_dir / "atc.log").read_text()
    assert result.metrics["atc"] == str(FAKE_ATC)
    assert result.metrics["om_bytes"] == (ctx.work_dir / "model.om").stat().st_size
    assert result.metrics["argv"] == expected


@pytest.mark.parametrize("mode, words", [
    ("fail-e10001", "E10001: Value [Ascend910B] for parameter [--soc_version] is invalid."),
    ("fail-ez3003", "EZ3003: No supported Ops kernel and engine are found for [MatMulV2], optype [MatMulV2]"),
])
def test_run_atc_error_becomes_stage_error(tmp_path, monkeypatch, python_on_path, mode, words):
    monkeypatch.setenv("FAKE_ATC_MODE", mode)
    with pytest.raises(StageError) as err:
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC)))
    message = str(err.value)
    assert message.startswith(f"ATC failed (exit 1): {words}")
    assert "Solution:" in message and "TraceBack" not in message and "\n" not in message


def test_run_no_om_is_an_error(tmp_path, monkeypatch, python_on_path):
    monkeypatch.setenv("FAKE_ATC_MODE", "no-om")
    with pytest.raises(StageError, match="ATC reported success but wrote no model.om"):
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC)))


def test_run_timeout_kills_atc(tmp_path, monkeypatch, python_on_path):
    monkeypatch.setenv("FAKE_ATC_MODE", "hang")
    with pytest.raises(StageError, match=r"convert_om.timeout_s=1 exceeded: ATC was killed"):
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), timeout_s=1))


def test_run_bad_dynamic_dims_is_a_stage_error(tmp_path, python_on_path, monkeypatch):
    with pytest.raises(config.ConfigError, match="convert_om.dynamic_dims"):  # refused when the config loads
        make_cfg(tmp_path, input_shape="input_ids:1,128", dynamic_dims="1;2")
    monkeypatch.setattr("llmpipe.config_checks.check_atc", lambda cfg: None)  # as a fields-only config
    with pytest.raises(StageError, match="convert_om.dynamic_dims"):
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), input_shape="input_ids:1,128", dynamic_dims="1;2"))


def test_suffixed_om_is_renamed(tmp_path):
    """Some ATC versions write <output>_<os>_<arch>.om; the stage's output is always model.om."""
    suffixed = tmp_path / "model_linux_x86_64.om"
    suffixed.write_bytes(b"om")
    assert atc._om_file(tmp_path / "model") == suffixed


# --------------------------------------------------------------------------- through run_stage


def _publish_export_onnx(cfg: config.RunConfig) -> None:
    """A finished export_onnx stage folder whose fingerprint matches `cfg`."""
    folder = stages.stage_dir(cfg.run_dir(), "export_onnx")
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"not really onnx")
    (folder / "parity.json").write_text("{}")
    Manifest(stage="export_onnx", status="completed", fingerprint=stages.fingerprints(cfg)["export_onnx"],
             outputs={"model": file_entry(folder, "model.onnx"), "parity": file_entry(folder, "parity.json")},
             ).write(folder)


def test_run_stage_records_skip_then_reruns_when_atc_appears(tmp_path, monkeypatch, no_path_atc):
    cfg = make_cfg(tmp_path)
    _publish_export_onnx(cfg)
    manifest, executed = stages.run_stage("convert_om", cfg)
    assert executed and manifest.status == "skipped" and "not found" in manifest.reason
    assert stages.run_stage("convert_om", cfg)[1] is False  # same machine: up to date

    monkeypatch.setenv("PATH", os.pathsep.join([str(FAKES), str(Path(sys.executable).parent)]))
    manifest, executed = stages.run_stage("convert_om", cfg)  # ATC appeared: fingerprint changed
    assert executed and manifest.status == "completed"
    assert set(manifest.outputs) == {"om", "log", "argv"}
    folder = stages.stage_dir(cfg.run_dir(), "convert_om")
    assert manifest.verify(folder) is None and (folder / "model.om").is_file()


def test_fake_atc_is_executable():
    assert os.access(FAKE_ATC, os.X_OK)
    out = subprocess.run([sys.executable, str(FAKE_ATC), "--nope"], capture_output=True, text=True)
    assert out.returncode == 1 and "E10001" in out.stdout
