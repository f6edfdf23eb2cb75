"""One builder for every layout, in one order (torchtitan's):

    meta -> cut the pipeline stage -> tensor parallel -> LoRA adapters (train.lora; the rest frozen) ->
    activation checkpointing -> (compile) -> data parallel on mesh["dp"] (FSDP2 `fully_shard` or
    `replicate`) -> allocate -> init or load

Nothing is allocated before the last two steps, so a rank only ever holds its own shards plus one
full tensor at a time while initialising (each parameter's full value is drawn, or read from
model.init_from's safetensors, then this rank's slice copied: the same values one process would
have, whatever the layout). Size-1 dimensions are no-ops. Torch's DDP class and DeepSpeed ZeRO-1/2
wrap the allocated model afterwards (`data="none"` here); ZeRO-3 builds its parameters partitioned
from the start (`zero3_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from llmpipe import device as dev
from llmpipe.models.llama import lora
from llmpipe.models.llama.hf import pretrained
from llmpipe.models.llama.model import ModelArgs, Transformer, init_tensor
from llmpipe.models.llama.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    apply_replicate,
    init_weights,
)
from llmpipe.parallel import pipeline, tensor_parallel


def mixed_precision(precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) for FSDP2/replicate: compute in bf16/fp16, reduce gradients in
    fp32. The sharded parameters (and so the optimizer) stay fp32; fp32 training casts nothing."""
    if precision == "fp32":
        return None, None
    return dev.dtype(precision), torch.float32


@dataclass(frozen=True)
class BuildOptions:
    """The few settings the builder reads (not the whole RunConfig)."""

    seed: int  # run.seed: every parameter's initial value is drawn from it (per parameter)
    model: Any = None  # the model section: its init_from names pretrained weights (models.llama.hf.pretrained)
    activation_checkpointing: bool = False  # train.activation_checkpointing
    compile: bool = False  # train.compile
    sequence_parallel: bool = False  # train.parallel.sequence_parallel (tp > 1)
    reshard_after_forward: bool = True  # train.parallel.reshard_after_forward (FSDP2)
    offload_param: str = "none"  # train.parallel.offload_param (ZeRO-3)
    lora: lora.LoraSpec | None = None  # train.lora: adapters on these layers, every other weight frozen

    @classmethod
    def from_config(cls, cfg) -> BuildOptions:
        t, p = cfg.train, cfg.train.parallel
        return cls(seed=cfg.run.seed, model=cfg.model, activation_checkpointing=t.activation_checkpointing,
                   compile=t.compile, sequence_parallel=p.sequence_parallel,
                   reshard_after_forward=p.reshard_after_forward, offload_param=p.offload_param,
                   lora=lora.LoraSpec.of(t.lora))


def build_part(opts: BuildOptions, env, args: ModelArgs, *, mesh: DeviceMesh | None = None, data: str = "none",
               stage: int = 0, n_stages: int = 1, layer_ids: list[int] | None = None) -> Transformer:
    """This rank's model (or pipeline stage `stage` of `n_stages`, holding `layer_ids`), built in
    the fixed order above. `data`: "fsdp" (fully_shard on mesh["dp"]), "replicate" (FSDP2-based DDP
    on mesh["dp"]) or "none" (the caller wraps the allocated model: torch DDP, DeepSpeed)."""
    with torch.device("meta"):
        model = Transformer(args)
    if n_stages > 1:
        pipeline.build_stage_module(model, stage, n_stages, layer_ids)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        tensor_parallel.apply(model, mesh, opts.sequence_parallel)
    if opts.lora is not None:  # before data parallel, which must see what is frozen
        lora.apply_lora(model, opts.lora)
    if opts.activation_checkpointing:
        apply_activation_checkpointing(model)
    if opts.compile:
        apply_compile(model, dev.compile_backend(env.device))
    if data != "none":
        param_dtype, reduce_dtype = mixed_precision(env.precision)
        if data == "fsdp":
            apply_fsdp(model, mesh["dp"], param_dtype, reduce_dtype, opts.reshard_after_forward)
        else:
            apply_replicate(model, mesh["dp"], param_dtype, reduce_dtype)
    model.to_empty(device=env.device)
    init_weights(model, opts.seed, source=initial_values(opts, args, model))
    model.train()
    return model


def initial_values(opts: BuildOptions, args: ModelArgs, model: Transformer):
    """`source(name)` of every parameter's full initial value: model.init_from's weights (None: the
    model's own seeded init), with LoRA's adapters drawn by llmpipe.models.llama.lora (seeded by name
    too: the same values on every layout)."""
    source = pretrained(opts.model, args)
    if opts.lora is None:
        return source
    shapes = {n.replace("_checkpoint_wrapped_module.", ""): tuple(getattr(p, "ds_shape", p.shape))
              for n, p in model.named_parameters()}
    if "output.weight" in shapes:  # a tied head's copy on a pipeline's last stage reads the embedding's value
        shapes.setdefault("tok_embeddings.weight", shapes["output.weight"])
    base = source or (lambda name: init_tensor(args, name, shapes[name], opts.seed))
    return lora.init_source(shapes, opts.seed, base)


def zero3_model(opts: BuildOptions, env, args: ModelArgs, ds_config: dict) -> Transformer:
    """ZeRO-3: every parameter partitioned over the ranks as soon as its module is built
    (deepspeed.zero.Init), so no rank ever holds the whole model; then each rank writes its own
    partition of each parameter's initial value (the same one process would draw, or
    model.init_from's), one full tensor at a time and with no communication."""
    import deepspeed

    # NOTE: zero.Init reads the config before DeepSpeed's own process group exists and takes the
    # world size as 1, so the batch keys (checked against it) are left out: it needs the ZeRO and
    # precision sections (and a micro-batch size, which it insists on) only.
    init_cfg = {k: v for k, v in ds_config.items() if k in ("zero_optimization", "bf16", "fp16",
                                                            "train_micro_batch_size_per_gpu")}
    remote = "cpu" if opts.offload_param != "none" else None
    with deepspeed.zero.Init(config_dict_or_path=init_cfg, remote_device=remote):
        model = Transformer(args)
        if opts.lora is not None:  # made inside zero.Init: the adapters are partitioned too
            lora.apply_lora(model, opts.lora)
    if opts.activation_checkpointing:
        apply_activation_checkpointing(model)
    model.rope_cos, model.rope_sin = model.rope_cos.to(env.device), model.rope_sin.to(env.device)
    source = initial_values(opts, args, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            clean = name.replace("_checkpoint_wrapped_module.", "")
            full = source(clean) if source else init_tensor(args, clean, tuple(p.ds_shape), opts.seed)
            write_partition(p, full, env.rank, env.world)
    model.train()
    return model


def write_partition(p, full: torch.Tensor, rank: int, world: int) -> None:
    """This rank's ZeRO-3 partition of parameter `p` from its full value. DeepSpeed's layout
    (partition_parameters._partition_param): the flattened tensor, padded to a multiple of the world
    size, cut into `world` equal parts, part r on rank r."""
    size = p.ds_tensor.numel()
    if size != -(-p.ds_numel // world):
        raise RuntimeError(f"unexpected ZeRO-3 partition of {tuple(p.ds_shape)}: {size} elements on {world} ranks")
    flat = full.reshape(-1)[rank * size:(rank + 1) * size]
    p.ds_tensor.zero_()
    p.ds_tensor[:flat.numel()].copy_(flat.to(p.ds_tensor.dtype))
