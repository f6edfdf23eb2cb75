"""Bad input through the CLI: one clear line naming the field or file, a non-zero exit, and no
artifact left behind. Configs are checked before any stage runs; data is checked by prepare_data."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmpipe import cli


def _base(tmp_path: Path) -> dict:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(4):
        (corpus / f"ok{i}.txt").write_text("fine text with words in it. " * 50)
    return {"run": {"name": "bad", "artifacts_dir": str(tmp_path / "artifacts")},
            "data": {"inputs": [str(corpus / "*.txt")], "seq_len": 16, "val_fraction": 0.25,
                     "tokenizer": {"vocab_size": 280}, "dedup": "none"}}  # identical files


def _run(tmp_path: Path, tree, capsys, stage: str = "prepare_data", raw: str | None = None) -> tuple[int, str]:
    path = tmp_path / "bad.yaml"
    path.write_text(raw if raw is not None else yaml.safe_dump(tree))
    code = cli.main(["stage", stage, str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _set(tree: dict, dotted: str, value) -> dict:
    node = tree
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return tree


CONFIG_CASES = [
    # (dotted key, value, expected fragment of the one-line error)
    ("run.name", "../escape", "run.name: '../escape' is not a valid run name"),
    ("run.name", "", "run.name"),
    ("run.seed", -1, "run.seed: Input should be greater than or equal to 0"),
    ("run.device", "gpu", "run.device: Input should be"),
    ("run.retries", "many", "run.retries: Input should be a valid integer"),
    ("data.inputs", "notalist", "data.inputs: Input should be a valid list"),
    ("data.inputs", [], "data.inputs: List should have at least 1 item"),
    ("data.seq_len", 4, "data.seq_len: Input should be greater than or equal to 8"),
    ("data.seq_len", "long", "data.seq_len: Input should be a valid integer"),
    ("data.val_fraction", 0, "data.val_fraction: Input should be greater than 0"),
    ("data.val_fraction", 0.7, "data.val_fraction: Input should be less than 0.5"),
    ("data.tokenizer.vocab_size", 10, "data.tokenizer.vocab_size: Input should be greater than or equal to 260"),
    ("data.tokenizer.colour", "red", "data.tokenizer.colour: unknown key"),
    ("data.max_files", 0, "data.max_files: Input should be greater than or equal to 1"),
    ("model.flavor", 7, "model.flavor: Input should be a valid string"),
    ("model.dim", 4, "model.dim: Input should be greater than or equal to 8"),
    ("model.layers", 2, "model.layers: unknown key"),
    ("train.nproc_per_node", 0, "train.nproc_per_node: Input should be greater than or equal to 1"),
    ("train.micro_batch_size", 2.5, "train.micro_batch_size: Input should be a valid integer"),
    ("train.max_steps", None, "train.max_steps: Input should be a valid integer"),
    ("train.optim.lr", -1e-3, "train.optim.lr: Input should be greater than 0"),
    ("train.optim.betas", [0.9], "train.optim.betas"),
    ("train.optim.weight_decay", "lots", "train.optim.weight_decay: Input should be a valid number"),
    ("train.schedule.decay", "step", "train.schedule.decay: Input should be 'cosine', 'linear', 'constant' or 'wsd'"),
    ("train.schedule.min_lr_ratio", 2, "train.schedule.min_lr_ratio: Input should be less than or equal to 1"),
    ("train.precision.dtype", "int4", "train.precision.dtype: Input should be"),
    ("train.checkpoint.keep_last", 0, "train.checkpoint.keep_last: Input should be greater than or equal to 1"),
    ("train.parallel.data", "zero", "train.parallel: data=zero needs zero_stage 1, 2 or 3 (got 0)"),
    ("train.parallel.zero_stage", 2, "train.parallel: zero_stage=2 needs data=zero (got data=ddp)"),
    ("train.parallel.offload_param", "cpu", "train.parallel: offload_param needs data=zero with zero_stage=3"),
    ("train.parallel.offload_optimizer", "nvme", "train.parallel.offload_optimizer: Input should be 'none' or 'cpu'"),
    ("train.dist_timeout_s", 1, "train.dist_timeout_s: Input should be greater than or equal to 10"),
    ("consolidate.dtype", "fp8", "consolidate.dtype: Input should be 'fp32' or 'bf16'"),
    ("export.opset", 12, "export.opset: Input should be greater than or equal to 14"),
    ("export.opset", 20, "export: opset 20 > 18, which ATC cannot read"),
    ("export.parity_shapes", [[1]], "export.parity_shapes.0"),
    ("convert_om.precision_mode", "allow_fp32_to_fp16", "convert_om: set precision_mode or precision_mode_v2"),
    ("convert_om.log", "verbose", "convert_om.log: Input should be"),
    ("benchmark.iters", 0, "benchmark.iters: Input should be greater than or equal to 1"),
    ("benchmark.variants", ["int3"], "benchmark.variants.0: Input should be 'fp32', 'fp16', 'int8', 'int4', 'int8w' "
                                     "or 'int8s'"),
    ("benchmark.quantize.int4.block_size", 48, "benchmark.quantize.int4.block_size: 48 is not a block size "
                                               "MatMulNBits takes (a power of two, 16 or more)"),
    ("benchmark.shapes", "1x128", "benchmark.shapes: Input should be a valid list"),
    ("extra_section", {"a": 1}, "extra_section: unknown key"),
]


@pytest.mark.parametrize("key,value,expected", CONFIG_CASES, ids=[f"{k}={v!r}" for k, v, _ in CONFIG_CASES])
def test_malformed_config(tmp_path, capsys, key, value, expected):
    code, line = _run(tmp_path, _set(_base(tmp_path), key, value), capsys)
    assert code == 2
    assert line.startswith("error: ") and expected in line, line
    assert not (tmp_path / "artifacts").exists()  # rejected before anything is created


@pytest.mark.parametrize("raw,expected", [
    ("run: [1, 2\n", "not valid YAML"),
    ("just a string\n", "top level must be a mapping"),
    ("run: {name: x}\n", "data: required field is missing"),
    ("data: {inputs: [a]}\nrun: !!python/object/apply:os.system [echo]\n", "not valid YAML"),
])
def test_malformed_yaml(tmp_path, capsys, raw, expected):
    code, line = _run(tmp_path, None, capsys, raw=raw)
    assert code == 2 and expected in line, line


def test_missing_config_file(tmp_path, capsys):
    assert cli.main(["stage", "prepare_data", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def _data_case(tmp_path: Path, files: dict[str, bytes]) -> dict:
    tree = _base(tmp_path)
    bad = tmp_path / "baddata"
    bad.mkdir()
    for name, content in files.items():
        (bad / name).write_bytes(content)
    tree["data"]["inputs"] = [str(bad / "*")]
    return tree


@pytest.mark.parametrize("files,expected", [
    ({"empty.txt": b""}, "empty"),
    ({"blob.bin": bytes(range(256)) * 40}, "binary"),
    ({"latin1.txt": "café crème brûlée".encode("latin-1") * 50}, "not UTF-8"),
    ({"bad.jsonl": b'{"nottext": 1}\n{broken\n'}, "no usable"),
], ids=["empty", "binary", "non-utf8", "jsonl-without-text"])
def test_unusable_data_fails_with_the_file_named(tmp_path, capsys, files, expected):
    code, line = _run(tmp_path, _data_case(tmp_path, files), capsys)
    assert code == 1
    assert line.startswith("error: data.inputs: no usable documents") and expected in line, line
    assert list(files)[0] in line
    assert not (tmp_path / "artifacts" / "bad").exists()  # no run folder, no partial output


def test_missing_data_and_missing_tokenizer(tmp_path, capsys):
    tree = _set(_base(tmp_path), "data.inputs", [str(tmp_path / "nowhere" / "*.txt")])
    code, line = _run(tmp_path, tree, capsys)
    assert code == 1 and "data.inputs[0]" in line and "matched no files" in line
    tree = _set(_base(tmp_path), "data.tokenizer.path", str(tmp_path / "tok.json"))
    code, line = _run(tmp_path, tree, capsys)
    assert code == 1 and "tok.json" in line and "not found" in line
    assert not (tmp_path / "artifacts" / "bad").exists()


def test_one_enormous_line_is_handled(tmp_path, capsys):
    """A 3 MB single-line file is tokenized like any other (no line-based reader to choke)."""
    tree = _base(tmp_path)
    (tmp_path / "corpus" / "huge.txt").write_text("word " * 600_000)
    code, _ = _run(tmp_path, tree, capsys)
    assert code == 0
    assert (tmp_path / "artifacts" / "bad" / "01_prepare_data" / "manifest.json").is_file()


def test_too_big_file_is_skipped_with_reason_or_fails_clearly(tmp_path, capsys):
    tree = _set(_data_case(tmp_path, {"big.txt": b"x" * 5000}), "data.max_file_bytes", 1000)
    code, line = _run(tmp_path, tree, capsys)
    assert code == 1 and "big.txt" in line and "max_file_bytes" in line, line


def test_train_before_data_names_the_missing_stage(tmp_path, capsys):
    code, line = _run(tmp_path, _base(tmp_path), capsys, stage="train")
    assert code == 1 and line == "error: train needs prepare_data, which is missing; run prepare_data first"


@pytest.mark.parametrize("key, value, msg", [
    ("train.parallel.tp", 2, "dp=1 x tp=2 x pp=1 = 2, but world size is 1"),
    ("train.parallel.pp", 2, "dp=1 x tp=1 x pp=2 = 2, but world size is 1"),
])
def test_bad_layout_is_refused_before_launch(tmp_path, capsys, key, value, msg):
    tree = _set(_base(tmp_path), key, value)
    tree["train"]["parallel"]["dp"] = 1
    code, _ = _run(tmp_path, tree, capsys)  # prepare_data runs fine
    assert code == 0
    code, line = _run(tmp_path, tree, capsys, stage="train")  # the pre-flight: a config error, exit 2
    assert code == 2 and msg in line and "nproc_per_node 1" in line, line
    assert len(line.splitlines()) == 1
    run_dir = tmp_path / "artifacts" / "bad"
    assert sorted(p.name for p in run_dir.iterdir() if "train" in p.name) == []  # no output, no .partial
