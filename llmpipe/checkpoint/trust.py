"""Reading a checkpoint's files without running code from them.

A checkpoint folder may come from anywhere (`train.checkpoint.resume: <path>`, a copied run), and
pickle runs whatever a file names. So before any loader (ours, DCP's, DeepSpeed's) touches a file,
its content is checked here:

    .metadata (DCP)   a restricted unpickler that builds only DCP's metadata dataclasses, torch.Size
                      and torch dtypes/layouts/memory formats; and every non-tensor entry it points
                      at inside the .distcp files (DCP unpickles those with weights_only=False) is
                      read with torch.load(weights_only=True)
    *.pt              torch.load(weights_only=True), memory-mapped (tensor data is not read)

`check(folder, files)` returns None or the problem, naming the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_meta

# Exactly the classes FileSystemWriter pickles into .metadata (torch 2.x, filesystem.py/metadata.py).
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_meta, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)
_PATHS = {c.__name__: c for c in (pathlib.PosixPath, pathlib.PurePosixPath,
                                  pathlib.WindowsPath, pathlib.PureWindowsPath)}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return _DCP_CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUMS):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # how torch.layout pickles: name -> layout
            return torch.serialization._get_layout
        if module.split(".")[0] == "pathlib" and name in _PATHS:  # StorageMeta.checkpoint_id
            return _PATHS[name]
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def load_dcp_metadata(path: Path) -> dcp_meta.Metadata:
    """A DCP .metadata file, unpickled with only DCP's metadata classes allowed."""
    with open(path, "rb") as f:
        meta = _MetadataUnpickler(f).load()
    if not isinstance(meta, dcp_meta.Metadata):
        raise pickle.UnpicklingError(f"holds a {type(meta).__name__}, not DCP Metadata")
    return meta


def _check_dcp(path: Path) -> None:
    meta = load_dcp_metadata(path)
    for key, info in (meta.storage_data or {}).items():
        if not isinstance(meta.state_dict_metadata.get(key.fqn), dcp_meta.BytesStorageMetadata):
            continue
        # NOTE: DCP's DefaultLoadPlanner.load_bytes uses torch.load(weights_only=False) on these.
        with open(path.parent / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        if info.transform_descriptors:
            raise pickle.UnpicklingError(f"entry {key.fqn!r} uses transforms {info.transform_descriptors}")
        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def _check_pt(path: Path) -> None:
    from llmpipe.checkpoint.zero import load_pt  # weights_only=True, DeepSpeed's few classes stubbed

    try:
        load_pt(path)
    except ValueError as err:
        raise pickle.UnpicklingError(str(err).removeprefix(f"{path}: ")) from None


def check(folder: Path) -> str | None:
    """None when every pickled file in `folder` loads without code; else the problem, naming the file."""
    for p in sorted(Path(folder).rglob("*")):
        try:
            if p.name == ".metadata" or p.name.endswith(".metadata") and p.name.startswith("__"):
                _check_dcp(p)
            elif p.suffix == ".pt":
                _check_pt(p)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError,
                TypeError, KeyError) as err:
            first = (str(err).splitlines() or [type(err).__name__])[0]
            return f"{p} cannot be read safely ({first}); refusing to load it"
    return None


class SafeReader(dcp_fs.FileSystemReader):
    """DCP's FileSystemReader with .metadata read by the restricted unpickler (not pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        rank = kwargs.get("rank")
        meta = load_dcp_metadata(Path(self._get_metadata_path(rank)))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_meta.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
