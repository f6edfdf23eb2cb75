"""A model folder: model.safetensors + model_config.json (+ tokenizer.json). Load and save."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmpipe.errors import UserError
from llmpipe.models.llama.model import ModelArgs, Transformer

WEIGHTS = "model.safetensors"
CONFIG = "model_config.json"
TOKENIZER = "tokenizer.json"


class ModelConfigError(UserError, ValueError):
    """A model folder's model_config.json is missing or unreadable; the message names the file."""


def read_args(folder: str | Path) -> ModelArgs:
    path = Path(folder) / CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ModelArgs(**data["model"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelConfigError(f"{path}: not a valid model config ({err})") from None


def write_args(folder: str | Path, args: ModelArgs, dtype: str) -> Path:
    path = Path(folder) / CONFIG
    path.write_text(json.dumps({"model": args.to_dict(), "dtype": dtype}, indent=2) + "\n", encoding="utf-8")
    return path


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Transformer:
    """Build the model from a model folder, weights loaded (strict), in eval mode."""
    folder = Path(folder)
    args = read_args(folder)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()  # fills the RoPE buffers; every parameter is overwritten below
    state = load_file(str(folder / WEIGHTS), device=str(device))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(dtype).eval()
