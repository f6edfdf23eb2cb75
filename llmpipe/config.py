"""Typed run configuration: YAML -> validated tree, with `--set a.b=c` overrides.

Every section is a pydantic model that forbids unknown keys. `load(path, overrides)` returns a
`RunConfig`; any problem raises `ConfigError` whose message names the field and the bad value. After
the fields, llmpipe.config_checks checks what they say together (the model, the layout, ATC shapes).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

STAGES = ("prepare_data", "train", "consolidate", "export_onnx", "convert_om", "benchmark")
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_STEPS = 10_000_000
# How far from_dict checks: the fields only (a recorded config; no torch import), or also what the
# config tells about its model, layout and ATC shapes at any world size (the default).
Check = Literal["fields", "model"]


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line meant for the user."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str = Field("tiny", description="Run name: the folder artifacts/<name>/ (letters, digits, . _ -).")
    artifacts_dir: str = Field("artifacts", description="Root folder for all runs' outputs (a folder, or "
                               "none yet: created on the first stage).")
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="Accelerator; auto picks npu > cuda > cpu.")
    seed: int = Field(1234, ge=0, description="Seed for data split, sampling order and weight init.")
    retries: int = Field(1, ge=0, le=10, description="Retries of a stage after a transient failure (a rank "
                         "killed from outside, a lost connection); deterministic errors are never retried.")
    retry_delay_s: float = Field(10.0, ge=0, description="Wait before a retry.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not RUN_NAME_RE.match(v) or v in (".", ".."):
            raise ValueError(f"{v!r} is not a valid run name (1-64 of letters, digits, '.', '_', '-')")
        return v


class TokenizerSection(Section):
    path: str | None = Field(None, description="An existing tokenizer.json to load; null trains a new one.")
    vocab_size: int = Field(8192, ge=260, le=1_000_000, description="BPE vocabulary size when training.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    eos_token: str = Field("<|endoftext|>", description="Token inserted between documents.")


class DataSection(Section):
    inputs: list[str] = Field(..., min_length=1, description="Globs of .txt/.jsonl (or any text) files. "
                              "'{stdlib}' expands to this Python's standard library folder.")
    text_field: str = Field("text", description="Field holding the text in .jsonl records.")
    seq_len: int = Field(256, ge=8, le=1_048_576, description="Tokens per training sample.")
    val_fraction: float = Field(0.01, gt=0.0, lt=0.5, description="Fraction of documents held out.")
    max_files: int | None = Field(None, ge=1, description="Read at most this many files (sorted order).")
    max_file_bytes: int = Field(64 << 20, ge=1, description="Files larger than this are skipped (with reason).")
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)


class ModelSection(Section):
    flavor: str = Field("tiny", description="Named architecture in llmpipe.models.llama.flavors.")
    dim: int | None = Field(None, ge=8, description="Override: hidden size.")
    n_layers: int | None = Field(None, ge=1, description="Override: transformer blocks.")
    n_heads: int | None = Field(None, ge=1, description="Override: attention heads.")
    n_kv_heads: int | None = Field(None, ge=1, description="Override: key/value heads (GQA).")
    ffn_dim: int | None = Field(None, ge=8, description="Override: SwiGLU intermediate size.")
    max_seq_len: int | None = Field(None, ge=8, description="Override: longest sequence (RoPE table).")
    rope_theta: float | None = Field(None, gt=0, description="Override: RoPE base.")
    norm_eps: float | None = Field(None, gt=0, description="Override: RMSNorm epsilon.")


class ParallelSection(Section):
    data: Literal["ddp", "zero", "fsdp"] = Field("ddp", description="Data-parallel strategy: DDP replicas, "
                                                 "DeepSpeed ZeRO (zero_stage), or FSDP2 (fully_shard).")
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size (MB).")
    gradient_as_bucket_view: bool = Field(True, description="DDP: gradients are views into buckets.")
    static_graph: bool = Field(True, description="DDP: the autograd graph is the same every step.")
    broadcast_buffers: bool = Field(False, description="DDP: sync buffers from rank 0 before each forward "
                                   "(torch's forward_sync_buffers).")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO: 1 shards optimizer states, 2 also gradients, "
                            "3 also parameters. 0 with data=ddp/fsdp.")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="ZeRO: keep optimizer states "
                                                      "(and the step) in host memory.")
    offload_param: Literal["none", "cpu"] = Field("none", description="ZeRO-3: keep parameters in host memory.")
    pin_memory: bool = Field(True, description="ZeRO offload: page-locked host buffers.")
    reduce_bucket_size: int = Field(500_000_000, ge=1, description="ZeRO: elements per gradient reduce bucket.")
    allgather_bucket_size: int = Field(500_000_000, ge=1, description="ZeRO-1/2: elements per all-gather.")
    overlap_comm: bool = Field(True, description="ZeRO: overlap gradient reduction with backward.")
    contiguous_gradients: bool = Field(True, description="ZeRO: copy gradients into one contiguous buffer.")
    zero_optimizer: Literal["auto", "torch", "deepspeed"] = Field(
        "auto", description="ZeRO: DeepSpeed's own compiled AdamW (FusedAdam / DeepSpeedCPUAdam), or torch "
        "AdamW as a client optimizer; auto: DeepSpeed's where its ops are prebuilt, else torch.")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered parameters after forward "
                                        "(ZeRO-3-like); false keeps them until backward (ZeRO-2-like).")

    dp: int | None = Field(None, ge=1, description="Data-parallel degree; null: world size / (tp * pp). "
                           "When set, dp * tp * pp must equal the world size.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree: each block's matmuls split over tp ranks "
                    "(must divide heads, kv heads, ffn dim, vocab and dim).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree: the layers cut into pp stages.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="Pipeline schedule (torch.distributed.pipelining); interleaved needs virtual_stages.")
    microbatches: int = Field(4, ge=1, description="Pipeline micro-batches per micro-step (each "
                              "micro_batch_size / microbatches samples); 1f1b schedules need >= pp.")
    virtual_stages: int = Field(1, ge=1, description="Stages per pipeline rank (interleaved_1f1b needs >= 2).")
    split_points: list[int] | None = Field(None, description="Explicit first layer index of every stage but "
                                           "the first, increasing (pp * virtual_stages - 1 of them); "
                                           "null: even split, earlier stages take the extra layers.")
    sequence_parallel: bool = Field(False, description="TP: shard norms and residuals along the sequence.")

    @model_validator(mode="after")
    def _layout(self) -> ParallelSection:
        if self.data == "zero" and self.zero_stage == 0:
            raise ValueError("data=zero needs zero_stage 1, 2 or 3 (got 0)")
        if self.data != "zero" and self.zero_stage != 0:
            raise ValueError(f"zero_stage={self.zero_stage} needs data=zero (got data={self.data})")
        if self.offload_optimizer != "none" and self.data != "zero":
            raise ValueError(f"offload_optimizer={self.offload_optimizer} needs data=zero (got data={self.data})")
        if self.offload_param != "none" and not (self.data == "zero" and self.zero_stage == 3):
            raise ValueError("offload_param needs data=zero with zero_stage=3 "
                             f"(got data={self.data}, zero_stage={self.zero_stage})")
        self._model_parallel()
        return self

    def _model_parallel(self) -> None:
        """Checks that need no model or world size (those live in llmpipe.parallel.mesh)."""
        stages = self.pp * self.virtual_stages
        if self.pp_schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise ValueError(f"pp_schedule=interleaved_1f1b needs virtual_stages >= 2 (got {self.virtual_stages})")
        if self.pp_schedule != "interleaved_1f1b" and self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs pp_schedule=interleaved_1f1b "
                             f"(got {self.pp_schedule})")
        if self.pp > 1 and self.pp_schedule != "gpipe" and self.microbatches < self.pp:
            raise ValueError(f"pp_schedule={self.pp_schedule} needs microbatches >= pp "
                             f"(got microbatches={self.microbatches}, pp={self.pp})")
        if self.split_points is not None and len(self.split_points) != stages - 1:
            raise ValueError(f"split_points needs pp * virtual_stages - 1 = {stages - 1} entries "
                             f"(got {len(self.split_points)})")
        if self.split_points and any(b <= a for a, b in zip([0, *self.split_points], self.split_points)):
            raise ValueError(f"split_points must be positive and strictly increasing (got {self.split_points})")
        if self.zero_stage and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"data=zero does not compose with tp/pp here (got tp={self.tp}, pp={self.pp}); "
                             "use data=ddp or fsdp")


class LossScaleSection(Section):
    init: float = Field(65536.0, gt=0, description="fp16: initial loss scale.")
    growth_interval: int = Field(2000, ge=1, description="fp16: steps without overflow before the scale grows.")


class PrecisionSection(Section):
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast dtype (fp16 adds a GradScaler); auto: bf16 on npu/cuda, fp32 on cpu "
        "(CPUs without native bf16 run it an order of magnitude slower).")
    loss_scale: LossScaleSection = Field(default_factory=LossScaleSection)


class OptimSection(Section):
    lr: float = Field(3.0e-4, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1.0e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (not on norms).")
    clip_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm; null: off.")
    lr_reference_batch: int | None = Field(None, ge=1, description="Linear lr scaling: the peak lr is "
                                           "lr x global_batch / lr_reference_batch (sequences); null: lr as given.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class ScheduleSection(Section):
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up length, in `warmup_unit`s.")
    warmup_unit: Literal["steps", "micro_batches"] = Field(
        "steps", description="steps: optimizer steps; micro_batches: micro-batch steps, so the warm-up "
        "covers the same data whatever grad_accum_steps is (divided by it, rounded up).")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak.")


class CheckpointSection(Section):
    every_steps: int = Field(50, ge=1, description="Save a checkpoint every N optimizer steps (and at the end).")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept; older ones are removed.")
    resume: bool | Literal["auto"] | str = Field("auto", description="auto: newest valid checkpoint of this "
                                                 "stage; false: start over; a path: that checkpoint.")
    async_save: bool = Field(False, description="Write checkpoints in the background (DCP async_save, format "
                          "dcp: data=fsdp or tp/pp > 1); the step loop waits only while the state is copied. "
                          "Other formats save synchronously (with a log line).")


class EvalSection(Section):
    every_steps: int = Field(50, ge=1, description="Validation every N steps (and at the start and end).")
    samples: int | None = Field(None, ge=1, description="The validation set: the first N sequences of the val "
                             "shard (all of it when smaller), the same under every layout, split across the "
                             "data-parallel ranks; null: batches x micro_batch_size.")
    batches: int = Field(8, ge=1, description="With samples null, the validation set is batches x "
                      "micro_batch_size sequences in total (not per rank).")


class ProfileSection(Section):
    enabled: bool = Field(False, description="Profile training steps with torch.profiler (torch_npu's on NPU).")
    wait: int = Field(1, ge=0, description="Steps skipped before each profiling cycle.")
    warmup: int = Field(1, ge=0, description="Steps traced but discarded (profiler warm-up).")
    active: int = Field(3, ge=1, description="Steps recorded per cycle.")
    repeat: int = Field(1, ge=1, description="Profiling cycles.")
    record_shapes: bool = Field(False, description="Record operator input shapes.")
    with_stack: bool = Field(False, description="Record Python stacks (large traces).")


class DebugSection(Section):
    """Troubleshooting switches (the seed's table): off by default except the NaN/Inf guard."""

    check_init_params: bool = Field(False, description="After building: every data-parallel replica holds "
                                    "bitwise the same parameters (stops naming those that differ).")
    check_grad_consistency_every: int = Field(0, ge=0, description="Every N optimizer steps, check that the "
                                              "synchronised gradients agree across replicas; 0: off.")
    nan_guard: Literal["off", "skip", "stop"] = Field(
        "stop", description="Non-finite loss or gradients (not fp16 overflow, which the loss scaler skips): "
        "stop naming the parameters, skip the update and go on, or off (the loss is still checked).")
    loss_scale_stop_below: float | None = Field(None, gt=0, description="fp16: stop when the loss scale "
                                                "falls below this (it warns below 1 regardless); null: never.")


class HcclSection(Section):
    """HCCL settings exported to every rank on NPU (null: HCCL's default). Timeouts come from
    train.dist_timeout_s."""

    algo: str | None = Field(None, description="HCCL_ALGO, e.g. 'level0:NA;level1:H-D_R'.")
    buffer_size_mb: int | None = Field(None, ge=1, description="HCCL_BUFFER_SIZE in MB.")
    ib_hca: str | None = Field(None, description="HCCL_IB_HCA: RDMA devices to use.")
    socket_ifname: str | None = Field(None, description="HCCL_SOCKET_IFNAME: the NIC for HCCL's sockets.")


class TrainSection(Section):
    nproc_per_node: int = Field(1, ge=1, le=1024, description="Processes torchrun starts on this node.")
    micro_batch_size: int = Field(8, ge=1, description="Samples per rank per forward pass.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    max_steps: int = Field(200, ge=1, le=MAX_STEPS, description="Optimizer steps to train (at most 10 million: "
                           "LLaMA-2's 2T tokens at 4M tokens per step are 500k steps, so more is a typo).")
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    precision: PrecisionSection = Field(default_factory=PrecisionSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    activation_checkpointing: bool = Field(False, description="Recompute each block in backward.")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    log_every: int = Field(10, ge=1, description="Print a progress line every N steps.")
    peak_tflops: float | None = Field(None, gt=0, description="Peak dense TFLOPS per device for MFU; "
                                      "null: device.py's table for the detected device.")
    threads_per_proc: int | None = Field(None, ge=1, description="torch intra-op threads per rank "
                                         "(CPU); null: cores / nproc_per_node.")
    dist_timeout_s: int = Field(1800, ge=10, description="Timeout for process-group init and collectives.")
    hostfile: str | None = Field(None, description="Several nodes: a DeepSpeed hostfile ('host slots=N' per "
                                 "line); the stage then uses the DeepSpeed launcher instead of torchrun.")
    master_addr: str | None = Field(None, description="Several nodes: address of the rank-0 host "
                                    "(default: the hostfile's first host).")
    master_port: int = Field(29500, ge=1, le=65535, description="Several nodes: rendezvous port.")
    nodes: int = Field(1, ge=1, le=4096, description="Nodes torchrun trains on (world size = nproc_per_node x "
                       "nodes); each node runs the train stage with its own node_rank. Not with a hostfile.")
    node_rank: int = Field(0, ge=0, description="This node's index among train.nodes (0: the first).")
    rdzv_endpoint: str | None = Field(None, description="Several nodes (torchrun): host:port of the c10d "
                                         "rendezvous, served by node 0's agent; required when nodes > 1.")
    restarts: int = Field(0, ge=0, le=100, description="torchrun --max-restarts: times a failed job is "
                          "restarted in place (every rank, resuming from the newest checkpoint).")
    profile: ProfileSection = Field(default_factory=ProfileSection)
    debug: DebugSection = Field(default_factory=DebugSection)
    hccl: HcclSection = Field(default_factory=HcclSection)


class ConsolidateSection(Section):
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Weight dtype of the consolidated model.")
    hf_layout: bool = Field(True, description="Also write a Hugging Face Llama folder (hf/).")


class ExportSection(Section):
    opset: int = Field(17, ge=14, le=21, description="ONNX opset (ATC reads 9-18; SDPA needs >= 14).")
    kv_cache: bool = Field(True, description="Also export decoder_with_past.onnx (KV-cache decoding).")
    parity_atol: float = Field(1.0e-3, gt=0, description="Max abs logit difference ORT vs PyTorch.")
    parity_shapes: list[tuple[int, int]] = Field([(1, 16), (2, 64)], min_length=1,
                                                 description="(batch, seq) shapes checked for parity.")
    allow_large_opset: bool = Field(False, description="Allow opset > 18 (ATC cannot read it).")

    @model_validator(mode="after")
    def _opset(self) -> ExportSection:
        if self.opset > 18 and not self.allow_large_opset:
            raise ValueError(f"opset {self.opset} > 18, which ATC cannot read; set allow_large_opset: true")
        return self


class ConvertOmSection(Section):
    required: bool = Field(False, description="Fail (instead of skip) when ATC is not available.")
    atc_path: str | None = Field(None, description="Path to atc; null: PATH, then CANN's usual locations.")
    soc_version: str = Field("Ascend910B", description="--soc_version, e.g. Ascend910B, Ascend310P3.")
    input_shape: str | None = Field(None, description="--input_shape, e.g. 'input_ids:1,128' (or -1 dims).")
    dynamic_dims: str | None = Field(None, description="--dynamic_dims gears, e.g. '32;64;128'.")
    precision_mode: str | None = Field(None, description="--precision_mode (exclusive with _v2).")
    precision_mode_v2: str | None = Field("fp16", description="--precision_mode_v2, e.g. fp16, origin.")
    op_select_implmode: Literal["high_performance", "high_precision"] | None = Field(
        None, description="--op_select_implmode.")
    log: Literal["debug", "info", "warning", "error", "null"] = Field("error", description="ATC --log level.")
    timeout_s: int = Field(3600, ge=1, description="Kill ATC after this many seconds.")

    @model_validator(mode="after")
    def _precision(self) -> ConvertOmSection:
        if self.precision_mode and self.precision_mode_v2:
            raise ValueError("set precision_mode or precision_mode_v2, not both (ATC rejects both)")
        return self


class BenchmarkSection(Section):
    variants: list[Literal["fp32", "fp16", "int8"]] = Field(["fp32", "fp16", "int8"], min_length=1,
                                                            description="Model variants to measure.")
    providers: Literal["auto"] | list[str] = Field("auto", description="ORT providers; auto: every one "
                                                   "present among CPU, CUDA, CANN.")
    shapes: list[tuple[int, int]] = Field([(1, 128), (4, 128)], min_length=1, description="(batch, seq).")
    warmup: int = Field(5, ge=0, description="Untimed iterations per measurement.")
    iters: int = Field(50, ge=1, description="Timed iterations per measurement.")
    torch_baseline: bool = Field(True, description="Measure PyTorch eager in the same run.")
    threads: int | None = Field(None, ge=1, description="Intra-op threads for ORT and torch; null: all cores.")


class RunConfig(Section):
    run: RunSection = Field(default_factory=RunSection)
    data: DataSection
    model: ModelSection = Field(default_factory=ModelSection)
    train: TrainSection = Field(default_factory=TrainSection)
    consolidate: ConsolidateSection = Field(default_factory=ConsolidateSection)
    export: ExportSection = Field(default_factory=ExportSection)
    convert_om: ConvertOmSection = Field(default_factory=ConvertOmSection)
    benchmark: BenchmarkSection = Field(default_factory=BenchmarkSection)

    def run_dir(self) -> Path:
        """artifacts_dir/name, guaranteed to stay inside artifacts_dir."""
        root = Path(self.run.artifacts_dir).resolve()
        path = (root / self.run.name).resolve()
        if path.parent != root:
            raise ConfigError(f"run.name: {self.run.name!r} escapes {root}")
        return path

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _parse_value(key: str, text: str) -> Any:
    """An override value is YAML: `3`, `1e-4`, `true`, `null`, `[1, 2]`, or a plain string.

    Text that is not valid YAML (`[1, 2`, `*.txt`, `@x`) is refused rather than taken as a string: a
    broken list would otherwise reach the field as text and fail there with a less clear message.
    """
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--set {key}={text}: the value is not valid YAML ({problem}); quote a string "
                          f"value, e.g. --set '{key}=\"{text}\"'") from None


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b.c=value` to a nested dict, in place."""
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.max_steps=100")
    parts = key.strip().split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[:i + 1])} is not a section")
        node = child
    node[parts[-1]] = _parse_value(key.strip(), value)


def _format_error(err: ValidationError, tree: dict[str, Any]) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"{loc}: unknown key"
    if first["type"] == "missing":
        return f"{loc}: required field is missing"
    value = first.get("input")
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    return f"{loc}: {msg} (got {shown})" if loc else msg


def from_dict(tree: dict[str, Any], source: str = "config", *, check: Check = "model") -> RunConfig:
    """Validate a config tree. `check`: "fields" validates the fields (and artifacts_dir) alone; "model"
    (the default) also what the config tells about itself at any world size: flavor, seq_len, layout
    against the model, ATC shapes (llmpipe.config_checks; the launch world size is checked by
    config_checks.check_before_run when a run is about to train)."""
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_error(err, tree)}") from None
    from llmpipe import config_checks  # lazily: its checks import torch, and it imports this module

    try:
        config_checks.check_artifacts_dir(cfg.run.artifacts_dir)
        if check != "fields":
            config_checks.check_atc(cfg)
            config_checks.check_model(cfg)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return cfg


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, check: Check = "model") -> RunConfig:
    """Read a YAML run config, apply `key=value` overrides, and validate everything (see from_dict)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(tree).__name__}")
    for assignment in overrides:
        apply_override(tree, assignment)
    return from_dict(tree, source=str(path), check=check)


def section(cfg: RunConfig, dotted: str) -> Any:
    """The JSON form of a (possibly nested) section, e.g. 'train' or 'run.seed'."""
    node: Any = cfg.to_dict()
    for part in dotted.split("."):
        node = node[part]
    return node
