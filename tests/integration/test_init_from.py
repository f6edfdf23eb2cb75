"""model.init_from: a Hugging Face LLaMA folder (saved here by transformers, random weights) is read,
checked and loaded by every layout: llmpipe's logits equal transformers', 0 training steps then
consolidate give back the same tensors bitwise, and the whole pipeline exports them to ONNX."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmpipe import config as config_mod
from llmpipe import stages
from llmpipe.models.llama import hf
from llmpipe.models.llama.model import Transformer

pytestmark = pytest.mark.slow
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _corpus(folder: Path) -> Path:
    corpus = folder / "corpus"
    if not corpus.exists():  # written once: prepare_data's fingerprint includes the files' mtimes
        corpus.mkdir()
        for i in range(12):
            (corpus / f"d{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(600)))
    return corpus


def _save_hf(folder: Path, tie: bool = False, rope_scaling: dict | None = LLAMA3, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmpipe.data.tokenizer import train_tokenizer

    torch.manual_seed(seed)
    c = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                    rope_scaling=rope_scaling, tie_word_embeddings=tie)
    LlamaForCausalLM(c).save_pretrained(folder, max_shard_size="50KB")  # sharded, with an index
    texts = [p.read_text() for p in sorted(_corpus(folder.parent).glob("*.txt"))]
    train_tokenizer(texts, 300, 2, "<|endoftext|>").save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return _save_hf(tmp_path_factory.mktemp("hf") / "llama")


def _hf_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    with torch.no_grad():
        return LlamaForCausalLM.from_pretrained(folder).eval()(x).logits


@pytest.mark.parametrize("tie,scaling", [(False, LLAMA3), (True, None)])
def test_llmpipe_logits_equal_transformers_on_the_loaded_weights(tmp_path, tie, scaling):
    folder = _save_hf(tmp_path / "m", tie=tie, rope_scaling=scaling)
    args, facts = hf.read_config(folder)
    assert (args.n_kv_heads, args.vocab_size, facts["tie_word_embeddings"]) == (2, 320, tie)
    assert (args.rope_scaling or {}).get("rope_type") == (scaling or {}).get("rope_type")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(source=hf.HFWeights(folder, args, tie).tensor)
    x = torch.randint(0, 320, (2, 48))  # beyond original_max_position_embeddings: the llama3 scaling matters
    with torch.no_grad():
        torch.testing.assert_close(model(x), _hf_logits(folder, x), rtol=0, atol=1e-5)


def _edit(folder: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    change(copy)
    return copy


def _set_config(**kv):
    def change(folder: Path) -> None:
        c = json.loads((folder / "config.json").read_text())
        c.update(kv)
        (folder / "config.json").write_text(json.dumps(c))
    return change


def _extra_weight(folder: Path) -> None:
    index = json.loads((folder / hf.INDEX_JSON).read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = next(iter(index["weight_map"].values()))
    (folder / hf.INDEX_JSON).write_text(json.dumps(index))


def _escaping_index(folder: Path) -> None:
    index = json.loads((folder / hf.INDEX_JSON).read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (folder / hf.INDEX_JSON).write_text(json.dumps(index))


@pytest.mark.parametrize("change,expected", [
    (_set_config(architectures=["GPT2LMHeadModel"]),
     "config.json: architectures: ['GPT2LMHeadModel'] is not supported"),
    (_set_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     "config.json: rope_parameters.rope_type: 'yarn' is not supported"),
    (_set_config(attention_bias=True), "config.json: attention_bias: True is not supported"),
    (_set_config(hidden_act="gelu"), "config.json: hidden_act: 'gelu' is not supported (llmpipe's LlamaForCausalLM "
                                     "has 'silu')"),
    (_set_config(head_dim=32), "q_proj.weight has shape [64, 64], config.json implies [128, 64]"),
    (_set_config(intermediate_size=200), "mlp.gate_proj.weight has shape [176, 64], config.json implies [200, 64]"),
    (_extra_weight, "weights llmpipe's LLaMA has no place for: model.layers.0.self_attn.q_proj.bias"),
    (_escaping_index, "weight_map: '../../etc/passwd' is outside the folder"),
    (lambda f: (f / "tokenizer.json").unlink(), "model.init_from: "),
])
def test_what_llmpipe_cannot_load_is_refused_with_one_line_naming_the_field(hf_folder, tmp_path, change, expected):
    folder = _edit(hf_folder, tmp_path, change)
    tree = {"run": {"artifacts_dir": str(tmp_path / "a")}, "data": {"inputs": ["x/*.txt"], "seq_len": 32},
            "model": {"init_from": str(folder)}}
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.from_dict(tree)  # config.json and the safetensors headers are checked at load
    line = str(err.value)
    assert expected in line and "model.init_from" in line and "\n" not in line, line


def test_init_from_refuses_architecture_overrides(hf_folder, tmp_path):
    tree = {"data": {"inputs": ["x/*.txt"]}, "model": {"init_from": str(hf_folder), "n_layers": 4}}
    with pytest.raises(config_mod.ConfigError, match="model.n_layers: not with model.init_from"):
        config_mod.from_dict(tree)


def _config(tmp_path: Path, hf_folder: Path, name: str, **train) -> config_mod.RunConfig:
    t = {"nproc_per_node": 1, "micro_batch_size": 4, "max_steps": 0, "threads_per_proc": 1,
         "eval": {"every_steps": 100, "batches": 1}, "schedule": {"warmup_steps": 1}, **train}
    tree = {"run": {"name": name, "artifacts_dir": str(tmp_path / "artifacts"), "device": "cpu", "seed": 5},
            "data": {"inputs": [str(_corpus(tmp_path) / "*.txt")], "seq_len": 32, "val_fraction": 0.2},
            "model": {"init_from": str(hf_folder)}, "train": t,
            "export": {"parity_shapes": [[1, 16]]},
            "benchmark": {"shapes": [[1, 16]], "warmup": 0, "iters": 2, "threads": 1},
            "evaluate": {"limit": 4}}
    return config_mod.from_dict(yaml.safe_load(yaml.safe_dump(tree)))


LAYOUTS = {
    "ddp-1": {},
    "fsdp-2": {"nproc_per_node": 2, "parallel": {"data": "fsdp"}},
    "zero3-2": {"nproc_per_node": 2, "parallel": {"data": "zero", "zero_stage": 3}},
    "tp2": {"nproc_per_node": 2, "parallel": {"tp": 2}},
    "pp2": {"nproc_per_node": 2, "parallel": {"pp": 2, "microbatches": 2}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_steps_then_consolidate_gives_back_the_pretrained_tensors_bitwise(hf_folder, tmp_path, layout):
    cfg = _config(tmp_path, hf_folder, layout, **LAYOUTS[layout])
    for s in ("prepare_data", "train", "consolidate"):
        stages.run_stage(s, cfg)
    out = load_file(str(cfg.run_dir() / "03_consolidate" / "model.safetensors"))
    weights = hf.HFWeights(hf_folder, hf.read_config(hf_folder)[0], tied=False)
    assert sorted(out) == sorted(n for n, _ in Transformer(hf.read_config(hf_folder)[0]).named_parameters())
    for name, tensor in out.items():
        assert torch.equal(tensor, weights.tensor(name)), name
    # the folder's generation_config.json (transformers wrote bos 1, eos 2) is carried into hf/, after training's eos
    generation = json.loads((cfg.run_dir() / "03_consolidate" / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, [0, 2])


def test_a_pretrained_model_runs_all_six_stages_and_onnx_equals_transformers(hf_folder, tmp_path):
    import onnxruntime as ort

    cfg = _config(tmp_path, hf_folder, "six")
    for s in config_mod.STAGES:
        stages.run_stage(s, cfg)
    x = torch.randint(0, 300, (1, 24))
    session = ort.InferenceSession(str(cfg.run_dir() / "04_export_onnx" / "model.onnx"))
    (logits,) = session.run(None, {"input_ids": x.numpy()})[:1]
    np.testing.assert_allclose(logits, _hf_logits(hf_folder, x).numpy(), rtol=0, atol=1e-4)
    # and a few steps of training from it lower the loss
    trained = _config(tmp_path, hf_folder, "six", max_steps=6, optim={"lr": 3e-3})
    manifest, executed = stages.run_stage("train", trained)
    assert executed and manifest.metrics["val_loss"] < manifest.metrics["val_loss_start"]
