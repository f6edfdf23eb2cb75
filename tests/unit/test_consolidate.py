"""Consolidation round-trips: checkpoint -> model folder -> the same weights, in llmpipe and HF layouts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint.consolidate import consolidate
from llmpipe.checkpoint.stream import write_streaming
from llmpipe.models.llama import hf
from llmpipe.models.llama import io as model_io
from llmpipe.train.loop import train
from tests.conftest import full_checkpoint, make_cfg


@pytest.fixture
def checkpoint(tmp_path, data_dir):
    cfg = make_cfg(tmp_path, train__max_steps=2, train__checkpoint={"every_steps": 2})
    train(cfg, data_dir, tmp_path / "train")
    # the "full" consolidator reads what DDP wrote before it wrote DCP (consolidate_dcp: test_fsdp)
    return full_checkpoint(ckpt.latest_valid(tmp_path / "train" / "checkpoints"), tmp_path / "full")


def test_streaming_writer_matches_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(2, dtype=torch.bfloat16)}
    write_streaming(tmp_path / "x.safetensors", [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()],
                    tensors.__getitem__)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_consolidated_fp32_equals_the_checkpoint(tmp_path, checkpoint):
    out = tmp_path / "model"
    out.mkdir()
    consolidate(checkpoint, out, "fp32")
    meta = ckpt.read_meta(checkpoint)
    model_io.write_args(out, model_io.ModelArgs(**meta["model"]), "fp32")
    src = load_file(str(checkpoint / "model.safetensors"))
    model = model_io.load_model(out)
    for k, v in model.state_dict().items():
        if k in src:
            assert torch.equal(v, src[k]), k


def test_bf16_consolidation_rounds_within_bf16_precision(tmp_path, checkpoint):
    out = tmp_path / "bf16"
    out.mkdir()
    consolidate(checkpoint, out, "bf16")
    src, got = load_file(str(checkpoint / "model.safetensors")), load_file(str(out / model_io.WEIGHTS))
    for k in src:
        assert got[k].dtype == torch.bfloat16
        torch.testing.assert_close(got[k].float(), src[k], rtol=8e-3, atol=1e-6)


def test_hf_folder_loads_in_transformers_with_the_same_logits(tmp_path, checkpoint):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    out.mkdir()
    consolidate(checkpoint, out, "fp32", rename=hf.to_hf_name)
    args = model_io.ModelArgs(**ckpt.read_meta(checkpoint)["model"])
    (out / "config.json").write_text(json.dumps(hf.hf_config(args, "fp32", eos_id=0)))
    ref = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    consolidate(checkpoint, ours_dir, "fp32")
    model_io.write_args(ours_dir, args, "fp32")
    ours = model_io.load_model(ours_dir)
    x = torch.randint(0, args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, ours(x), rtol=1e-4, atol=1e-4)
