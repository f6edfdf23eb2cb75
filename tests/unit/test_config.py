"""Config loading: defaults, overrides, and one clear line for each kind of bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from llmpipe import config as config_mod
from llmpipe.config import ConfigError
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def test_tiny_config_loads_and_overrides_apply():
    cfg = config_mod.load(TINY, ["train.max_steps=7", "train.optim.betas=[0.8, 0.9]", "run.name=x1"])
    assert cfg.train.max_steps == 7
    assert cfg.train.optim.betas == (0.8, 0.9)
    assert cfg.run_dir().name == "x1"


@pytest.mark.parametrize("override,expected", [
    ("train.max_steps=abc", "train.max_steps: Input should be a valid integer"),
    ("train.max_steps=-1", "train.max_steps: Input should be greater than or equal to 0"),
    ("train.bogus=1", "train.bogus: unknown key"),
    ("bogus.x=1", "bogus: unknown key"),
    ("train.precision.dtype=fp8", "train.precision.dtype: Input should be 'auto', 'fp32', 'bf16' or 'fp16'"),
    ("run.name=../../etc", "run.name: '../../etc' is not a valid run name"),
    ("run.name=a/b", "run.name: 'a/b' is not a valid run name"),
    ("data.val_fraction=0.9", "data.val_fraction: Input should be less than 0.5"),
    ("data.inputs=[]", "data.inputs: List should have at least 1 item"),
    ("export.opset=19", "export: opset 19 > 18, which ATC cannot read"),
    ("convert_om.precision_mode=force_fp16", "convert_om: set precision_mode or precision_mode_v2, not both"),
    ("train.optim.betas=[0.9, 1.5]", "train.optim.betas: each beta must be in [0, 1)"),
    ("benchmark.variants=[fp64]",
     "benchmark.variants.0: Input should be 'fp32', 'fp16', 'int8', 'int4', 'int8w' or 'int8s'"),
    ("train.parallel.data=horovod", "train.parallel.data: Input should be 'ddp', 'zero' or 'fsdp'"),
    ("train.parallel.data=zero", "train.parallel: data=zero needs zero_stage 1, 2 or 3 (got 0)"),
    ("train.parallel.zero_stage=4", "train.parallel.zero_stage: Input should be less than or equal to 3"),
    ("train.parallel.offload_optimizer=cpu", "offload_optimizer=cpu needs data=zero (got data=ddp)"),
    ("run.device=tpu", "run.device: Input should be 'auto', 'cpu', 'cuda' or 'npu'"),
])
def test_bad_values_name_the_field(override, expected):
    with pytest.raises(ConfigError) as err:
        config_mod.load(TINY, [override])
    msg = str(err.value)
    assert expected in msg, msg
    assert "\n" not in msg


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        config_mod.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config_mod.load(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        config_mod.load(bad)
    bad.write_text("run: {name: x}\n")
    with pytest.raises(ConfigError, match="data: required field is missing"):
        config_mod.load(bad)
    bad.write_text("data: {inputs: [x]}\nrun: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):  # safe_load refuses python tags
        config_mod.load(bad)


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        config_mod.load(TINY, ["train.max_steps"])
    with pytest.raises(ConfigError, match="data.seq_len is not a section"):
        config_mod.load(TINY, ["data.seq_len.x=1"])


def test_run_dir_cannot_escape_artifacts(tmp_path):
    cfg = config_mod.load(TINY, [f"run.artifacts_dir={tmp_path}"])
    assert cfg.run_dir().parent == tmp_path.resolve()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path, tmp_path, monkeypatch):
    init_from = (yaml.safe_load(path.read_text())["model"] or {}).get("init_from")
    if init_from:  # tiny_chat.yaml starts from the demo's hf/ folder: one like it, where the config looks
        from safetensors.torch import save_file

        from llmpipe.data.tokenizer import train_tokenizer
        from llmpipe.models.llama import FLAVORS, Transformer, hf

        monkeypatch.chdir(tmp_path)
        folder = Path(init_from)
        folder.mkdir(parents=True)
        # ffn_dim 192: whole blocks of 32 (smollm2_chat.yaml keeps its adapter separate at int4, which needs that)
        args = replace(FLAVORS["debug"], vocab_size=300, max_seq_len=256, ffn_dim=192)
        model = Transformer(args)
        save_file({hf.to_hf_name(k): v.contiguous() for k, v in model.state_dict().items()}, str(folder / hf.SINGLE))
        (folder / hf.CONFIG_JSON).write_text(json.dumps(hf.hf_config(args, "fp32")))
        train_tokenizer(["def main(argv):\n    return len(argv)\n"] * 4, 300).save(str(folder / "tokenizer.json"))
        # smollm2_chat.yaml takes the model's own chat template (the imported GGUF's): chatml, as SmolLM2's is
        template = (ROOT / "llmpipe" / "chat" / "templates" / "chatml.jinja").read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    cfg = config_mod.load(path)
    assert cfg.run_dir().parent.name == "artifacts"
