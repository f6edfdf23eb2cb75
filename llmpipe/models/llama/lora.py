"""LoRA (Hu et al. 2021) on a LLaMA model: low-rank adapters beside frozen linear layers.

Each targeted linear layer y = x W^T gains two small matrices, A (rank, in) and B (out, rank):

    y = x W^T + scale * dropout(x) A^T B^T,   scale = alpha / rank

A starts kaiming-uniform (a = sqrt(5), as PEFT's and nn.Linear's default), B at zero, so the adapted
model starts as the base model. The adapters are `lora_a` and `lora_b`, two bias-free nn.Linear
children of the targeted layer (parameter names `layers.N.attention.wq.lora_a.weight`, PEFT's
`lora_A` / `lora_B`); the layer keeps its own `weight` (its name unchanged, so checkpoints, Hugging
Face names and init_from read the base as before). They are modules rather than bare parameters so
that DeepSpeed's ZeRO-3 partitions them when they are made inside its `zero.Init` and gathers them
around their own forward.

Pure torch: no device, distributed or checkpoint code. llmpipe.parallel.builder applies it (after
the model is built on meta, before data parallelism) and freezes every other parameter.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# llmpipe's linear layers LoRA can target -> the block submodule that holds them
TARGETS = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
           "w1": "feed_forward", "w2": "feed_forward", "w3": "feed_forward"}
ADAPTER_PARTS = (".lora_a.weight", ".lora_b.weight")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, section) -> LoraSpec | None:
        """From train.lora (a config section, or its dict form as meta.json records it); None: no LoRA."""
        if section is None:
            return None
        get = section.get if isinstance(section, dict) else lambda k: getattr(section, k)
        return cls(int(get("rank")), float(get("alpha")), float(get("dropout")), tuple(get("targets")))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


class LoRALinear(nn.Linear):
    """A bias-free nn.Linear with a low-rank adapter: made by `add_adapter` from an existing layer."""

    lora_a: nn.Linear  # (rank, in)
    lora_b: nn.Linear  # (out, rank)
    lora_scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.lora_scale


def add_adapter(layer: nn.Linear, spec: LoraSpec) -> LoRALinear:
    """Turn `layer` into a LoRALinear in place (its class swapped, its weight kept), the adapters made
    on the device of its weight (meta while building; ZeRO-3 partitions them inside zero.Init)."""
    if layer.bias is not None:
        raise ValueError("LoRA adapters here are for bias-free linear layers")
    device = layer.weight.device
    layer.lora_a = nn.Linear(layer.in_features, spec.rank, bias=False, device=device)
    layer.lora_b = nn.Linear(spec.rank, layer.out_features, bias=False, device=device)
    layer.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
    layer.lora_scale = spec.scale
    layer.__class__ = LoRALinear
    return layer  # type: ignore[return-value]


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Adapters on every targeted layer of every block `model` holds (a pipeline stage: its own), then
    every parameter but the adapters frozen (requires_grad False: no gradient, no optimizer state)."""
    for block in model.layers.values():
        for target in spec.targets:
            add_adapter(getattr(getattr(block, TARGETS[target]), target), spec)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_PARTS)


def init_adapter(name: str, shape: tuple[int, ...], seed: int | None) -> torch.Tensor:
    """The initial value of adapter `name`, full size, fp32 on CPU: lora_a kaiming-uniform (a = sqrt(5):
    uniform within 1/sqrt(in)), drawn from its own generator seeded by (seed, name) like every
    parameter (so every layout starts from the same values); lora_b zero."""
    t = torch.zeros(shape, dtype=torch.float32)
    if name.endswith(".lora_b.weight"):
        return t
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=gen)


def init_source(shapes: dict[str, tuple[int, ...]], seed: int | None,
                base: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """A `source(name)` for Transformer.init_weights: adapters drawn by init_adapter (their `shapes`
    by name), every other parameter from `base` (pretrained weights, or the model's own init)."""
    def source(name: str) -> torch.Tensor:
        return init_adapter(name, shapes[name], seed) if is_adapter(name) else base(name)
    return source


def merged(names: dict[str, tuple[int, ...]], load: Callable[[str], torch.Tensor], scale: float):
    """A checkpoint's tensors (`names`: llmpipe name -> shape; `load(name)` reads one, fp32) as the merged
    model: the adapters dropped, each targeted weight W replaced by W + scale * B @ A (in fp32).
    Returns (name -> shape, load) of the merged model, one tensor read and merged at a time."""
    shapes = {n: s for n, s in names.items() if not is_adapter(n)}

    def load_merged(name: str) -> torch.Tensor:
        w = load(name)
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_a.weight" not in names:
            return w
        a, b = load(f"{stem}.lora_a.weight").float(), load(f"{stem}.lora_b.weight").float()
        return (w.float() + scale * (b @ a)).to(w.dtype)

    return shapes, load_merged


def block_adapter_params(args, spec: LoraSpec) -> int:
    """Adapter parameters in one transformer block of a model of `args` (ModelArgs): rank x (in + out)
    per targeted layer."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    sizes = {"wq": args.dim + q, "wk": args.dim + kv, "wv": args.dim + kv, "wo": q + args.dim,
             "w1": args.dim + args.ffn_dim, "w2": args.ffn_dim + args.dim, "w3": args.dim + args.ffn_dim}
    return spec.rank * sum(sizes[t] for t in spec.targets)
