"""Write a safetensors file one tensor at a time, so peak memory is one tensor, not the model.

safetensors' own `save_file` needs the whole state dict in memory; consolidating a large model
must not. The format is an 8-byte little-endian header length, a JSON header with each tensor's
dtype, shape and byte range, then the raw bytes in header order.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
           torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL", torch.float64: "F64"}


def write_streaming(path: Path, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                    load: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write tensors `specs` (name, shape, dtype) to `path`, fetching each with `load(name)` once.

    The file appears atomically (written as a temp file, then renamed).
    """
    specs = list(specs)
    header: dict[str, dict] = {}
    offset = 0
    for name, shape, dtype in specs:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in specs:
            t = load(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: expected {tuple(shape)} {dtype}, got {tuple(t.shape)} {t.dtype}")
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            del t
    os.replace(tmp, path)
