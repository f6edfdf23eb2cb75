"""`llmpipe tune buckets`: a two-value sweep on 2 gloo ranks prints one row per value with the best marked
and the planner's estimate beside it, --write sets the winner in the config file with its comments kept,
and a layout without a bucket size, or bad input, is one line and a non-zero exit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from llmpipe import cli
from llmpipe import config as config_mod
from llmpipe.stages import stage_dir
from llmpipe.tools import tune, tune_write

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^(?P<best>[* ]) +(?P<mb>[\d.e-]+) +(?P<buckets>\d+) +(?P<tok>[\d,]+) +(?P<comm>[\d.]+) +"
                 r"(?P<overlapped>[\d.]+) +(?P<step>[\d.]+) +(?P<plan>[\d.]+)")
CONFIG = """\
# a tiny run for the bucket sweep
run:
  name: sweep
  artifacts_dir: {artifacts}
  device: cpu
  seed: 5

data:
  inputs: ["{corpus}/*.txt"]
  seq_len: 32
  val_fraction: 0.2
  tokenizer: {{vocab_size: 300}}

model: {{flavor: debug}}

train:
  nproc_per_node: 2
  micro_batch_size: 4
  max_steps: 40          # the real run's length (the sweep trains its own few steps)
  threads_per_proc: 1
  parallel:
    data: ddp
    bucket_cap_mb: 25    # DDP's default
    static_graph: true
  checkpoint: {{every_steps: 5}}
"""


def _config(tmp_path: Path, **parallel) -> Path:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i in range(12):
            (corpus / f"d{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(600)))
    path = tmp_path / "sweep.yaml"
    path.write_text(CONFIG.format(artifacts=tmp_path / "artifacts", corpus=corpus))
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr's `error:` lines) of `llmpipe ARGV`."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, [ln for ln in err.splitlines() if ln.startswith("error:")]


@pytest.mark.slow
def test_a_two_value_sweep_prints_a_row_per_value_marks_the_fastest_and_writes_it(tmp_path, capsys):
    path = _config(tmp_path)
    original = path.read_text()
    code, out, errors = _cli(capsys, "tune", "buckets", str(path), "--values", "0.05,1", "--steps", "6", "--write")
    assert code == 0 and not errors, out
    rows = [m for ln in out.splitlines() if (m := ROW.match(ln))]
    assert [float(r["mb"]) for r in rows] == [0.05, 1.0]
    for r in rows:
        assert float(r["tok"].replace(",", "")) > 0 and float(r["comm"]) >= 0 and float(r["step"]) > 0
        assert float(r["overlapped"]) >= 0
    marked = [r for r in rows if r["best"] == "*"]
    assert len(marked) == 1
    fastest = max(rows, key=lambda r: float(r["tok"].replace(",", "")))
    assert marked[0]["mb"] == fastest["mb"]
    assert f"best: bucket_cap_mb={float(fastest['mb']):g}" in out
    # the planner: one latency per bucket over the same volume, so fewer, larger buckets estimate less
    small, large = rows
    assert int(small["buckets"]) > int(large["buckets"]) >= 1
    assert float(small["plan"]) > float(large["plan"]) > 0
    for r in rows:  # what `llmpipe plan` says for that bucket size
        code, plan_out, _ = _cli(capsys, "plan", str(path), "--json", "--set",
                                 f"train.parallel.bucket_cap_mb={r['mb']}")
        p = json.loads(plan_out)
        assert p["collectives"] == int(r["buckets"])
        assert (p["sync_s"] + p["latency_s"]) * 1e3 == pytest.approx(float(r["plan"]), abs=6e-4)

    # the sweep trained in scratch folders, with prepare_data through the stage machinery; no train stage
    cfg = config_mod.load(path.with_name("sweep.yaml.bak"))
    run = cfg.run_dir()
    assert (stage_dir(run, "prepare_data") / "manifest.json").is_file()
    assert not stage_dir(run, "train").exists() and not (run / ".02_train.partial").exists()
    for mb in ("0.05", "1"):
        folder = run / "tune" / f"buckets-{mb}"
        assert (folder / "profile" / "breakdown_rank0.json").is_file()
        assert not (folder / "checkpoints").exists()

    # --write: the one line changed in place, comments kept, the original kept, the file loads
    best = float(fastest["mb"])
    written = path.read_text()
    assert path.with_name("sweep.yaml.bak").read_text() == original
    assert written == original.replace("bucket_cap_mb: 25 ", f"bucket_cap_mb: {best:g} ")
    assert "# DDP's default" in written and "# a tiny run for the bucket sweep" in written
    assert config_mod.load(path).train.parallel.bucket_cap_mb == best
    assert f"wrote train.parallel.bucket_cap_mb: {best:g} to {path}" in out


@pytest.mark.parametrize("argv, message", [
    (["--set", "train.parallel.data=fsdp"], "data=fsdp (FSDP2) has no bucket size"),
    (["--set", "train.parallel.tp=2"], "with tp=2, pp=1 data=ddp is FSDP2's replicate"),
    (["--set", "train.parallel.data=zero", "--set", "train.parallel.zero_stage=1"], "data=zero does not use it"),
    (["--nproc", "1"], "needs at least 2 ranks"),
    (["--values", "5,0"], "bucket_cap_mb must be a positive number of MB (got 0)"),
    (["--values", "5,x"], "'x' is not a number"),
    (["--steps", "3"], "--steps 3: at least 4"),
    (["--repeats", "0"], "--repeats 0: must be >= 1"),
    (["--set", "train.parallel.bucket_size=5"], "train.parallel.bucket_size: unknown key"),
])
def test_a_layout_without_a_bucket_size_or_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, capsys, argv,
                                                                                    message):
    path = _config(tmp_path)
    code, out, errors = _cli(capsys, "tune", "buckets", str(path), *argv)
    assert code != 0 and len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "artifacts").exists()  # refused before anything ran


def test_a_config_that_does_not_load_is_one_line(tmp_path, capsys):
    code, _, errors = _cli(capsys, "tune", "buckets", str(tmp_path / "missing.yaml"))
    assert code == 2 and errors == [f"error: {tmp_path / 'missing.yaml'}: config file not found"]


def test_repeats_take_turns_and_a_lead_smaller_than_the_runs_spread_is_called_a_tie(tmp_path, monkeypatch):
    cfg = config_mod.load(_config(tmp_path))
    order: list[str] = []
    rate = {"buckets-1-r1": 1000.0, "buckets-5-r1": 1100.0, "buckets-1-r2": 1050.0, "buckets-5-r2": 900.0}

    def fake_measure(pcfg, data_dir, folder):  # one profiled step of 100 ms at the run's rate
        order.append(folder.name)
        return [{"step_ms": 100.0, "tokens_per_s": rate[folder.name], "communication_ms": 1.0,
                 "communication_background_ms": 2.0}]

    monkeypatch.setattr(tune, "measure", fake_measure)
    monkeypatch.setattr("llmpipe.stages.run_stage", lambda name, cfg: None)
    (tune.tune_dir(cfg) / "buckets-7").mkdir(parents=True)  # a previous sweep's: removed
    points = tune.bucket_sweep(cfg, [1.0, 5.0], steps=6, repeats=2)
    assert order == ["buckets-1-r1", "buckets-5-r1", "buckets-1-r2", "buckets-5-r2"]
    assert not (tune.tune_dir(cfg) / "buckets-7").exists()
    assert [p.tokens_per_s for p in points] == [1025.0, 1000.0]  # all of a value's tokens over all its time
    assert [round(p.spread, 3) for p in points] == [0.05, 0.222]
    table = tune.format_table(cfg, points, 6, 100.0)
    assert "2 runs per value taking turns" in table and "runs apart" in table
    assert "best: bucket_cap_mb=1 (1,025 tokens/s; 2.5% ahead of 5, less than their runs differ: a tie" in table


# -- --write's text edit ------------------------------------------------------------------------------

def test_the_demo_configs_flow_style_value_is_edited_in_place():
    text = (ROOT / "configs" / "tiny.yaml").read_text()
    new = tune_write.edit_text(text, 5.0)
    assert new == text.replace("{data: ddp, bucket_cap_mb: 25,", "{data: ddp, bucket_cap_mb: 5,")


@pytest.mark.parametrize("text, expected", [
    ("train:\n  max_steps: 5\n  parallel:   # layout\n    data: ddp\n  log_every: 1\n",
     "train:\n  max_steps: 5\n  parallel:   # layout\n    bucket_cap_mb: 0.5\n    data: ddp\n  log_every: 1\n"),
    ("run: {name: x}\ntrain:\n    max_steps: 5  # short\nmodel: {flavor: debug}\n",
     "run: {name: x}\ntrain:\n    parallel:\n        bucket_cap_mb: 0.5\n    max_steps: 5  # short\n"
     "model: {flavor: debug}\n"),
    ("train:\n  parallel: {}\n", "train:\n  parallel: {bucket_cap_mb: 0.5}\n"),
    ("# only a run\nrun: {name: x}\n", "# only a run\nrun: {name: x}\ntrain:\n  parallel:\n    bucket_cap_mb: 0.5\n"),
    ("train:\n  parallel:\n    data: ddp\n    # bucket_cap_mb: 3 was slow\n",
     "train:\n  parallel:\n    bucket_cap_mb: 0.5\n    data: ddp\n    # bucket_cap_mb: 3 was slow\n"),
])
def test_a_missing_bucket_size_is_inserted_under_train_parallel(text, expected):
    assert tune_write.edit_text(text, 0.5) == expected


@pytest.mark.parametrize("text", [
    "train: {max_steps: 5, parallel: {data: ddp}}\n",  # train in flow style
    "train:\n  parallel: {bucket_cap_mb: 5}\nnotes:\n  bucket_cap_mb: 7\n",  # two of them
    "train:\n  parallel: &p {bucket_cap_mb: 5}\nother: *p\n",  # shared by an alias: would change both
])
def test_a_file_without_one_clear_place_for_the_value_is_not_edited(tmp_path, capsys, text):
    assert tune_write.edit_text(text, 10.0) is None
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(tune.TuneError, match=r"set train.parallel.bucket_cap_mb: 10 there yourself"):
        tune_write.write_bucket_cap(path, 10.0)
    assert path.read_text() == text and not path.with_name("odd.yaml.bak").exists()


def test_a_small_value_is_written_as_a_yaml_float():
    new = tune_write.edit_text("train:\n  parallel: {bucket_cap_mb: 5}\n", 1e-5)
    assert yaml.safe_load(new)["train"]["parallel"]["bucket_cap_mb"] == 1e-5
