"""Consolidate a DeepSpeed ZeRO-1/2/3 checkpoint into one safetensors file, streaming.

The weights are rebuilt from the fp32 master partitions in each rank's optimizer file
(`zero_pp_rank_R_mp_rank_00_optim_states.pt`), with names and shapes from the model states file,
following the layout DeepSpeed's own zero_to_fp32.py reads:

    ZeRO-1/2  per param group, the ranks' partitions concatenated form one flat vector (padded at
              the end); parameters lie in it back to back, in `param_shapes` order, each followed by
              its `param_alignment_paddings` entry.
    ZeRO-3    every parameter is split across all ranks: rank r holds elements [r*k, (r+1)*k) of it,
              k = ceil(numel / world), zero-padded; on each rank the parameters' pieces lie back to
              back across the rank's flat groups, in `param_shapes` order.

zero_to_fp32 loads every partition and then the whole state dict. Here each parameter is assembled
alone and written at once (write_streaming); the files are memory-mapped, and re-mapped after every
`remap_bytes` read, because touched pages of a mapped file count in the process's RSS. Peak memory is
then about `remap_bytes` plus a few copies of the largest tensor, not the model.
"""

from __future__ import annotations

import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmpipe import device as dev
from llmpipe.checkpoint.state import EMBEDDING, HEAD
from llmpipe.checkpoint.stream import write_streaming
from llmpipe.models.llama import io as model_io

TAG = "deepspeed"  # DeepSpeed's tag folder inside each llmpipe checkpoint folder; `latest` names it too
REMAP_BYTES = 64 << 20
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")  # bf16_: bf16 runs
# DeepSpeed objects pickled into its checkpoint files besides tensors and plain containers.
_DS_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum",
               "deepspeed.runtime.fp16.loss_scaler.LossScaler",
               "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
               "deepspeed.utils.tensor_fragment.fragment_address")


class _Stub:
    """Stands in for a DeepSpeed object (an enum, a loss scaler, a namedtuple) while unpickling:
    its arguments and state are kept as data, and no DeepSpeed code is imported or run."""

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def load_pt(path: Path) -> dict[str, Any]:
    """torch.load a DeepSpeed file memory-mapped, with weights_only=True.

    NOTE: DeepSpeed pickles a few of its own classes into optimizer files, which weights_only=True
    refuses. Rather than weights_only=False (arbitrary code), each is allowed by its exact name and
    mapped to `_Stub`, so nothing but tensors and plain containers is ever built.
    """
    with torch.serialization.safe_globals([(_Stub, name) for name in _DS_GLOBALS]):
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(f"{path}: cannot read it safely ({str(err).splitlines()[0]})") from None


def _plain(value: Any) -> Any:
    """A stubbed enum (ZeroStageEnum) -> its value; anything else unchanged."""
    return value.args[0] if isinstance(value, _Stub) and getattr(value, "args", None) else value


@dataclass
class Layout:
    """Where each parameter's elements lie in the ranks' fp32 flat groups."""

    stage: int
    world: int
    groups_key: str  # the optimizer-state key holding the list of flat fp32 tensors
    files: list[Path]  # optimizer state file per rank
    shapes: dict[str, torch.Size] = field(default_factory=dict)
    pieces: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)  # (rank, group, start, n)
    aliases: dict[str, str] = field(default_factory=dict)  # shared (tied) parameter -> the one stored
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # frozen parameters (LoRA's base): not in the optimizer's flat groups but in the model states
    # files, as zero_to_fp32 reads them: whole in the one file (ZeRO-1/2), or each rank's partition
    # in its own file (ZeRO-3), concatenated then cut to size
    frozen: dict[str, torch.Size] = field(default_factory=dict)
    model_files: list[Path] = field(default_factory=list)

    def frozen_tensor(self, name: str) -> torch.Tensor:
        """One frozen parameter, full, fp32 (bf16 runs store it in bf16: DeepSpeed casts the module)."""
        shape = self.frozen[name]
        parts = [load_pt(f)["frozen_param_fragments"][name].reshape(-1) for f in self.model_files]
        return torch.cat(parts)[:shape.numel()].float().view(shape)


def deepspeed_dir(checkpoint: Path) -> Path:
    """The DeepSpeed tag folder inside an llmpipe checkpoint folder (named by `latest`, if any)."""
    latest = Path(checkpoint) / "latest"
    tag = latest.read_text().strip() if latest.is_file() else TAG
    folder = Path(checkpoint) / tag
    if not folder.is_dir():
        raise ValueError(f"{checkpoint}: no DeepSpeed checkpoint folder {tag!r}")
    return folder


def _optim_files(ds_dir: Path) -> list[Path]:
    found: dict[int, Path] = {}
    for p in ds_dir.iterdir():
        if m := _OPTIM_RE.match(p.name):
            if int(m.group(2)) != 0:
                raise ValueError(f"{p}: model-parallel DeepSpeed checkpoints are not supported")
            found[int(m.group(1))] = p
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(f"{ds_dir}: expected zero_pp_rank_0..N-1 optimizer files, found ranks {sorted(found)}")
    return [found[r] for r in range(len(found))]


def _model_file(ds_dir: Path) -> Path:
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (ds_dir / name).is_file():
            return ds_dir / name
    raise ValueError(f"{ds_dir}: no DeepSpeed model states file")


def _split(offset: int, n: int, bounds: list[int]) -> list[tuple[int, int, int]]:
    """Elements [offset, offset+n) of flat vectors laid end to end (bounds: cumulative sizes, from 0)
    -> [(vector index, start within it, count)]."""
    out = []
    for i in range(len(bounds) - 1):
        lo, hi = max(offset, bounds[i]), min(offset + n, bounds[i + 1])
        if lo < hi:
            out.append((i, lo - bounds[i], hi - lo))
    return out


def _pieces_zero12(layout: Layout, groups: list[dict], sizes: list[int], paddings: list | None) -> None:
    """ZeRO-1/2: parameter i of group g lies in the concatenation over ranks of partition g."""
    w = layout.world
    for g, (shapes, size) in enumerate(zip(groups, sizes)):
        bounds = [r * size for r in range(w + 1)]
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = math.prod(shape)
            layout.shapes[name] = torch.Size(shape)
            layout.pieces[name] = [(r, g, start, k) for r, start, k in _split(offset, n, bounds)]
            offset += n + (paddings[g][i] if paddings else 0)
        # NOTE: DeepSpeed pads each flat group to a multiple of 2 x world (zero_to_fp32's check).
        align = 2 * w
        if math.ceil(offset / align) * align != math.ceil(size * w / align) * align:
            raise ValueError(f"ZeRO-{layout.stage} group {g}: parameters take {offset} elements, "
                             f"the partitions hold {size * w}")


def _pieces_zero3(layout: Layout, groups: list[dict], sizes: list[int]) -> None:
    """ZeRO-3: each rank holds ceil(numel/world) elements of every parameter, back to back."""
    w = layout.world
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    offset = 0
    for shapes in groups:
        for name, shape in shapes.items():
            n = math.prod(shape)
            k = math.ceil(n / w)
            layout.shapes[name] = torch.Size(shape)
            pieces = []
            for r in range(w):  # rank r: elements [r*k, min((r+1)*k, n)); the rest is padding
                take = min(k, n - r * k)
                pieces += [(r, g, start, c) for g, start, c in _split(offset, take, bounds)] if take > 0 else []
            layout.pieces[name] = pieces
            offset += k
    if offset != bounds[-1]:
        raise ValueError(f"ZeRO-3: parameters take {offset} elements per rank, the flat groups hold {bounds[-1]}")


def read_layout(checkpoint: Path) -> Layout:
    """Parse a DeepSpeed checkpoint's metadata (no weights are read)."""
    ds_dir = deepspeed_dir(checkpoint)
    files = _optim_files(ds_dir)
    model = load_pt(_model_file(ds_dir))
    optim = load_pt(files[0])["optimizer_state_dict"]
    if "zero_stage" not in optim:
        raise ValueError(f"{files[0]}: not a ZeRO optimizer checkpoint (no zero_stage)")
    stage, count = int(_plain(optim["zero_stage"])), optim["partition_count"]
    world = max(count) if isinstance(count, list) else int(count)
    if world != len(files):
        raise ValueError(f"{ds_dir}: ZeRO partition count {world}, but {len(files)} optimizer files")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    layout = Layout(stage, world, key, files, aliases=dict(model.get("shared_params") or {}))
    if model.get("frozen_param_shapes"):
        layout.frozen = {n: torch.Size(s) for n, s in model["frozen_param_shapes"].items()}
        layout.model_files = ([ds_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
                              if stage == 3 else [_model_file(ds_dir)])
    layout.buffers = {k: v.float() if v.is_floating_point() else v.clone()
                      for k, v in model["module"].items() if k in set(model["buffer_names"])}
    sizes = [t.numel() for t in optim[key]]
    if stage == 3:
        _pieces_zero3(layout, model["param_shapes"], sizes)
    else:
        _pieces_zero12(layout, model["param_shapes"], sizes, optim.get("param_alignment_paddings"))
    return layout


class _Partitions:
    """The ranks' fp32 flat groups, memory-mapped on demand; dropped (unmapped) after `remap_bytes`
    have been read, so the file pages touched so far stop counting in this process's RSS."""

    def __init__(self, layout: Layout, remap_bytes: int, state: str | None = None):
        self.layout, self.remap_bytes, self.state = layout, remap_bytes, state
        self.open: dict[int, list[torch.Tensor]] = {}
        self.read = 0

    def groups(self, rank: int) -> list[torch.Tensor]:
        """This rank's flat groups: the fp32 master partitions, or (`state`) AdamW's state of them."""
        if rank not in self.open:
            optim = load_pt(self.layout.files[rank])["optimizer_state_dict"]
            if self.state is None:
                self.open[rank] = optim[self.layout.groups_key]
            else:  # the torch optimizer over the flat groups: ZeRO-1/2 and ZeRO-3 file it differently
                states = optim["optimizer_state_dict" if self.layout.stage == 3 else "base_optimizer_state"]["state"]
                self.open[rank] = [states[g][self.state] for g in sorted(states)]
        return self.open[rank]

    def tensor(self, name: str) -> torch.Tensor:
        """One full fp32 parameter, assembled from its pieces."""
        out = torch.empty(self.layout.shapes[name].numel(), dtype=torch.float32)
        at = 0
        for rank, group, start, n in self.layout.pieces[name]:
            out[at:at + n].copy_(self.groups(rank)[group][start:start + n])
            at += n
        self.read += out.nbytes
        if self.read >= self.remap_bytes:
            self.open.clear()  # the last reference to each mapping: unmapped here
            self.read = 0
        return out.view(self.layout.shapes[name])


def _full(layout: Layout, parts: _Partitions, name: str) -> torch.Tensor:
    """Any stored tensor by name: a buffer, a frozen parameter, or a trained one (fp32 masters)."""
    if name in layout.buffers:
        return layout.buffers[name]
    return layout.frozen_tensor(name) if name in layout.frozen else parts.tensor(name)


def _tensor_specs(layout: Layout, dtype: torch.dtype) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """name -> (the stored tensor it comes from, shape, output dtype), for parameters, tied aliases
    and persistent buffers (integer buffers keep their dtype)."""
    specs = {n: (n, tuple(s), dtype) for n, s in {**layout.shapes, **layout.frozen}.items()}
    # NOTE: a tied head (DeepSpeed records output.weight as shared with tok_embeddings.weight) is written
    # once, as every llmpipe format keeps it (llmpipe.checkpoint.state)
    specs.update({alias: specs[src] for alias, src in layout.aliases.items()
                  if src in specs and (alias, src) != (HEAD, EMBEDDING)})
    specs.update({n: (n, tuple(b.shape), dtype if b.is_floating_point() else b.dtype)
                  for n, b in layout.buffers.items()})
    return dict(sorted(specs.items()))


def read_full_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict]:
    """A ZeRO checkpoint as full fp32 tensors by name: the master weights, AdamW's exp_avg and
    exp_avg_sq per parameter (assembled from the same flat layout) and its step, and the trainer
    state llmpipe stored as DeepSpeed's client state (with DeepSpeed's lr scheduler state)."""
    layout = read_layout(checkpoint)
    weights, moments = _Partitions(layout, REMAP_BYTES), {k: _Partitions(layout, REMAP_BYTES, k)
                                                         for k in ("exp_avg", "exp_avg_sq")}
    first = load_pt(layout.files[0])["optimizer_state_dict"]
    states = first["optimizer_state_dict" if layout.stage == 3 else "base_optimizer_state"]["state"]
    model, optim = {}, {}
    for name in layout.frozen:  # no optimizer state
        model[name] = layout.frozen_tensor(name)
    for name in layout.shapes:
        model[name] = weights.tensor(name).clone()
        group = layout.pieces[name][0][1]
        optim[name] = {k: p.tensor(name).clone() for k, p in moments.items()}
        optim[name]["step"] = states[group]["step"].clone()
    client = load_pt(_model_file(deepspeed_dir(checkpoint)))
    trainer = {k: client[k] for k in ("step", "consumed_samples", "torch_rng")}
    trainer["scheduler"] = client["lr_scheduler"]
    return model, optim, trainer


def consolidate_zero(checkpoint: Path, out_dir: Path, dtype_name: str, rename=lambda n: n,
                     filename: str = model_io.WEIGHTS, transform=None, remap_bytes: int = REMAP_BYTES) -> dict:
    """Stream a DeepSpeed ZeRO checkpoint's fp32 master weights into out_dir/filename, names mapped by
    `rename` (the contract of llmpipe.checkpoint.consolidate.consolidate)."""
    layout = read_layout(checkpoint)
    parts = _Partitions(layout, remap_bytes)
    specs = _tensor_specs(layout, dev.dtype(dtype_name))
    shapes = {n: shape for n, (_, shape, _) in specs.items()}
    read = lambda n: _full(layout, parts, specs[n][0])  # noqa: E731
    if transform is not None:  # LoRA: the adapters merged into their weights
        shapes, read = transform(shapes, read)
    source = {rename(n): (n, shape, specs[n][2]) for n, shape in shapes.items()}

    def load(out_name: str) -> torch.Tensor:
        name, _, dtype = source[out_name]
        return read(name).to(dtype)

    write_streaming(Path(out_dir) / filename, [(name, shape, dtype) for name, (_, shape, dtype) in source.items()],
                    load, metadata={"format": "pt"})
    return {"tensors": len(source), "params": sum(torch.Size(s[1]).numel() for s in source.values()),
            "zero_stage": layout.stage}
