"""Consolidate a torch.distributed.checkpoint (DCP) folder, as FSDP2 writes it, into one safetensors.

Streaming: names, shapes and dtypes come from DCP's .metadata; each parameter is then loaded alone
(every rank's chunk of it, from the .distcp files) and written at once, so peak memory is about one
full tensor, never the model. No process group is needed, and any world size reads the same.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from llmpipe import device as dev
from llmpipe.checkpoint.io import Written
from llmpipe.checkpoint.stream import write_streaming
from llmpipe.checkpoint.trust import SafeReader
from llmpipe.models.llama import io as model_io

DCP_DIR = "dcp"  # the subfolder of a checkpoint folder (format "dcp") holding the DCP files
MODEL_PREFIX = "model."  # checkpoint.state saves {"model": ..., "optim": ...}; DCP flattens keys with "."


def save_state(state: dict, folder: Path, rank: int, asynchronous: bool = False, group=None) -> Written:
    """DCP-save `state` into folder/dcp (every rank); with `asynchronous`, DCP's async_save on `group`
    (the state is staged to CPU before this returns, written in a background thread). The files
    this rank writes: DCP names them __<rank>_<n>.distcp; rank 0 (the coordinator) adds .metadata.
    A file that naming misses is hashed by rank 0 (io.Saver), so nothing goes unlisted."""
    target = Path(folder) / DCP_DIR
    pending = None
    if asynchronous:
        pending = dcp.async_save(state, checkpoint_id=target, process_group=group)
    else:
        with warnings.catch_warnings():  # one process, no group (DDP at world 1): DCP says it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=target)

    def claims() -> list[Path]:
        return sorted(target.glob(f"__{rank}_*.distcp")) + ([target / ".metadata"] if rank == 0 else [])

    return Written(claims, pending)


class MetadataOnceReader(SafeReader):
    """A SafeReader (restricted unpickler) that reads .metadata once, not once per tensor loaded; every
    reader of a DCP folder tensor by tensor (consolidate, the resharding resume) uses it."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def model_tensors(reader: FileSystemReader) -> dict[str, TensorStorageMetadata]:
    """{llmpipe name: DCP tensor metadata} of the model's entries, sorted by name."""
    entries = reader.read_metadata().state_dict_metadata
    found = {k.removeprefix(MODEL_PREFIX): v for k, v in entries.items()
             if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    if not found:
        raise ValueError(f"{reader.path}: no '{MODEL_PREFIX}*' tensors in the DCP metadata")
    return dict(sorted(found.items()))


def load_tensor(reader: FileSystemReader, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """One full model tensor, assembled from every rank's chunk, on CPU."""
    return load_key(reader, MODEL_PREFIX + name, meta)


def load_key(reader: FileSystemReader, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """The full tensor stored under DCP key `key` (model or optimizer state), on CPU."""
    target = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
    with warnings.catch_warnings():
        # NOTE: dcp.load warns "torch.distributed is disabled ..." even when asked for no_dist.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=reader, no_dist=True)
    return target[key]


def consolidate_dcp(checkpoint: Path, out_dir: Path, dtype_name: str, rename=lambda n: n,
                    filename: str = model_io.WEIGHTS, transform=None) -> dict:
    """Stream checkpoint/dcp's model tensors into out_dir/filename (names mapped by `rename`), cast
    to `dtype_name`. Same signature and result as consolidate.consolidate for format "full"."""
    dtype = dev.dtype(dtype_name)
    reader = MetadataOnceReader(Path(checkpoint) / DCP_DIR)
    tensors = model_tensors(reader)
    shapes = {n: tuple(m.size) for n, m in tensors.items()}
    load = lambda n: load_tensor(reader, n, tensors[n])  # noqa: E731
    if transform is not None:  # LoRA: the adapters merged into their weights
        shapes, load = transform(shapes, load)
    specs = [(rename(n), s, dtype) for n, s in shapes.items()]
    lookup = {new: old for new, old in zip((s[0] for s in specs), shapes)}
    write_streaming(Path(out_dir) / filename, specs, lambda new: load(lookup[new]).to(dtype),
                    metadata={"format": "pt"})
    return {"tensors": len(specs), "params": sum(torch.Size(s[1]).numel() for s in specs)}
