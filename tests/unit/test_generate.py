"""`llmpipe generate` refuses bad options and foreign graphs with one line: options before anything is
loaded (exit 2), graphs that are not the ones export_onnx makes even when their manifest was rewritten
to match (exit 1). The run is a tiny hand-made one: consolidate's and export_onnx's folders only."""

from __future__ import annotations

import io
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors.torch import save_file

from llmpipe.cli import main
from llmpipe.config import ConfigError
from llmpipe.export import onnx as export
from llmpipe.infer import decode
from llmpipe.manifest import Manifest, file_entry
from llmpipe.models.llama import FLAVORS, Transformer
from llmpipe.models.llama import io as model_io
from llmpipe.stages import stage_dir
from llmpipe.tools.generate import run_generate

CACHE = 32
ARGS = replace(FLAVORS["debug"], vocab_size=300, max_seq_len=64)


def _publish(folder: Path, stage: str, outputs: dict[str, str], **metrics) -> None:
    entries = {name: file_entry(folder, rel) for name, rel in outputs.items()}
    Manifest(stage, "completed", "test", entries, metrics=metrics).write(folder)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """consolidate (weights, model config, tokenizer) and export_onnx (prefill + static decoder)."""
    from llmpipe.data.tokenizer import train_tokenizer

    run = tmp_path_factory.mktemp("gen") / "run"
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    model.eval()
    folder = stage_dir(run, "consolidate")
    folder.mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if "freqs" not in k}
    save_file(weights, str(folder / model_io.WEIGHTS))
    model_io.write_args(folder, ARGS, "float32")
    train_tokenizer(["def main(x):\n    return x + 1\n" * 20], vocab_size=ARGS.vocab_size).save(
        str(folder / model_io.TOKENIZER))
    _publish(folder, "consolidate", {"model": model_io.WEIGHTS, "model_config": model_io.CONFIG,
                                     "tokenizer": model_io.TOKENIZER})
    folder = stage_dir(run, "export_onnx")
    folder.mkdir(parents=True)
    export.export_prefill(model, folder / "model.onnx", opset=17)
    export.export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=CACHE)
    export.export_static_decoder(model, folder / "decoder_16.onnx", opset=17, length=16)
    _publish(folder, "export_onnx", {"model": "model.onnx", "decoder_static": "decoder_static.onnx"},
             static_decoder_cache_len=CACHE)
    return run


def _copy(run_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run to tamper with, and its export_onnx folder."""
    run = shutil.copytree(run_dir, tmp_path / "run")
    return run, stage_dir(run, "export_onnx")


def _rename(path: Path, old: str, new: str) -> None:
    """Rename a graph input or output everywhere it appears (a foreign graph's naming)."""
    proto = onnx.load(str(path))
    for value in [*proto.graph.input, *proto.graph.output]:
        if value.name == old:
            value.name = new
    for node in proto.graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
    onnx.save(proto, str(path))


def _rewrite_manifest(folder: Path) -> None:
    """What a tamperer does: the manifest made to match the files again."""
    _publish(folder, "export_onnx", {"model": "model.onnx", "decoder_static": "decoder_static.onnx"},
             static_decoder_cache_len=CACHE)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- options: one line, exit 2, before anything is loaded (the run folder given is empty) -----------------


def test_an_invalid_utf8_prompt_is_one_error_line_before_anything_is_loaded(tmp_path, capsys):
    prompt = b"\xff\xfe def".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert main(["generate", str(tmp_path), "--prompt", prompt]) == 2
    assert _error(capsys) == "error: --prompt: not valid UTF-8 (byte 0xff at character 0)"


def test_a_prompt_with_a_lone_surrogate_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"^--prompt: not valid UTF-8 \(lone surrogate U\+D800 at character 2\)$"):
        run_generate(tmp_path, "ab\ud800", out=io.StringIO())


@pytest.mark.parametrize("option, value, message", [
    ("--temperature", "nan", "--temperature nan: must be a finite number >= 0 (0: greedy)"),
    ("--temperature", "inf", "--temperature inf: must be a finite number >= 0 (0: greedy)"),
    ("--temperature", "-0.5", "--temperature -0.5: must be a finite number >= 0 (0: greedy)"),
    ("--threads", "-1", "--threads -1: must be between 1 and 1024 (leave it out for all cores)"),
    ("--threads", "0", "--threads 0: must be between 1 and 1024 (leave it out for all cores)"),
    ("--seed", "-1", "--seed -1: must be >= 0"),
    ("--top-p", "0", "--top-p 0: must be in (0, 1]"),
    ("--top-p", "1.5", "--top-p 1.5: must be in (0, 1]"),
    ("--top-k", "-3", "--top-k -3: must be >= 1"),
    ("--max-new-tokens", "0", "--max-new-tokens 0: must be >= 1"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 16 else "")
def test_an_option_out_of_range_is_one_error_line_and_exit_2_before_anything_is_loaded(tmp_path, capsys, option,
                                                                                     value, message):
    assert main(["generate", str(tmp_path), "--prompt", "def", option, value]) == 2
    assert _error(capsys) == f"error: {message}"


def test_a_temperature_so_small_that_logits_over_it_overflow_picks_the_argmax():
    logits = np.array([[0.1, 3.0, 2.9, -1.0]], dtype=np.float32)
    assert decode.pick_tokens(logits, temperature=1e-310, rng=np.random.default_rng(0)).tolist() == [1]


# -- graphs: checked against what the engine feeds and reads when the session is created ---------------


def test_the_exported_graphs_meet_the_contract_and_generate(run_dir, capsys):
    assert main(["generate", str(run_dir), "--prompt", "def main(", "--max-new-tokens", "4"]) == 0
    assert "[onnxruntime fp32, static KV cache of 32] prompt" in capsys.readouterr().out


def test_a_decoder_whose_input_names_differ_is_refused_though_its_manifest_matches(run_dir, tmp_path, capsys):
    run, folder = _copy(run_dir, tmp_path)
    _rename(folder / "decoder_static.onnx", "cache.1.value", "past.1.value")
    _rewrite_manifest(folder)
    assert main(["generate", str(run), "--prompt", "def main("]) == 1
    assert _error(capsys) == (
        f"error: {folder / 'decoder_static.onnx'}: not the static decoder (cache of 32) graph export_onnx makes "
        "for this model: no input 'cache.1.value', an unexpected input 'past.1.value'; refusing to use it")


def test_a_prefill_graph_without_an_output_the_engine_reads_is_refused(run_dir, tmp_path, capsys):
    run, folder = _copy(run_dir, tmp_path)
    _rename(folder / "model.onnx", "present.0.key", "kv.0.key")
    _rewrite_manifest(folder)
    assert main(["generate", str(run), "--prompt", "def main("]) == 1
    assert _error(capsys) == (
        f"error: {folder / 'model.onnx'}: not the prefill graph export_onnx makes for this model: "
        "no output 'present.0.key'; refusing to use it")


def test_a_decoder_with_another_cache_length_than_its_manifest_says_is_refused(run_dir, tmp_path, capsys):
    run, folder = _copy(run_dir, tmp_path)
    shutil.copyfile(folder / "decoder_16.onnx", folder / "decoder_static.onnx")
    _rewrite_manifest(folder)
    assert main(["generate", str(run), "--prompt", "def main("]) == 1
    assert _error(capsys) == (
        f"error: {folder / 'decoder_static.onnx'}: not the static decoder (cache of 32) graph export_onnx makes "
        "for this model: input 'attention_mask' has 16 on axis 1, expected 32; refusing to use it")


def test_a_manifest_cache_length_that_is_not_a_positive_integer_is_refused(run_dir, tmp_path, capsys):
    run, folder = _copy(run_dir, tmp_path)
    _publish(folder, "export_onnx", {"model": "model.onnx", "decoder_static": "decoder_static.onnx"},
             static_decoder_cache_len="32k")
    assert main(["generate", str(run), "--prompt", "def main("]) == 1
    assert _error(capsys) == (f"error: {folder}: the manifest's static_decoder_cache_len is '32k', not a positive "
                              "integer; refusing to use it (re-run export_onnx)")


def test_generation_stops_at_the_eos_ids_consolidate_wrote_for_transformers(tmp_path):
    """An init_from model's eos (say `</s>`, or several ids) ends generate's answers, not a literal
    `<|endoftext|>` the tokenizer may not have; a folder without hf/ falls back to llmpipe's own."""
    from llmpipe.data.tokenizer import train_tokenizer
    from llmpipe.tools.generate import GenerateError, _eos_ids

    tok = train_tokenizer(["def main(argv):\n    return len(argv)\n"] * 4, 300)
    assert _eos_ids(tmp_path, tok, 300) == [tok.token_to_id("<|endoftext|>")]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": [7, 9], "bos_token_id": 1}')
    assert _eos_ids(tmp_path, tok, 300) == [7, 9]
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": [7, 9000]}')
    with pytest.raises(GenerateError, match="eos_token_id"):
        _eos_ids(tmp_path, tok, 300)
