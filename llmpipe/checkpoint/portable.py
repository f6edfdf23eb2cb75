"""Topology-free resume: a checkpoint of one layout read as full tensors under llmpipe's parameter
names, then loaded into another layout's shards.

    format "full" (DDP)   model.safetensors; optimizer.pt's states keyed by position, which the
                          optimizer's parameter order (llmpipe.optim.param_order) turns into names
    format "dcp"          FSDP2 and dp x tp x pp: every "model.<name>" and "optim.state.<name>.<key>"
                          tensor assembled from all ranks' chunks (DCP reshards on read)
    format "deepspeed"    ZeRO-1/2/3: the fp32 master weights and AdamW's moments rebuilt from the
                          ranks' flat partitions (llmpipe.checkpoint.zero.read_full_state)

The target strategy loads them with torch.distributed.checkpoint.state_dict's full-state-dict
setters, which slice each full tensor into the rank's shard (DDP: whole; FSDP2: dim-0 shards; TP:
DTensor placements; PP: the stage's own names). Trainer state (step, data position, RNG, schedule,
loss scale) is read by llmpipe.checkpoint.state from trainer_state.pt (ZeRO: DeepSpeed's client state,
returned here). Into ZeRO, weights and
moments go through DeepSpeed's public tensor-fragment API (ZeroStrategy.load_full).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint.io import OPTIM

log = logging.getLogger("llmpipe.checkpoint")

_OPTIM_PREFIX = "optim.state."


@dataclass
class Portable:
    model: dict[str, torch.Tensor]  # llmpipe name -> full tensor
    optim: dict[str, dict[str, torch.Tensor]]  # llmpipe name -> {exp_avg, exp_avg_sq, step}
    trainer: dict[str, Any] | None  # ZeRO's client state; None: trainer_state.pt (llmpipe.checkpoint.state)


def read(folder: Path) -> Portable:
    """Any torch-native checkpoint as full tensors; ValueError for a format this cannot read."""
    folder = Path(folder)
    meta = ckpt.read_meta(folder)
    fmt = meta.get("format")
    if fmt == "deepspeed":
        from llmpipe.checkpoint.zero import read_full_state

        return Portable(*read_full_state(folder))
    if fmt not in ("full", "dcp"):
        raise ValueError(f"train.checkpoint.resume: {folder} has an unknown format {fmt!r}")
    if fmt == "full":
        return Portable(*_read_full(folder, meta), None)
    return Portable(*_read_dcp(folder), None)


def read_model(folder: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors only (llmpipe names), of any format; what evaluating a checkpoint
    needs. For "full" and "dcp" the optimizer state is not read."""
    folder = Path(folder)
    fmt = ckpt.read_meta(folder).get("format")
    if fmt == "full":
        return load_file(str(folder / ckpt.MODEL))
    if fmt == "dcp":
        return _read_dcp(folder, optim=False)[0]
    return read(folder).model


def _read_full(folder: Path, meta: dict) -> tuple[dict, dict]:
    from llmpipe.models.llama.lora import LoraSpec, apply_lora
    from llmpipe.models.llama.model import ModelArgs, Transformer
    from llmpipe.optim import param_order

    model = load_file(str(folder / ckpt.MODEL))
    saved = torch.load(folder / OPTIM, map_location="cpu", weights_only=True)
    with torch.device("meta"):
        writer = Transformer(ModelArgs(**meta["model"]))
        if meta.get("lora"):  # its adapters, the rest frozen: the optimizer numbers the adapters alone
            apply_lora(writer, LoraSpec.of(meta["lora"]))
        names = param_order(writer)  # the writer's optimizer order
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    if len(ids) != len(names):
        raise ValueError(f"{folder / OPTIM}: {len(ids)} optimizer parameters, the model has {len(names)}")
    by_id = dict(zip(ids, names))
    return model, {by_id[i]: dict(s) for i, s in saved["state"].items()}


def _read_dcp(folder: Path, optim: bool = True) -> tuple[dict, dict]:
    from llmpipe.checkpoint.dcp import DCP_DIR, MODEL_PREFIX, MetadataOnceReader, load_key

    reader = MetadataOnceReader(folder / DCP_DIR)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, entry in sorted(reader.read_metadata().state_dict_metadata.items()):
        if not isinstance(entry, TensorStorageMetadata):
            continue
        if key.startswith(MODEL_PREFIX):
            model[key.removeprefix(MODEL_PREFIX)] = load_key(reader, key, entry)
        elif optim and key.startswith(_OPTIM_PREFIX):
            name, _, state = key.removeprefix(_OPTIM_PREFIX).rpartition(".")
            moments.setdefault(name, {})[state] = load_key(reader, key, entry)
    return model, moments
