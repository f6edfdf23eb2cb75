"""The ONNX graph contract between export_onnx and every engine that runs its graphs: the file names,
the static decoder's cache length, the decoders' input names, and how a graph is written (one
external data file above EXTERNAL_DATA_BYTES). Light on purpose (no onnx, onnxruntime or torch at
import): config checks and plans read it too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmpipe.errors import StageError

if TYPE_CHECKING:
    import onnx

MODEL_FILE = "model.onnx"
DECODER_FILE = "decoder_with_past.onnx"
STATIC_FILE = "decoder_static.onnx"
ORT_DECODER_FILE = "decoder_ort.onnx"  # decoder_static's maths with the cache length dynamic: onnxruntime only
DEFAULT_CACHE_LEN = 1024  # export.kv_cache_len null: min(model max_seq_len, this)
# Protobuf cannot serialize a message over 2 GiB; above this many bytes of weights the tensors go
# to one external data file beside the graph (`<graph>.data`).
EXTERNAL_DATA_BYTES = int(1.8e9)


def decoder_names(n_layers: int, kind: str) -> list[str]:
    """past.{i}.key, past.{i}.value, ... (or present.*) in layer order."""
    return [f"{kind}.{i}.{part}" for i in range(n_layers) for part in ("key", "value")]


def cache_len(requested: int | None, max_seq_len: int) -> int:
    """The static decoder's cache length: export.kv_cache_len, else min(max_seq_len, 1024); it
    cannot exceed the model's max_seq_len (RoPE tables end there)."""
    if requested is None:
        return min(max_seq_len, DEFAULT_CACHE_LEN)
    if requested > max_seq_len:
        raise StageError(f"export.kv_cache_len={requested} exceeds the model's max_seq_len {max_seq_len}")
    return requested


def static_inputs(n_layers: int) -> list[str]:
    return ["input_ids", "position_ids", "attention_mask", *decoder_names(n_layers, "cache")]


def model_files(path: Path) -> list[Path]:
    """The ONNX graph file and its external data file, when it has one."""
    data = path.with_name(path.name + ".data")
    return [path, data] if data.is_file() else [path]


def save_model(proto: onnx.ModelProto, path: Path, external: bool) -> list[Path]:
    """Write `proto` to `path`; with `external`, all tensors (initializers and Constant nodes, such as
    the RoPE tables) go to one `<name>.data` file beside it."""
    import onnx  # here: the contract's other readers need no onnx

    path.with_name(path.name + ".data").unlink(missing_ok=True)
    if external:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024, convert_attribute=True)
    else:
        onnx.save_model(proto, str(path))
    return model_files(path)
