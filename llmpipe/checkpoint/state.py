"""The training state a checkpoint holds, written and read here alone.

A strategy exposes its state as a `TrainState` (model parts, optimizers, schedules, the loss scaler;
DeepSpeed's engine or DDP's communication hook where it has one). This module writes it in the
strategy's format and reads it back, or, for a checkpoint of another layout, reads full tensors by
llmpipe name (llmpipe.checkpoint.portable) and loads them into this layout's shards. Which of the two
is decided once (`reads_own`), from what the checkpoint's meta.json records, never from a class name.

    format "dcp"        dcp/ (model and optimizer under llmpipe's names, every rank's shards; a tensor
                        replicated on several ranks, as DDP's are, is written once, its writes spread
                        over the ranks) and trainer_state.pt; `state_format` says how the optimizer
                        state is keyed: "dcp-nested" (torch's {"state", "param_groups"}; DDP and FSDP2)
                        or "dcp-flat" (flattened by name; tp or pp > 1); DDP's communication hook
                        state (PowerSGD's error feedback, per rank) beside it, comm_hook_rank<r>.pt
    format "full"       model.safetensors, optimizer.pt, trainer_state.pt (rank 0: replicas are equal):
                        what DDP wrote before it wrote DCP; still read, by DDP's own reader
    format "deepspeed"  deepspeed/ (DeepSpeed's files; the trainer state rides as its client state)

LoRA (train.lora, recorded in meta.json): the frozen base weights are saved with the adapters, in
every format (the base is a small share of a LoRA checkpoint's bytes beside nothing to verify it
against, and every reader, consolidate and resharding work unchanged); the optimizer state is the
adapters' alone.

trainer_state.pt holds the counters (step, consumed_samples), torch's RNG state, the lr schedule, the
loss scaler and, for dp x tp x pp, the layout that wrote it.

Tied embeddings (model.tie_embeddings): the head is the embedding, one tensor in every format, stored
once as `tok_embeddings.weight` (no `output.weight`; the model's own state dict drops it). A pipeline's
last stage holds a copy of it as its `output.weight` (llmpipe.parallel.model_parallel keeps the copy
bitwise equal to the first stage's): it is stored under the embedding's name too, so DCP writes the
two ranks' identical chunks once, and it is read back from there.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint.io import MODEL, OPTIM, TRAINER, Written

log = logging.getLogger("llmpipe.checkpoint")

# meta.json written before it recorded `state_format`: the strategy named there wrote dcp's optimizer
# state nested (FSDP2) or flattened (dp x tp x pp). Read for old checkpoints only.
_LEGACY_DCP = {"FSDPStrategy": "dcp-nested", "ModelParallelStrategy": "dcp-flat"}


@dataclass
class TrainState:
    """What a strategy holds that a checkpoint saves: the parts of its model (one, or a pipeline
    rank's stages), their optimizers and lr schedules, the loss scaler (or None)."""

    state_format: str  # "full" | "dcp-nested" | "dcp-flat" | "deepspeed"
    parts: list[nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    scaler: Any = None
    engine: Any = None  # DeepSpeed's engine (format "deepspeed": it writes and reads its own files)
    hook: Any = None  # DDP's communication hook: per-rank state (PowerSGD's error feedback)
    extra: dict[str, Any] = field(default_factory=dict)  # written into trainer_state.pt as is
    lora: dict[str, Any] | None = None  # train.lora as meta.json records it (None: every weight trained)

    @property
    def format(self) -> str:
        """The checkpoint format meta.json records ("full" | "dcp" | "deepspeed")."""
        return self.state_format.split("-")[0]


def counters(step: int, consumed: int) -> dict[str, Any]:
    """The loop's part of the trainer state: where training is, and torch's RNG."""
    return {"step": step, "consumed_samples": consumed, "torch_rng": torch.get_rng_state()}


def meta(ts: TrainState, world: int, args, consumed: int, strategy_name: str) -> dict[str, Any]:
    """What meta.json records about the state (the formats and the world that wrote it)."""
    out = {"format": ts.format, "state_format": ts.state_format, "strategy": strategy_name,
           "world_size": world, "model": args.to_dict(), "consumed_samples": consumed}
    if ts.lora is not None:  # the adapters' names and scale: readers rebuild the model and merge by it
        out["lora"] = ts.lora
    return out


def describe(cfg, data_dir: Path | None = None) -> dict[str, bytes | Path]:
    """What every step folder carries besides the state (io.Saver's `describe`): the resolved config,
    and the tokenizer when the data folder has one."""
    import yaml

    out: dict[str, bytes | Path] = {ckpt.CONFIG: yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode()}
    tokenizer = Path(data_dir) / ckpt.TOKENIZER if data_dir is not None else None
    if tokenizer is not None and tokenizer.is_file():
        out[ckpt.TOKENIZER] = tokenizer
    return out


def state_format(meta_json: dict[str, Any]) -> str | None:
    """The state format a checkpoint's meta.json records (older checkpoints: derived from the format
    and the strategy that wrote it); None for a dcp checkpoint too old to say."""
    if "state_format" in meta_json:
        return meta_json["state_format"]
    fmt = meta_json.get("format")
    return _LEGACY_DCP.get(meta_json.get("strategy")) if fmt == "dcp" else fmt


def format_of(folder: Path) -> str:
    """The checkpoint format a folder's meta.json records ("dcp" | "full" | "deepspeed")."""
    return ckpt.read_meta(Path(folder)).get("format")


def reads_own(meta_json: dict[str, Any], own: str, world: int, legacy: tuple[str, ...] = ()) -> bool:
    """Whether a checkpoint is read by the strategy's own reader (state format `own`, or one it wrote
    before, `legacy`) rather than resharded from full tensors: the same state format, and for ZeRO the
    same number of ranks."""
    recorded = state_format(meta_json)
    if recorded in legacy:
        return True
    same = recorded == own or (recorded is None and meta_json.get("format") == own.split("-")[0])
    return same and (own != "deepspeed" or meta_json.get("world_size") == world)


# -- writing ---------------------------------------------------------------------------------------


def _trainer_file(ts: TrainState, counters_: dict[str, Any]) -> dict[str, Any]:
    return {**counters_, "scheduler": ts.schedulers[0].state_dict(),
            "scaler": ts.scaler.state_dict() if ts.scaler is not None else None, **ts.extra}


def write(folder: Path, ts: TrainState, counters_: dict[str, Any], rank: int, asynchronous: bool = False,
          group=None) -> Written | list[Path]:
    """Write this rank's part of the training state into `folder`; returns what it wrote (io.Saver
    hashes it)."""
    folder = Path(folder)
    if ts.format == "deepspeed":
        from llmpipe.checkpoint.zero import TAG

        # Every rank writes its partitions; the trainer state rides along as DeepSpeed's client state.
        ts.engine.save_checkpoint(str(folder), tag=TAG, client_state=counters_)
        # this rank's partitions (zero_pp_rank_<rank>_mp_rank_00_{optim,model}_states.pt); the rest
        # (model states, `latest`, zero_to_fp32.py: rank 0's) are hashed by rank 0 as unclaimed
        return sorted((folder / TAG).glob(f"zero_pp_rank_{rank}_*"))
    if ts.format == "full":
        return _write_full(folder, ts, counters_, rank)
    from llmpipe.checkpoint.dcp import save_state

    hook = ts.hook.write(folder, rank) if ts.hook is not None else []  # every rank's own, beside dcp/
    written = save_state(_dcp_state(ts), folder, rank, asynchronous, group)
    mine = [*hook, folder / TRAINER] if rank == 0 else hook
    if rank == 0:
        torch.save(_trainer_file(ts, counters_), folder / TRAINER)
    return Written(lambda: [*written.claims(), *mine], written.pending)


def _write_full(folder: Path, ts: TrainState, counters_: dict[str, Any], rank: int) -> list[Path]:
    from safetensors.torch import save_file

    from llmpipe.models.llama.parallelize import unwrap_state_dict

    hook = ts.hook.write(folder, rank) if ts.hook is not None else []  # every rank's own
    if rank != 0:  # replicas are identical: rank 0 writes the whole state
        return hook
    save_file({k: v.detach().contiguous().cpu() for k, v in unwrap_state_dict(ts.parts[0]).items()},
              str(folder / MODEL))
    torch.save(ts.optimizers[0].state_dict(), folder / OPTIM)
    torch.save(_trainer_file(ts, counters_), folder / TRAINER)
    return [folder / MODEL, folder / OPTIM, folder / TRAINER, *hook]


EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


def tied_copy(part: nn.Module) -> bool:
    """Whether `part` is a pipeline stage holding a tied head without the embedding it is (the last
    stage's copy): its `output.weight` is stored, read and resharded as `tok_embeddings.weight`."""
    args = getattr(part, "args", None)
    return bool(getattr(args, "tie_embeddings", False)) and getattr(part, "tok_embeddings", None) is None \
        and getattr(part, "output", None) is not None


def stored_name(part: nn.Module, name: str) -> str:
    """The name a checkpoint keeps `part`'s tensor `name` (llmpipe naming) under."""
    return EMBEDDING if name == HEAD and tied_copy(part) else name


def _stored_keys(part: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A part's model or flattened optimizer state dict with the keys a checkpoint uses: a tied copy's
    `output.weight` (and its `state.output.weight.*`, `param_groups.output.weight.*`) renamed."""
    if not tied_copy(part):
        return state
    out = {}
    for key, value in state.items():
        for prefix in ("", "state.", "param_groups."):
            if key == prefix + HEAD or key.startswith(prefix + HEAD + "."):
                key = prefix + EMBEDDING + key[len(prefix + HEAD):]
                break
        out[key] = value
    return out


def _optim_options(ts: TrainState):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True) if ts.state_format == "dcp-flat" else None


def _dcp_state(ts: TrainState) -> dict[str, Any]:
    """{"model": ..., "optim": ...} of every part; get_*_state_dict strip wrapper prefixes
    (checkpoint_wrapper's): keys are llmpipe's names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, opt in zip(ts.parts, ts.optimizers):
        model.update(_stored_keys(part, get_model_state_dict(part)))
        optim.update(_stored_keys(part, get_optimizer_state_dict(part, opt, options=_optim_options(ts))))
    return {"model": model, "optim": optim}


# -- reading ---------------------------------------------------------------------------------------


def read_trainer(folder: Path, ts: TrainState) -> dict[str, Any]:
    """trainer_state.pt: the lr schedules and loss scaler restored; returns the whole record."""
    trainer = load_trainer(folder)
    restore_schedules(ts, trainer)
    return trainer


def load_trainer(folder: Path) -> dict[str, Any]:
    """trainer_state.pt as written (formats full and dcp), without running code from it."""
    return torch.load(Path(folder) / TRAINER, map_location="cpu", weights_only=True)


def restore_schedules(ts: TrainState, trainer: dict[str, Any]) -> None:
    for sched in ts.schedulers:
        sched.load_state_dict(trainer["scheduler"])
    if ts.scaler is not None and trainer.get("scaler"):
        ts.scaler.load_state_dict(trainer["scaler"])


def read_own(folder: Path, env, train_state: Callable[[], TrainState], fmt: str) -> dict[str, Any]:
    """Restore a checkpoint of the strategy's own format (`fmt`; DCP reshards another world size);
    returns the trainer state written with it."""
    folder = Path(folder)
    if fmt == "deepspeed":
        check_zero_world(folder, env.world)  # before DeepSpeed reads anything
        return _read_deepspeed(folder, env, train_state())
    ts = train_state()
    if fmt == "full":
        return _read_full(folder, env, ts)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from llmpipe.checkpoint.dcp import DCP_DIR
    from llmpipe.checkpoint.trust import SafeReader

    state = _dcp_state(ts)  # the shapes and shardings to load into (initialises Adam's states)
    with warnings.catch_warnings():  # one process, no group (DDP at world 1): DCP says it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(folder / DCP_DIR))  # no pickle.load of .metadata
    options = _optim_options(ts)
    for part, opt in zip(ts.parts, ts.optimizers):
        names = get_model_state_dict(part)  # a tied copy reads the embedding (_stored_keys)
        set_model_state_dict(part, {k: state["model"][s] for k, s in zip(names, _stored_keys(part, names))})
        mine = get_optimizer_state_dict(part, opt, options=options)
        set_optimizer_state_dict(part, opt, {k: state["optim"][s] for k, s in zip(mine, _stored_keys(part, mine))},
                                 options=options)
    if ts.hook is not None:
        ts.hook.read(folder, env.rank, env.world, ckpt.read_meta(folder).get("world_size"))
    return read_trainer(folder, ts)


def _read_full(folder: Path, env, ts: TrainState) -> dict[str, Any]:
    from safetensors.torch import load_file

    ts.parts[0].load_state_dict(load_file(str(folder / MODEL), device=str(env.device)), strict=True)
    ts.optimizers[0].load_state_dict(torch.load(folder / OPTIM, map_location=env.device, weights_only=True))
    trainer = read_trainer(folder, ts)
    if ts.hook is not None:
        ts.hook.read(folder, env.rank, env.world, ckpt.read_meta(folder).get("world_size"))
    return trainer


def _read_deepspeed(folder: Path, env, ts: TrainState) -> dict[str, Any]:
    from llmpipe.checkpoint.zero import TAG

    path, client_state = ts.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
    if path is None:
        raise ValueError(f"train.checkpoint.resume: {folder} holds no DeepSpeed checkpoint {TAG!r}")
    return client_state


def check_zero_world(folder: Path, world: int) -> None:
    """ZeRO's own reader needs the world size that wrote the partitions."""
    written = ckpt.read_meta(folder).get("world_size")
    if written != world:
        raise ValueError(f"train.checkpoint.resume: {folder} was written by {written} ranks, this run has "
                         f"{world}; ZeRO partitions resume on the same number of ranks "
                         "(or consolidate the checkpoint and start from its weights)")


def restore(folder: Path, strategy, world: int) -> dict[str, Any]:
    """Restore `strategy` from a verified checkpoint folder, by its own reader or resharded from full
    tensors (whichever `reads_own` picks from meta.json), and torch's RNG; returns the trainer state."""
    if reads_own(ckpt.read_meta(folder), strategy.state_format, world, strategy.legacy_formats):
        state = strategy.read_checkpoint(folder)  # its own layout (DCP reshards another world size)
    else:  # another layout: full tensors by name, resharded into this one
        state = _load_resharded(strategy, folder)
    torch.set_rng_state(state["torch_rng"].cpu())
    return state


def _load_resharded(strategy, folder: Path) -> dict[str, Any]:
    """Read `folder` (any layout) as full tensors (llmpipe.checkpoint.portable) into `strategy`'s shards
    (its load_full); the schedule and loss scale restored here, the loop re-tunes the rest."""
    from llmpipe.checkpoint import portable

    t0 = time.perf_counter()
    state = portable.read(folder)
    strategy.load_full(state.model, state.optim)
    trainer = state.trainer if state.trainer is not None else load_trainer(folder)  # ZeRO's: its client state
    restore_schedules(strategy.train_state(), trainer)
    log.info("resumed %s into a %s layout: %d tensors, %d optimizer states resharded in %.2fs", folder,
             type(strategy).__name__, len(state.model), len(state.optim), time.perf_counter() - t0)
    return trainer
