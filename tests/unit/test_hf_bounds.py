"""Issue 22 item 6: absurd sizes in a model.init_from config.json (or in the config's own model
overrides) are refused in one line naming the field before anything is built from them, and the
weights' shapes are checked against config.json by arithmetic, not by building the model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from llmpipe import cli
from llmpipe import config as config_mod
from llmpipe.models.llama import FLAVORS, Transformer, hf

ARGS = replace(FLAVORS["debug"], vocab_size=300)


def _hf_folder(folder: Path, **config) -> Path:
    """An HF LlamaForCausalLM folder of the debug model (config.json as llmpipe's consolidate writes it,
    one safetensors file, a tokenizer), with `config` written over config.json's fields."""
    from llmpipe.data.tokenizer import train_tokenizer

    folder.mkdir(parents=True)
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    save_file({hf.to_hf_name(k): v.contiguous() for k, v in model.state_dict().items()},
              str(folder / hf.SINGLE))
    (folder / hf.CONFIG_JSON).write_text(json.dumps({**hf.hf_config(ARGS, "fp32"), **config}))
    train_tokenizer(["def main(argv):\n    return len(argv)\n"] * 4, 300).save(str(folder / "tokenizer.json"))
    return folder


def _tree(tmp_path: Path, folder: Path, **model) -> dict:
    return {"run": {"name": "big", "artifacts_dir": str(tmp_path / "artifacts")},
            "data": {"inputs": [str(tmp_path / "*.txt")], "seq_len": 32},
            "model": {"init_from": str(folder), **model}}


def test_an_init_from_config_with_a_million_layers_of_hidden_a_million_fails_llmpipe_run_in_one_line(tmp_path,
                                                                                                    capsys):
    folder = _hf_folder(tmp_path / "hf", num_hidden_layers=10**6, hidden_size=10**6, num_attention_heads=1000,
                        num_key_value_heads=1000, intermediate_size=10**6, head_dim=None)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_tree(tmp_path, folder)))
    assert cli.main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.strip() == (f"error: {config}: model.init_from: {folder / 'config.json'}: num_hidden_layers: 1000000 "
                           "is outside 1..1024, llmpipe's bound on model.n_layers (far above the largest LLaMA)")
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", 10**6, "hidden_size: 1000000 is outside 1..65536, llmpipe's bound on model.dim"),
    ("intermediate_size", 10**6, "intermediate_size: 1000000 is outside 1..262144, llmpipe's bound on model.ffn_dim"),
    ("num_attention_heads", 4096, "num_attention_heads: 4096 is outside 1..1024, llmpipe's bound on model.n_heads"),
    ("num_key_value_heads", 0, "num_key_value_heads: 0 is outside 1..1024, llmpipe's bound on model.n_heads"),
    ("vocab_size", 10**9, "vocab_size: 1000000000 is outside 1..4194304, llmpipe's bound on model.vocab_size"),
    ("max_position_embeddings", 10**7, "max_position_embeddings: 10000000 is outside 1..1048576, llmpipe's bound "
                                       "on model.max_seq_len (far above the largest LLaMA); set model.max_seq_len "
                                       "to train shorter"),
    ("hidden_size", "4096", "hidden_size: expected an integer, got '4096'"),
    ("num_hidden_layers", 1e400, "num_hidden_layers: expected an integer, got inf"),
])
def test_each_size_of_config_json_beyond_its_bound_is_named(tmp_path, field, value, expected):
    folder = _hf_folder(tmp_path / "hf")
    c = json.loads((folder / hf.CONFIG_JSON).read_text())
    (folder / hf.CONFIG_JSON).write_text(json.dumps({**c, field: value}))
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.from_dict(_tree(tmp_path, folder))
    assert str(err.value).startswith(f"config: model.init_from: {folder / 'config.json'}: {expected}"), str(err.value)


def test_a_long_max_position_embeddings_loads_when_model_max_seq_len_sizes_the_table(tmp_path):
    folder = _hf_folder(tmp_path / "hf", max_position_embeddings=10**7)
    cfg = config_mod.from_dict(_tree(tmp_path, folder, max_seq_len=256))
    args, _ = hf.read_config(folder, cfg.model.max_seq_len)
    assert (args.max_seq_len, args.n_layers, args.dim) == (256, 2, 64)


def test_the_weights_shapes_by_arithmetic_are_those_of_the_built_model():
    for args in (ARGS, replace(FLAVORS["tiny"], vocab_size=1000), replace(ARGS, n_kv_heads=4, n_layers=3)):
        with torch.device("meta"):
            built = {n: tuple(p.shape) for n, p in Transformer(args).named_parameters()}
        assert hf.param_shapes(args) == built


def test_a_weight_whose_header_shape_differs_from_config_json_is_named(tmp_path):
    folder = _hf_folder(tmp_path / "hf", intermediate_size=1024)  # the weights have 176
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.from_dict(_tree(tmp_path, folder))
    assert str(err.value) == (f"config: model.init_from: {folder / hf.SINGLE}: model.layers.0.mlp.gate_proj.weight "
                              "has shape [176, 64], config.json implies [1024, 64]")


@pytest.mark.parametrize("field, value, limit", [("n_layers", 10**6, 1024), ("dim", 10**6, 65536),
                                                 ("ffn_dim", 10**7, 262144), ("n_heads", 4096, 1024),
                                                 ("n_kv_heads", 4096, 1024), ("max_seq_len", 10**7, 1048576)])
def test_model_overrides_beyond_their_bound_are_named(tmp_path, field, value, limit):
    tree = {"data": {"inputs": ["x"]}, "model": {field: value}}
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.from_dict(tree)
    assert str(err.value) == f"config: model.{field}: Input should be less than or equal to {limit} (got {value})"
