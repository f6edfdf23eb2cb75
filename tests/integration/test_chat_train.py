"""A tiny chat run: `llmpipe stage prepare_data` on the demo's conversation set, then training, with the
loss the mean over the assistant's tokens of the whole step however it is split into micro-batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from llmpipe import cli
from llmpipe.chat import synth
from llmpipe.chat.template import builtin_template
from llmpipe.data.chat import ChatShard
from llmpipe.train.loop import train
from tests.conftest import losses as _losses
from tests.conftest import make_cfg

CHAT = {"format": "chat", "chat_template": "chatml", "seq_len": 64}


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """The config file of a prepared chat run (prepare_data done through the command line)."""
    root = tmp_path_factory.mktemp("chat")
    synth.write(root / "set", seed=1, n_arithmetic=300)
    tree = {"run": {"name": "chat", "artifacts_dir": str(root / "artifacts"), "device": "cpu", "seed": 3},
            "data": {"inputs": [str(root / "set" / "train.jsonl")], "val_fraction": 0.1,
                     "tokenizer": {"vocab_size": 400}, "workers": 1, **CHAT},
            "model": {"flavor": "debug"},
            "train": {"nproc_per_node": 1, "micro_batch_size": 4, "grad_accum_steps": 1, "max_steps": 3,
                      "threads_per_proc": 1, "log_every": 1, "schedule": {"warmup_steps": 1},
                      "checkpoint": {"every_steps": 3}, "eval": {"every_steps": 3, "batches": 2}}}
    path = root / "chat.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert cli.main(["stage", "prepare_data", str(path)]) == 0
    return path


def _data(config: Path) -> Path:
    return config.parent / "artifacts" / "chat" / "01_prepare_data"


def test_prepare_data_writes_labels_beside_the_shards_and_the_template_with_its_digest(chat_run):
    data = _data(chat_run)
    manifest = json.loads((data / "manifest.json").read_text())
    tpl = builtin_template("chatml")
    assert manifest["metrics"]["chat_template_sha256"] == tpl.sha256
    assert manifest["metrics"]["format"] == "chat"
    assert {"chat_template", "train_labels", "val_labels"} <= set(manifest["outputs"])
    assert (data / "chat_template.jinja").read_text() == tpl.source
    meta = json.loads((data / "data_meta.json").read_text())
    assert meta["chat"]["end_of_turn"] == ["<|im_end|>"] and meta["train_samples"] == meta["train_documents"]
    shard = ChatShard(data / "train.bin", 64, packing=True)
    assert shard.num_samples() < meta["train_documents"]  # several conversations per sequence
    assert (data / "train.labels").stat().st_size == shard.tokens.n_tokens
    # every conversation trains on its answer and the end-of-turn marker: "<digits>." then <|im_end|>
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    x, y, _ = shard.sample(0)
    trained = tok.decode([int(t) for t in y if t >= 0], skip_special_tokens=False)
    assert trained.count("<|im_end|>") == len(set(_.tolist()) - {-1})


@pytest.mark.slow
def test_a_chat_run_trains_through_the_train_stage_and_two_ranks_take_one_ranks_steps(chat_run):
    """Under DDP each rank's micro-batch holds its own number of targets; the step's loss is still the mean
    over all of them (scaled by the step's count, then averaged by DDP): the 1-rank run's losses (fp32)."""
    out = chat_run.parent / "artifacts" / "chat" / "02_train"
    assert cli.main(["stage", "train", str(chat_run)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and np.isfinite(summary["val_loss"]) and summary["val_loss"] < summary[
        "val_loss_start"]
    one_rank = _losses(out)
    assert cli.main(["stage", "train", str(chat_run), "--force", "--set", "train.nproc_per_node=2", "--set",
                     "train.micro_batch_size=2", "--set", "train.checkpoint.resume=false"]) == 0
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    torch.testing.assert_close(_losses(out), one_rank, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packing", [True, False])
def test_accumulated_micro_batches_of_conversations_step_like_one_batch(chat_run, tmp_path, packing):
    """The loss is summed over targets and divided by the step's count, not averaged per micro-batch, so
    2 x 4 and 1 x 8 sequences take the same step although their micro-batches hold different target counts."""
    data = _data(chat_run)
    ref = make_cfg(tmp_path / "ref", data=CHAT, data__packing=packing, train__micro_batch_size=8,
                   train__grad_accum_steps=1, train__max_steps=3)
    acc = make_cfg(tmp_path / "acc", data=CHAT, data__packing=packing, train__micro_batch_size=4,
                   train__grad_accum_steps=2, train__max_steps=3)
    train(ref, data, tmp_path / "ref_out")
    train(acc, data, tmp_path / "acc_out")
    torch.testing.assert_close(_losses(tmp_path / "acc_out"), _losses(tmp_path / "ref_out"), rtol=1e-5, atol=1e-5)
