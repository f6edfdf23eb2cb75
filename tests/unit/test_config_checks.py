"""What the config alone can tell is refused when it loads, before any stage runs; what goes wrong on
disk (a full disk, an artifacts_dir that is a file, an unwritable report) is one line; status and
report act on the run folder asked for, also a copied one."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import pytest
import yaml

from llmpipe import cli, preflight
from llmpipe import config as config_mod
from llmpipe.config import ConfigError
from llmpipe.tools import report
from llmpipe.train import launch
from tests.conftest import ROOT, make_cfg

TINY = ROOT / "configs" / "tiny.yaml"
RECIPE = ROOT / "configs" / "llama7b_64dev.yaml"
ENOSPC = os.strerror(errno.ENOSPC)


def _write_config(tmp_path: Path, **sections) -> Path:
    """A small CPU config (4 short files, a 280-token vocabulary) whose prepare_data takes a second."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i} has some words in it. " * 40)
    tree = {"run": {"name": "base", "artifacts_dir": str(tmp_path / "artifacts")},
            "data": {"inputs": [str(corpus / "*.txt")], "seq_len": 16, "val_fraction": 0.25,
                     "tokenizer": {"vocab_size": 280}}, **sections}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _last_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    return lines[-1] if lines else ""


# -- item 14: the config alone, at load -------------------------------------------------------------

LOAD_CASES = [
    (["model.flavor=no-such-model"], "model.flavor: unknown flavor 'no-such-model' (known: debug, tiny,"),
    (["model.n_heads=5"], "model.dim=192 is not divisible by model.n_heads=5"),
    (["data.seq_len=2048"], "data.seq_len=2048 exceeds the model's max_seq_len=1024"),
    (["train.parallel.tp=4"], "train.parallel: tp=4 does not divide model.n_heads=6"),
    (["train.parallel.tp=3"], "train.parallel: tp=3 does not divide model.n_kv_heads=2"),
    (["model.flavor=debug", "train.parallel.pp=3", "train.parallel.pp_schedule=gpipe"],
     "train.parallel: pp=3 exceeds the model's 2 layers"),
    (["train.parallel.pp=2", "train.parallel.split_points=[9]"],
     "train.parallel: split_points [9] must be strictly increasing within 1..3 (the model has 4 layers)"),
    (["train.parallel.pp=2", "train.parallel.pp_schedule=interleaved_1f1b", "train.parallel.virtual_stages=3",
      "train.parallel.microbatches=4"], "the model's 4 layers do not divide into pp=2 x virtual_stages=3"),
    (["train.parallel.pp=2", "train.micro_batch_size=6"],
     "train.parallel: pp: micro_batch_size=6 does not split into microbatches=4"),
    (["train.parallel.tp=2", "train.precision.dtype=fp16"], "train.precision.dtype=fp16 is not supported with tp/pp"),
    (["convert_om.input_shape=1,128"], "convert_om.input_shape: '1,128' in '1,128' is not 'name:d1,d2,...'"),
    (["convert_om.input_shape=input_ids:1,x"], "convert_om.input_shape: 'input_ids:1,x'"),
    (["convert_om.input_shape=input_ids:1,128", "convert_om.dynamic_dims=32;64"],
     "convert_om.dynamic_dims ('32;64') needs -1 dims in convert_om.input_shape, "
                                        "but 'input_ids:1,128' has none"),
    (["convert_om.input_shape=input_ids:1,-1", "convert_om.dynamic_dims='32'"], "ATC takes 2 to 100 gears, got 1"),
    (["train.max_steps=10000001"], "train.max_steps: Input should be less than or equal to 10000000"),
    (["train.parallel.data=fsdp", "train.parallel.comm_hook=fp16"],
     "comm_hook=fp16 applies to torch DDP only (data=ddp, tp=1, pp=1); got data=fsdp, tp=1, pp=1"),
    (["train.parallel.tp=2", "train.parallel.comm_hook=powersgd"], "comm_hook=powersgd applies to torch DDP only"),
    (["train.parallel.start_powersgd_iter=1"], "start_powersgd_iter: Input should be greater than or equal to 2"),
    (["train.compile=true", "train.parallel.data=zero", "train.parallel.zero_stage=3"],
     "compile=true does not work with ZeRO-3"),
    (["train.compile=true", "train.parallel.tp=2"], "compile=true with tp > 1 is refused"),
]


@pytest.mark.parametrize("overrides, expected", LOAD_CASES, ids=[" ".join(o) for o, _ in LOAD_CASES])
def test_what_the_config_alone_tells_is_refused_at_load_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as err:
        config_mod.load(TINY, overrides)
    msg = str(err.value)
    assert msg.startswith(f"{TINY}: ") and expected in msg and "\n" not in msg, msg


@pytest.mark.parametrize("overrides", [
    ["convert_om.input_shape=input_ids:1,-1", "convert_om.dynamic_dims=32;64;128"],
    ["convert_om.input_shape=input_ids:1~4,-1;attention_mask:1~4,-1", "convert_om.dynamic_dims=32,32;64,64"],
    ["train.parallel.tp=2", "train.parallel.dp=4"],  # 8 ranks: only the launch check looks at the world size
    ["train.max_steps=10000000"],
])
def test_consistent_configs_load(overrides):
    config_mod.load(TINY, overrides)


def test_plan_and_dryrun_still_take_any_world_size(capsys):
    cfg = config_mod.load(RECIPE)  # dp8 x tp4 x pp2 with nproc_per_node 8 and no hostfile: loads
    assert (cfg.train.parallel.dp, cfg.train.nproc_per_node) == (8, 8)
    assert cli.main(["plan", str(TINY), "--world-size", "8", "--set", "train.parallel.tp=2", "--json"]) == 0
    assert '"world_size": 8' in capsys.readouterr().out
    assert cli.main(["dryrun", str(TINY), "--world-size", "4", "--set", "train.parallel.tp=2"]) == 0
    assert "dp 2 = 32 sequences" in capsys.readouterr().out


def test_a_bad_flavor_through_llmpipe_run_fails_before_any_stage(tmp_path, capsys):
    config = _write_config(tmp_path, model={"flavor": "no-such-model"})
    assert cli.main(["run", str(config)]) == 2
    line = _last_error(capsys)
    assert line.startswith("error: ") and "model.flavor: unknown flavor 'no-such-model'" in line, line
    assert not (tmp_path / "artifacts").exists()  # prepare_data never ran


def test_a_layout_that_does_not_fit_the_launch_fails_before_prepare_data(tmp_path, capsys):
    config = _write_config(tmp_path, train={"nproc_per_node": 2, "parallel": {"tp": 2, "dp": 2}})
    assert cli.main(["run", str(config)]) == 2
    line = _last_error(capsys)
    assert line == (f"error: {config}: train.parallel: dp=2 x tp=2 x pp=1 = 4, but world size is 2 "
                    "(world size 2 = nproc_per_node 2 x 1 node(s))"), line
    assert not (tmp_path / "artifacts" / "base" / "01_prepare_data").exists()


def test_the_launch_check_counts_the_hostfile_and_names_it_when_it_is_absent(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    cfg = make_cfg(tmp_path, train__nproc_per_node=2, train__hostfile=str(hostfile))
    assert launch.launch_world(cfg) == (4, 2)
    preflight.check_launch(cfg)  # dp inferred: 4 / (1 x 1)
    gone = make_cfg(tmp_path, train__hostfile=str(tmp_path / "elsewhere"), train__parallel={"dp": 64})
    assert launch.launch_world(gone) is None  # a fingerprint computed here does not need it
    with pytest.raises(ConfigError) as err:  # a run that will train does (issue 22 item 5)
        preflight.check_launch(gone)
    assert str(err.value) == (f"train.hostfile: {tmp_path / 'elsewhere'} is missing or lists no hosts "
                              "('host slots=N' per line)")


def test_the_launch_check_applies_only_to_a_run_that_will_train(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, train__nproc_per_node=1, train__parallel={"dp": 8})
    preflight.check_before_run(cfg, ["export_onnx", "benchmark"], force=False)  # no training
    with pytest.raises(ConfigError, match=r"^x.yaml: train.parallel: dp=8 x tp=1 x pp=1 = 8, but world size is 1"):
        preflight.check_before_run(cfg, ["prepare_data", "train"], force=False, source="x.yaml")
    # trained already (on a cluster, say): a later run elsewhere goes on without the launch settings
    monkeypatch.setattr("llmpipe.stages.state", lambda cfg, name, fp, full: ("done", None))
    preflight.check_before_run(cfg, ["prepare_data", "train", "consolidate"], force=False)
    with pytest.raises(ConfigError, match="but world size is 1"):
        preflight.check_before_run(cfg, ["train"], force=True)


def test_set_value_that_is_not_yaml_is_refused_not_taken_as_text():
    for value in ("[1, 2", "*.txt"):
        with pytest.raises(ConfigError) as err:
            config_mod.load(TINY, [f"data.inputs={value}"])
        msg = str(err.value)
        assert msg.startswith(f"--set data.inputs={value}: the value is not valid YAML (") and "quote" in msg, msg
    cfg = config_mod.load(TINY, ["data.text_field=\"*body\"", "convert_om.input_shape=input_ids:1,128",
                                 "convert_om.dynamic_dims=null"])
    assert cfg.data.text_field == "*body"  # quoted: the string itself


# -- item 8: one line for what goes wrong on disk ----------------------------------------------------

@pytest.mark.parametrize("sub", ["", "/runs"])
def test_artifacts_dir_that_is_a_file_is_one_line_naming_it(tmp_path, capsys, sub):
    config = _write_config(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code = cli.main(["stage", "prepare_data", str(config), "--set", f"run.artifacts_dir={blocker}{sub}"])
    line = _last_error(capsys)
    assert code == 2 and line.startswith(f"error: {config}: run.artifacts_dir: '{blocker}{sub}' is not a folder"), line
    assert line.endswith(f"({blocker} is a file)") == bool(sub), line


def test_a_full_disk_during_a_stage_is_one_line_with_the_path_and_no_output(tmp_path, capsys, monkeypatch):
    from llmpipe.data import shards

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, ENOSPC, str(self.bin_path))

    monkeypatch.setattr(shards.ShardWriter, "add_documents", full)
    config = _write_config(tmp_path)
    assert cli.main(["stage", "prepare_data", str(config)]) == 1
    line = _last_error(capsys)
    assert line.startswith("error: ") and line.endswith(".bin: no space left on device"), line
    assert not (tmp_path / "artifacts" / "base" / "01_prepare_data").exists()  # nothing published


def test_an_os_error_without_a_path_names_the_run_folder(tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, ENOSPC)  # what a plain file.write() on a full disk raises

    monkeypatch.setattr("llmpipe.stages.run_stage", full)
    assert cli.main(["stage", "prepare_data", str(_write_config(tmp_path)), "--run-name", "r2"]) == 1
    assert _last_error(capsys) == f"error: {(tmp_path / 'artifacts' / 'r2').resolve()}: no space left on device"


def test_a_report_that_cannot_be_written_is_a_warning_and_leaves_nothing(tmp_path, caplog):
    cfg = make_cfg(tmp_path)
    cfg.run_dir().mkdir(parents=True)
    tmp = cfg.run_dir() / f".{report.REPORT}.tmp"
    tmp.symlink_to("/dev/full")  # every write there fails with ENOSPC, as on a full disk
    with caplog.at_level(logging.WARNING, logger="llmpipe.report"):
        path = report.write(cfg)  # no exception: the flow calls this in a finally
    assert path == cfg.run_dir() / report.REPORT and not path.exists() and not os.path.lexists(tmp)
    assert "report not written" in caplog.text and ENOSPC in caplog.text, caplog.text


# -- item 12: status and report on a copied run ------------------------------------------------------

def test_status_and_report_on_a_copied_run_act_on_the_copy(tmp_path, capsys):
    config = _write_config(tmp_path)
    assert cli.main(["stage", "prepare_data", str(config)]) == 0
    artifacts = tmp_path / "artifacts"
    shutil.copytree(artifacts / "base", artifacts / "copy2", symlinks=True)  # cp -a
    base_report = artifacts / "base" / report.REPORT
    before = (base_report.read_bytes(), base_report.stat().st_mtime_ns)
    capsys.readouterr()

    assert cli.main(["status", "copy2", "--artifacts-dir", str(artifacts)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run copy2: {(artifacts / 'copy2').resolve()}", out
    assert "prepare_data   done" in out, out

    assert cli.main(["report", "copy2", "--artifacts-dir", str(artifacts)]) == 0
    written = artifacts / "copy2" / report.REPORT
    assert f"report: {written.resolve()}" in capsys.readouterr().out
    assert "<h1>llmpipe run copy2</h1>" in written.read_text()
    assert (base_report.read_bytes(), base_report.stat().st_mtime_ns) == before  # the original untouched


# -- issue 22 item 5: what the config alone can tell, before prepare_data ---------------------------

def _refused_by_run(config: Path, capsys, tmp_path: Path, *extra: str) -> str:
    """`llmpipe run CONFIG` exits 2 with one error line, and prepare_data never started."""
    assert cli.main(["run", str(config), *extra]) == 2
    line = _last_error(capsys)
    assert line.startswith(f"error: {config}: "), line
    assert not (tmp_path / "artifacts" / "base" / "01_prepare_data").exists()
    assert not list((tmp_path / "artifacts").glob("base/.01_prepare_data*"))
    return line.removeprefix(f"error: {config}: ")


def test_a_kv_cache_len_above_max_seq_len_fails_llmpipe_run_before_prepare_data(tmp_path, capsys):
    config = _write_config(tmp_path, export={"kv_cache_len": 2048})  # tiny: max_seq_len 1024
    assert _refused_by_run(config, capsys, tmp_path) == "export.kv_cache_len=2048 exceeds the model's max_seq_len=1024"


def test_convert_om_required_without_atc_fails_llmpipe_run_before_prepare_data(tmp_path, capsys, monkeypatch):
    from llmpipe.export import atc

    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no atc on PATH, and no CANN toolkit where it is looked for
    monkeypatch.setattr(atc, "_toolkit_dirs", lambda: [str(tmp_path / "cann" / "latest")])
    config = _write_config(tmp_path, convert_om={"required": True})
    assert _refused_by_run(config, capsys, tmp_path) == (
        f"convert_om.required is true but ATC was not found (PATH, CANN toolkit in {tmp_path / 'cann' / 'latest'}); "
        "install CANN and source set_env.sh, or set convert_om.atc_path")


def test_a_convert_om_atc_path_that_is_not_executable_fails_llmpipe_run_before_prepare_data(tmp_path, capsys):
    config = _write_config(tmp_path, convert_om={"atc_path": str(tmp_path / "no-atc")})
    assert _refused_by_run(config, capsys, tmp_path) == (
        f"convert_om.atc_path: {str(tmp_path / 'no-atc')!r} is not an executable file")


def test_the_atc_check_applies_only_when_convert_om_will_run(tmp_path, monkeypatch):
    from llmpipe.export import atc

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(atc, "_toolkit_dirs", lambda: [str(tmp_path / "cann")])
    cfg = make_cfg(tmp_path, convert_om={"required": True})
    preflight.check_before_run(cfg, ["prepare_data", "train", "consolidate", "export_onnx"], force=False)
    with pytest.raises(ConfigError, match=r"^x.yaml: convert_om.required is true but ATC was not found"):
        preflight.check_before_run(cfg, ["convert_om", "benchmark"], force=False, source="x.yaml")
    fake = make_cfg(tmp_path, convert_om={"required": True, "atc_path": str(ROOT / "tests" / "fakes" / "atc")})
    preflight.check_before_run(fake, ["convert_om"], force=True)  # the stage's own search finds it
    monkeypatch.setattr("llmpipe.stages.state", lambda cfg, name, fp, full: ("done", None))
    preflight.check_before_run(cfg, ["convert_om", "benchmark"], force=False)  # converted already


def test_an_unknown_soc_version_fails_llmpipe_run_naming_the_closest_names(tmp_path, capsys):
    config = _write_config(tmp_path, convert_om={"soc_version": "Ascend910b3"})
    assert _refused_by_run(config, capsys, tmp_path) == (
        "convert_om.soc_version: 'Ascend910b3' is not an Ascend SoC that ATC knows "
        "(closest: Ascend910B3, Ascend910B, Ascend910B4, Ascend910B2)")


def test_every_soc_name_plan_deploy_sizes_for_that_atc_compiles_for_is_known(tmp_path):
    from llmpipe.export.atc_args import SOC_VERSIONS
    from llmpipe.tools import plan_deploy

    for name in ("Ascend910B", "Ascend910B1", "Ascend910B2", "Ascend910B3", "Ascend910B4", "Ascend310P3"):
        assert name in plan_deploy.DEVICES and name in SOC_VERSIONS
        config_mod.load(TINY, [f"convert_om.soc_version={name}"])


def test_a_missing_hostfile_fails_llmpipe_run_before_prepare_data(tmp_path, capsys):
    config = _write_config(tmp_path, train={"hostfile": str(tmp_path / "hosts")})
    assert _refused_by_run(config, capsys, tmp_path) == (
        f"train.hostfile: {tmp_path / 'hosts'} is missing or lists no hosts ('host slots=N' per line)")


def test_llmpipe_stage_train_checks_the_hostfile_before_the_stage_runs(tmp_path, capsys):
    config = _write_config(tmp_path, train={"hostfile": str(tmp_path / "hosts")})
    assert cli.main(["stage", "train", str(config)]) == 2  # not "train needs prepare_data" (exit 1)
    assert _last_error(capsys) == (f"error: {config}: train.hostfile: {tmp_path / 'hosts'} is missing or lists "
                                   "no hosts ('host slots=N' per line)")


def test_a_missing_hostfile_is_not_needed_by_a_run_that_does_not_train(tmp_path):
    cfg = make_cfg(tmp_path, train__hostfile=str(tmp_path / "hosts"))
    preflight.check_before_run(cfg, ["benchmark"], force=False)  # --only benchmark, on another machine


@pytest.mark.parametrize("llm, expected", [
    ({"prompt_lens": [32, 1024]}, "benchmark.llm.prompt_lens: 1024 does not fit the static decoder's cache of "
                                  "1024 slots (export.kv_cache_len): prompts up to 1023 tokens"),
    ({"decode_prompt_len": 1000, "new_tokens": 32}, "benchmark.llm: decode_prompt_len=1000 + new_tokens=32 does "
                                                    "not fit the static decoder's cache of 1024 slots "
                                                    "(export.kv_cache_len): their sum can be at most 1025"),
], ids=["prompt_lens", "decode_prompt_len"])
def test_benchmark_prompts_beyond_the_static_cache_fail_llmpipe_run_before_prepare_data(tmp_path, capsys, llm,
                                                                                         expected):
    config = _write_config(tmp_path, benchmark={"llm": llm})
    assert _refused_by_run(config, capsys, tmp_path) == expected


def test_benchmark_prompts_are_held_to_the_model_without_a_static_decoder():
    config_mod.load(TINY, ["export.static_decoder=false", "benchmark.llm.prompt_lens=[1024]"])  # torch's cache
    with pytest.raises(ConfigError, match=r"benchmark.llm.prompt_lens: 1025 does not fit the model's "
                                          r"max_seq_len=1024: prompts up to 1024 tokens$"):
        config_mod.load(TINY, ["export.static_decoder=false", "benchmark.llm.prompt_lens=[1025]"])
    config_mod.load(TINY, ["export.kv_cache_len=600", "benchmark.llm.prompt_lens=[599]"])


def _checkpoint(root: Path, model: dict) -> Path:
    """A checkpoint folder as the train loop writes it (one file, meta.json with the model last)."""
    from llmpipe.checkpoint import io as ckpt

    def write(folder: Path) -> list[Path]:
        (folder / ckpt.MODEL).write_bytes(b"weights")
        return [folder / ckpt.MODEL]

    return ckpt.save(root, 3, write, {"format": "full", "strategy": "DDPStrategy", "world_size": 1, "model": model})


def test_a_resume_checkpoint_of_another_model_fails_llmpipe_run_before_prepare_data(tmp_path, capsys):
    from llmpipe.models.llama import FLAVORS

    other = _checkpoint(tmp_path / "ckpt", FLAVORS["debug"].to_dict())  # the config trains tiny
    config = _write_config(tmp_path, train={"checkpoint": {"resume": str(other)}})
    assert _refused_by_run(config, capsys, tmp_path) == (
        f"train.checkpoint.resume: {other} holds another model than the config's: dim 64 (config 192), "
        "n_layers 2 (config 4), n_heads 4 (config 6), ffn_dim 176 (config 512), max_seq_len 512 (config 1024)")


def test_a_resume_checkpoint_of_the_same_model_passes_and_a_broken_one_is_named(tmp_path):
    from llmpipe.models.llama import model_args

    cfg = make_cfg(tmp_path)
    same = _checkpoint(tmp_path / "same", model_args(cfg.model, vocab_size=999).to_dict())  # any vocabulary
    preflight.check_resume(make_cfg(tmp_path, train__checkpoint={"resume": str(same)}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text("[" * 100_000)  # nested past the parser's stack
    for folder, problem in ((tmp_path / "none", "missing or unreadable"), (broken, "missing or unreadable")):
        with pytest.raises(ConfigError) as err:
            preflight.check_resume(make_cfg(tmp_path, train__checkpoint={"resume": str(folder)}))
        assert str(err.value) == f"train.checkpoint.resume: {folder / 'meta.json'} {problem}"


def test_the_default_benchmark_prompts_are_cut_to_a_short_context_and_explicit_ones_refused(tmp_path):
    cfg = make_cfg(tmp_path, export={"kv_cache_len": 100})  # defaults [32, 128]: 128 cannot fit 100 slots
    assert cfg.benchmark.llm.prompt_lens == [32]
    with pytest.raises(ConfigError, match=r"benchmark.llm.prompt_lens: 128 does not fit the static decoder's cache "):
        make_cfg(tmp_path, export={"kv_cache_len": 100}, benchmark={"llm": {"prompt_lens": [32, 128]}})
