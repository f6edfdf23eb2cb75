"""Typed run configuration: YAML -> validated tree, with `--set a.b=c` overrides.

Every section is a pydantic model that forbids unknown keys. `load(path, overrides)` returns a
`RunConfig`; any problem raises `ConfigError` whose message names the field and the bad value. After
the fields, llmpipe.config_checks checks what they say together (the model, the layout, ATC shapes).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmpipe.errors import ConfigError
from llmpipe.models.limits import MODEL_LIMITS

STAGES = ("prepare_data", "train", "consolidate", "export_onnx", "convert_om", "benchmark", "evaluate")
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_STEPS = 10_000_000
# How far from_dict checks: the fields only (a recorded config; no torch import), or also what the
# config tells about its model, layout and ATC shapes at any world size (the default).
Check = Literal["fields", "model"]


# Every field says whether it defines a stage's result or only how the run goes:
#   Res(...)  result-defining: in the stage's fingerprint; changing it re-runs the stage and, if the
#             bytes it produces change, what follows.
#   Op(...)   operational (logging, cadences, retention, timeouts, network and HCCL settings, the
#             profiler, debug switches, threads, the launcher and the parallel layout): left out of
#             the fingerprint, so changing it never re-runs a completed stage (the change is recorded
#             in the stage's manifest) and never discards a partial one.
# tests/unit/test_config_roles.py walks the tree: a new field cannot be added without choosing.
ROLE = "role"
OPERATIONAL, RESULT = "operational", "result"
_OP_NOTE = " [operational: not in the fingerprint]"


ADDED = "added"  # a result field added after runs existed: hashed only when it differs from its default


def Res(default: Any = ..., added: bool = False, **kw: Any) -> Any:  # noqa: N802 (reads like Field)
    """A result-defining field (see above). `added=True`: a field added later, with a default that keeps
    the result of the runs made before it; at that default it is left out of the fingerprint, so those
    runs' fingerprints stay as they were (its default must then never change)."""
    return Field(default, json_schema_extra={ROLE: RESULT, **({ADDED: True} if added else {})}, **kw)


def Op(default: Any = ..., **kw: Any) -> Any:  # noqa: N802
    """An operational field (see above); its description says so."""
    kw["description"] = kw.get("description", "") + _OP_NOTE
    return Field(default, json_schema_extra={ROLE: OPERATIONAL}, **kw)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str = Op("tiny", description="Run name: the folder artifacts/<name>/ (letters, digits, . _ -).")
    artifacts_dir: str = Op("artifacts", description="Root folder for all runs' outputs (a folder, or "
                               "none yet: created on the first stage).")
    device: Literal["auto", "cpu", "cuda", "npu"] = Op(
        "auto", description="Accelerator; auto picks npu > cuda > cpu.")
    seed: int = Res(1234, ge=0, description="Seed for data split, sampling order and weight init.")
    retries: int = Op(1, ge=0, le=10, description="Retries of a stage after a transient failure (a rank "
                         "killed from outside, a lost connection); deterministic errors are never retried.")
    retry_delay_s: float = Op(10.0, ge=0, description="Wait before a retry.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not RUN_NAME_RE.match(v) or v in (".", ".."):
            raise ValueError(f"{v!r} is not a valid run name (1-64 of letters, digits, '.', '_', '-')")
        return v


class TokenizerSection(Section):
    path: str | None = Res(None, description="An existing tokenizer.json to load; null trains a new one.")
    vocab_size: int = Res(8192, ge=260, le=1_000_000, description="BPE vocabulary size when training.")
    min_frequency: int = Res(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    eos_token: str = Res("<|endoftext|>", description="Token inserted between documents.")
    sample_docs: int | None = Res(None, ge=1, description="Train the BPE on a seeded sample of this many "
                                  "documents (a corpus larger than memory); null: every document.")
    sample_bytes: int | None = Res(None, ge=1, description="... or of documents up to this many bytes of "
                                   "text in all; with sample_docs, whichever is reached first.")
    doc_chars: int = Res(1 << 20, ge=1024, le=1 << 30, description="Train the BPE on at most this many "
                         "characters of each document (its start, cut at whitespace): the trainer holds about "
                         "100 bytes per character of distinct words, so one huge document cannot fill memory. "
                         "Tokenization still reads every document whole.")


class MinHashSection(Section):
    threshold: float = Res(0.8, gt=0, lt=1, description="Estimated Jaccard similarity of word 5-gram "
                           "shingles above which a document is a near-duplicate of an earlier one.")
    num_perm: int = Res(128, ge=16, le=1024, description="MinHash permutations (signature length).")
    ngram: int = Res(5, ge=1, le=32, description="Words per shingle.")


class FilterSection(Section):
    min_chars: int = Res(1, ge=0, description="Drop documents shorter than this (characters, after stripping).")
    max_chars: int | None = Res(None, ge=1, description="Drop documents longer than this; null: no limit.")
    max_non_alnum_fraction: float | None = Res(None, gt=0, le=1, description="Drop documents whose share of "
                                               "characters that are neither letters, digits nor whitespace "
                                               "exceeds this; null: no limit (code is mostly symbols).")


class DataSection(Section):
    inputs: list[str] = Res(..., min_length=1, description="Globs of corpus files: .txt, .jsonl, .json, "
                              ".parquet, .jsonl.gz/.jsonl.zst/.txt.gz/.txt.zst, or a folder saved by "
                              "datasets' save_to_disk. '{stdlib}' expands to this Python's standard library folder.")
    text_field: str = Res("text", description="Field (column) holding the text in records: jsonl, json, "
                          "parquet, datasets folders.")
    seq_len: int = Res(256, ge=8, le=1_048_576, description="Tokens per training sample.")
    val_fraction: float = Res(0.01, gt=0.0, lt=0.5, description="Fraction of documents held out.")
    max_files: int | None = Res(None, ge=1, description="Read at most this many files (sorted order).")
    max_file_bytes: int = Res(64 << 20, ge=1, description="Whole-file documents (.txt, a .json array) larger "
                              "than this are skipped (with reason); record files are streamed, whatever their size.")
    max_record_bytes: int = Res(16 << 20, ge=1, le=1 << 30, description="A record longer than this (a JSON "
                                "line, an array element, a parquet or arrow value) is a bad record, counted "
                                "and listed; an over-long line is read past in blocks, never held whole.")
    external_symlinks: Literal["refuse", "follow"] = Res(
        "refuse", description="A symlink matched by data.inputs whose target lies outside the folder its "
        "pattern starts from (the part before the first wildcard): refuse (skipped and listed, so a corpus "
        "folder cannot pull in /etc/shadow) or follow (read). Both log it. A path named without a "
        "wildcard is read wherever it points.")
    tokenizer: TokenizerSection = Res(default_factory=TokenizerSection)
    dedup: Literal["none", "exact", "minhash"] = Res("exact", description="Drop documents whose normalised "
                                                     "text repeats an earlier one (exact) or is a near-duplicate "
                                                     "of one (minhash, see data.minhash); the first in corpus "
                                                     "order stays.")
    minhash: MinHashSection = Res(default_factory=MinHashSection)
    filters: FilterSection = Res(default_factory=FilterSection)
    unit_bytes: int = Op(256 << 20, ge=1 << 16, description="Work unit size: a large record file is split into "
                         "units of about this many bytes (row groups, line-aligned byte ranges); the result does "
                         "not depend on it.")
    engine: Literal["local", "dask"] = Op("local", description="Where work units run: local (a process pool) or "
                                          "dask (Prefect's DaskTaskRunner; a LocalCluster, or data.dask_address).")
    workers: int | None = Op(None, ge=1, description="Processes (local) or LocalCluster workers (dask); "
                             "null: all cores.")
    dask_address: str | None = Op(None, description="An existing Dask scheduler, e.g. tcp://10.0.0.5:8786; null: "
                                  "a LocalCluster on this machine.")
    format: Literal["text", "chat"] = Res("text", added=True, description="text: documents (text_field), "
                                          "pre-training; chat: conversations (messages_field, or Alpaca records), "
                                          "rendered with the chat template, loss on data.train_on.")
    messages_field: str = Res("messages", added=True, description="chat: the field (column) holding a record's "
                              "list of {role, content} messages; a record without it may be Alpaca's "
                              "(instruction, input, output).")
    chat_template: str | None = Res(None, added=True, description="chat: a built-in template (chatml, llama3) or "
                                    "a .jinja file, in Hugging Face's format; model.init_from's tokenizer_config.json "
                                    "template wins when it has one.")
    train_on: Literal["assistant", "all"] = Res("assistant", added=True, description="chat: the tokens the loss "
                                                "is on: the assistant's words and end-of-turn marker, or all.")
    packing: bool = Res(True, added=True, description="chat: several conversations per sequence, kept apart by a "
                        "block-causal mask and per-conversation positions; false: one per sequence, padded.")


class ModelSection(Section):
    flavor: str = Res("tiny", description="Named architecture in llmpipe.models.llama.flavors (debug ... llama-70b, "
                      "and the published qwen3-*, qwen2.5-*, llama3.2-*, smollm2-* sizes).")
    dim: int | None = Res(None, ge=8, le=MODEL_LIMITS["dim"], description="Override: hidden size.")
    n_layers: int | None = Res(None, ge=1, le=MODEL_LIMITS["n_layers"], description="Override: transformer blocks.")
    n_heads: int | None = Res(None, ge=1, le=MODEL_LIMITS["n_heads"], description="Override: attention heads.")
    n_kv_heads: int | None = Res(None, ge=1, le=MODEL_LIMITS["n_heads"], description="Override: key/value heads "
                                 "(GQA).")
    ffn_dim: int | None = Res(None, ge=8, le=MODEL_LIMITS["ffn_dim"], description="Override: SwiGLU intermediate "
                              "size.")
    max_seq_len: int | None = Res(None, ge=8, le=MODEL_LIMITS["max_seq_len"], description="Override: longest "
                                  "sequence (RoPE table).")
    rope_theta: float | None = Res(None, gt=0, allow_inf_nan=False, description="Override: RoPE base.")
    norm_eps: float | None = Res(None, gt=0, allow_inf_nan=False, description="Override: RMSNorm epsilon.")
    init_from: str | None = Res(None, description="A Hugging Face folder (LlamaForCausalLM, MistralForCausalLM, "
                                "Qwen2ForCausalLM or Qwen3ForCausalLM: config.json, safetensors, tokenizer.json) to "
                                "start from: its config defines the architecture (flavor and overrides other than "
                                "max_seq_len are not used), its weights are loaded, its tokenizer.json is the run's "
                                "tokenizer; consolidate's hf/ comes out as the same family. docs/guides/models.md.")

    def shown(self) -> str:
        """What the model is called in a table: the init_from folder when there is one (its flavor is not used),
        else the flavor."""
        return f"{self.init_from} (init_from)" if self.init_from else self.flavor


class ParallelSection(Section):
    data: Literal["ddp", "zero", "fsdp"] = Op("ddp", description="Data-parallel strategy: DDP replicas, "
                                                 "DeepSpeed ZeRO (zero_stage), or FSDP2 (fully_shard).")
    bucket_cap_mb: float = Op(25.0, gt=0, description="DDP gradient bucket size (MB).")
    gradient_as_bucket_view: bool = Op(True, description="DDP: gradients are views into buckets.")
    static_graph: bool = Op(True, description="DDP: the autograd graph is the same every step.")
    broadcast_buffers: bool = Op(False, description="DDP: sync buffers from rank 0 before each forward "
                                   "(torch's forward_sync_buffers).")
    zero_stage: int = Op(0, ge=0, le=3, description="ZeRO: 1 shards optimizer states, 2 also gradients, "
                            "3 also parameters. 0 with data=ddp/fsdp.")
    offload_optimizer: Literal["none", "cpu"] = Op("none", description="ZeRO: keep optimizer states "
                                                      "(and the step) in host memory.")
    offload_param: Literal["none", "cpu"] = Op("none", description="ZeRO-3: keep parameters in host memory.")
    pin_memory: bool = Op(True, description="ZeRO offload: page-locked host buffers.")
    reduce_bucket_size: int = Op(500_000_000, ge=1, description="ZeRO: elements per gradient reduce bucket.")
    allgather_bucket_size: int = Op(500_000_000, ge=1, description="ZeRO-1/2: elements per all-gather.")
    overlap_comm: bool = Op(True, description="ZeRO: overlap gradient reduction with backward.")
    contiguous_gradients: bool = Op(True, description="ZeRO: copy gradients into one contiguous buffer.")
    zero_optimizer: Literal["auto", "torch", "deepspeed"] = Op(
        "auto", description="ZeRO: DeepSpeed's own compiled AdamW (FusedAdam / DeepSpeedCPUAdam), or torch "
        "AdamW as a client optimizer; auto: DeepSpeed's where its ops are prebuilt, else torch.")
    reshard_after_forward: bool = Op(True, description="FSDP2: free gathered parameters after forward "
                                        "(ZeRO-3-like); false keeps them until backward (ZeRO-2-like).")

    dp: int | None = Op(None, ge=1, description="Data-parallel degree; null: world size / (tp * pp). "
                           "When set, dp * tp * pp must equal the world size.")
    tp: int = Op(1, ge=1, description="Tensor-parallel degree: each block's matmuls split over tp ranks "
                    "(must divide heads, kv heads, ffn dim, vocab and dim).")
    pp: int = Op(1, ge=1, description="Pipeline-parallel degree: the layers cut into pp stages.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Op(
        "1f1b", description="Pipeline schedule (torch.distributed.pipelining); interleaved needs virtual_stages.")
    microbatches: int = Op(4, ge=1, description="Pipeline micro-batches per micro-step (each "
                              "micro_batch_size / microbatches samples); 1f1b schedules need >= pp.")
    virtual_stages: int = Op(1, ge=1, description="Stages per pipeline rank (interleaved_1f1b needs >= 2).")
    split_points: list[int] | None = Op(None, description="Explicit first layer index of every stage but "
                                           "the first, increasing (pp * virtual_stages - 1 of them); "
                                           "null: even split, earlier stages take the extra layers.")
    sequence_parallel: bool = Op(False, description="TP: shard norms and residuals along the sequence.")
    # NOTE: a compressing hook changes the result, so llmpipe.train.fingerprint hashes these three when
    # comm_hook is not none (the section is operational; its fields cannot be Res).
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", json_schema_extra={ROLE: OPERATIONAL}, description="DDP communication hook (torch's): "
        "all-reduce gradients compressed to fp16 or bf16 (cast back after), or PowerSGD's low-rank "
        "approximation with error feedback; data=ddp with tp=pp=1 only [operational section, but a hook "
        "other than none is in the train stage's fingerprint: it changes the result].")
    powersgd_rank: int = Field(4, ge=1, json_schema_extra={ROLE: OPERATIONAL}, description="PowerSGD: "
                               "rank of each gradient matrix's approximation [operational section; in "
                               "train's fingerprint with comm_hook=powersgd].")
    start_powersgd_iter: int = Field(1000, ge=2, json_schema_extra={ROLE: OPERATIONAL}, description="PowerSGD: "
                                     "plain all-reduce for the first N optimizer steps (torch's default; at "
                                     "least 2: DDP rebuilds its buckets after the first). Early training is the "
                                     "most sensitive to compressed gradients: on the demo model, starting at "
                                     "step 15 instead of 50 costs 2 more points of loss at step 200 "
                                     "(benchmarks/comm_hooks.py) [operational section; in train's "
                                     "fingerprint with comm_hook=powersgd].")

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
        if self.comm_hook != "none" and (self.data != "ddp" or self.tp > 1 or self.pp > 1):
            raise ValueError(f"comm_hook={self.comm_hook} applies to torch DDP only (data=ddp, tp=1, pp=1); "
                             f"got data={self.data}, tp={self.tp}, pp={self.pp}")
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
    init: float = Res(65536.0, gt=0, description="fp16: initial loss scale.")
    growth_interval: int = Res(2000, ge=1, description="fp16: steps without overflow before the scale grows.")


class PrecisionSection(Section):
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Res(
        "fp32", description="Autocast dtype (fp16 adds a GradScaler); auto: bf16 on npu/cuda, fp32 on cpu "
        "(CPUs without native bf16 run it an order of magnitude slower).")
    loss_scale: LossScaleSection = Res(default_factory=LossScaleSection)


class OptimSection(Section):
    lr: float = Res(3.0e-4, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Res((0.9, 0.95), description="AdamW betas.")
    eps: float = Res(1.0e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Res(0.1, ge=0, description="AdamW decoupled weight decay (not on norms).")
    clip_grad_norm: float | None = Res(1.0, gt=0, description="Clip the global gradient norm; null: off.")
    lr_reference_batch: int | None = Res(None, ge=1, description="Linear lr scaling: the peak lr is "
                                           "lr x global_batch / lr_reference_batch (sequences); null: lr as given.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class ScheduleSection(Section):
    warmup_steps: int = Res(20, ge=0, description="Linear warm-up length, in `warmup_unit`s.")
    warmup_unit: Literal["steps", "micro_batches"] = Res(
        "steps", description="steps: optimizer steps; micro_batches: micro-batch steps, so the warm-up "
        "covers the same data whatever grad_accum_steps is (divided by it, rounded up).")
    decay: Literal["cosine", "linear", "constant", "wsd"] = Res(
        "cosine", description="Decay after warm-up; wsd (warmup-stable-decay) holds the peak until the last "
        "decay_fraction of the steps, so a stable-phase checkpoint extends to a longer run exactly.")
    decay_fraction: float = Res(0.2, gt=0, le=1, description="wsd: share of max_steps spent decaying.")
    min_lr_ratio: float = Res(0.1, ge=0, le=1, description="Final lr as a fraction of the peak.")


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # llmpipe.models.llama.lora.TARGETS


class LoraSection(Section):
    """LoRA: low-rank adapters on the named linear layers, every other weight frozen."""

    rank: int = Res(8, gt=0, le=65536, description="Adapter rank r: A is (r, in), B is (out, r).")
    alpha: float = Res(16.0, gt=0, allow_inf_nan=False,
                       description="Adapter scale numerator: the update is alpha / rank x B A.")
    dropout: float = Res(0.0, ge=0, lt=1, description="Dropout on the adapters' input (as PEFT's lora_dropout).")
    targets: list[str] = Res(["wq", "wk", "wv", "wo", "w1", "w2", "w3"], min_length=1, description=(
        "Linear layers that get adapters, by llmpipe's names: wq wk wv wo (attention; Hugging Face's "
        "q/k/v/o_proj), w1 w3 w2 (SwiGLU gate, up, down; gate_proj, up_proj, down_proj)."))

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"{unknown[0]!r} names no linear layer of the model (they are {', '.join(LORA_TARGETS)})")
        if len(set(v)) != len(v):
            raise ValueError(f"{[t for t in v if v.count(t) > 1][0]!r} is named twice")
        return v


class CheckpointSection(Section):
    every_steps: int = Op(50, ge=1, description="Save a checkpoint every N optimizer steps (and at the end).")
    keep_last: int = Op(3, ge=1, description="Checkpoints kept; older ones are removed (only after a "
                        "newer one verified).")
    keep_superseded: int | None = Op(None, ge=0, description="Training folders of earlier attempts whose "
                                     "fingerprint no longer matches (artifacts/<run>/superseded/) kept after a "
                                     "train stage completes; null: all (`llmpipe clean` removes them).")
    resume: bool | Literal["auto", "never"] | str = Op(
        "auto", description="auto: the newest valid checkpoint of this stage, else of an earlier attempt of the "
        "run with the same model and data (a warm start); never (or false): start over; a path: that checkpoint.")
    async_save: bool = Op(False, description="Write checkpoints in the background (DCP async_save, format "
                          "dcp: every layout but ZeRO); the step loop waits only while the state is copied. "
                          "ZeRO saves synchronously (with a log line).")


class EvalSection(Section):
    every_steps: int = Op(50, ge=1, description="Validation every N steps (and at the start and end).")
    samples: int | None = Op(None, ge=1, description="The validation set: the first N sequences of the val "
                             "shard (all of it when smaller), the same under every layout, split across the "
                             "data-parallel ranks; null: batches x micro_batch_size.")
    batches: int = Op(8, ge=1, description="With samples null, the validation set is batches x "
                      "micro_batch_size sequences in total (not per rank).")


class ProfileSection(Section):
    enabled: bool = Op(False, description="Profile training steps with torch.profiler (torch_npu's on NPU).")
    wait: int = Op(1, ge=0, description="Steps skipped before each profiling cycle.")
    warmup: int = Op(1, ge=0, description="Steps traced but discarded (profiler warm-up).")
    active: int = Op(3, ge=1, description="Steps recorded per cycle.")
    repeat: int = Op(1, ge=1, description="Profiling cycles.")
    record_shapes: bool = Op(False, description="Record operator input shapes.")
    with_stack: bool = Op(False, description="Record Python stacks (large traces).")


class DebugSection(Section):
    """Troubleshooting switches (the seed's table): off by default except the NaN/Inf guard."""

    check_init_params: bool = Op(False, description="After building: every data-parallel replica holds "
                                    "bitwise the same parameters (stops naming those that differ).")
    check_grad_consistency_every: int = Op(0, ge=0, description="Every N optimizer steps, check that the "
                                              "synchronised gradients agree across replicas; 0: off.")
    nan_guard: Literal["off", "skip", "stop"] = Op(
        "stop", description="Non-finite loss or gradients (not fp16 overflow, which the loss scaler skips): "
        "stop naming the parameters, skip the update and go on, or off (the loss is still checked).")
    loss_scale_stop_below: float | None = Op(None, gt=0, description="fp16: stop when the loss scale "
                                                "falls below this (it warns below 1 regardless); null: never.")


class HcclSection(Section):
    """HCCL settings exported to every rank on NPU (null: HCCL's default). Timeouts come from
    train.dist_timeout_s."""

    algo: str | None = Op(None, description="HCCL_ALGO, e.g. 'level0:NA;level1:H-D_R'.")
    buffer_size_mb: int | None = Op(None, ge=1, description="HCCL_BUFFER_SIZE in MB.")
    ib_hca: str | None = Op(None, description="HCCL_IB_HCA: RDMA devices to use.")
    socket_ifname: str | None = Op(None, description="HCCL_SOCKET_IFNAME: the NIC for HCCL's sockets.")


SLURM_TIME_RE = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # sbatch --time: minutes, h:m:s, d-h[:m[:s]]
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
K8S_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a DNS-1123 label (namespace, claim name)


class ClusterSection(Section):
    """Where a scheduled job runs the ranks (train.launcher slurm or kubernetes). The world is
    train.nodes x train.nproc_per_node, as under torchrun; the rendezvous is on the job's first node
    at train.master_port."""

    accelerator: Literal["npu", "cuda", "cpu"] = Op("npu", description="What each node's ranks use: the "
                                                     "devices requested per node (nproc_per_node x "
                                                     "devices_per_proc of them) and their collective "
                                                     "library's environment (llmpipe.device); cpu requests none.")
    devices_per_proc: int = Op(1, ge=1, le=64, description="Devices each rank drives (1 but for a rank that "
                               "spans several).")
    shared_dir: str | None = Op(None, description="run.artifacts_dir as the nodes see it (their mount of the "
                                "shared folder); null: the same path. Every node must see the folder the "
                                "stage writes: each writes a marker there before training and the stage "
                                "checks them all.")
    python: str | None = Op(None, description="The interpreter the job starts torchrun with; null: this one "
                            "(sys.executable, a shared environment) under Slurm, `python` in a container.")
    env: dict[str, str] = Op(default_factory=dict, description="Extra environment for every rank "
                             "(e.g. a proxy, a cache folder); the device's collective settings come from "
                             "train.hccl and llmpipe.device.")
    marker_timeout_s: int = Op(600, ge=5, description="How long the stage waits, once the job runs, for "
                               "every node's marker in the shared folder before it cancels the job.")
    poll_s: float = Op(2.0, gt=0, le=60, description="How often the stage asks the scheduler for the job's state.")
    # Slurm
    partition: str | None = Op(None, description="Slurm: sbatch --partition (checked with sinfo before "
                               "submitting); null: the cluster's default.")
    time: str | None = Op(None, description="Slurm: sbatch --time (minutes, h:m:s or d-h:m:s); null: the "
                          "partition's limit.")
    account: str | None = Op(None, description="Slurm: sbatch --account; null: the user's default.")
    requeue: bool = Op(True, description="Slurm: sbatch --requeue: a preempted or requeued job starts again "
                       "and resumes from the newest checkpoint that verifies.")
    # Kubernetes
    api: Literal["trainjob", "pytorchjob", "ascendjob"] = Op("trainjob", description="Kubernetes: the job "
                                                              "kind: Kubeflow Trainer v2 TrainJob, the older "
                                                              "PyTorchJob, or MindCluster's AscendJob (Volcano).")
    image: str | None = Op(None, description="Kubernetes: the container image with llmpipe installed "
                           "(required with launcher kubernetes).")
    namespace: str = Op("default", description="Kubernetes: the namespace the job is created in.")
    runtime: str = Op("torch-distributed", description="Kubernetes, TrainJob: the ClusterTrainingRuntime "
                      "it refers to.")
    volume_claim: str | None = Op(None, description="Kubernetes: the PersistentVolumeClaim (ReadWriteMany) "
                                  "holding run.artifacts_dir, mounted at shared_dir in every pod; null: the "
                                  "image or runtime mounts it.")
    queue: str = Op("default", description="Kubernetes, AscendJob: the Volcano queue.")

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, v: str | None) -> str | None:
        if v is not None and not SLURM_TIME_RE.match(v):
            raise ValueError("not a Slurm time (minutes, h:m:s or d-h:m:s)")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not ENV_NAME_RE.match(k)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an environment variable name")
        return v

    @field_validator("namespace", "volume_claim")
    @classmethod
    def _k8s_name(cls, v: str | None) -> str | None:
        if v is not None and not K8S_NAME_RE.match(v):
            raise ValueError("not a Kubernetes name (lower-case letters, digits, '-')")
        return v

    @field_validator("shared_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path (the folder on the nodes)")
        return v


class TrainSection(Section):
    nproc_per_node: int = Op(1, ge=1, le=1024, description="Processes torchrun starts on this node.")
    micro_batch_size: int = Op(8, ge=1, description="Samples per rank per forward pass.")
    grad_accum_steps: int = Op(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    max_steps: int = Res(200, ge=0, le=MAX_STEPS, description="Optimizer steps to train (at most 10 million: "
                           "LLaMA-2's 2T tokens at 4M tokens per step are 500k steps, so more is a typo); 0 keeps "
                           "the initial weights (model.init_from's, to deploy a pretrained model as it is).")
    parallel: ParallelSection = Op(default_factory=ParallelSection)
    precision: PrecisionSection = Res(default_factory=PrecisionSection)
    optim: OptimSection = Res(default_factory=OptimSection)
    schedule: ScheduleSection = Res(default_factory=ScheduleSection)
    activation_checkpointing: bool = Op(False, description="Recompute each block in backward.")
    compile: bool = Op(False, description="torch.compile each transformer block (after tensor parallel and "
                       "activation checkpointing, before data parallel) with the device's backend (inductor "
                       "on CPU and CUDA: needs a C++ compiler; torchair on NPU). Not with ZeRO-3 or tp > 1.")
    lora: LoraSection | None = Res(None, added=True, description="LoRA fine-tuning (rank, alpha, "
                                   "dropout, targets): adapters trained, every other weight frozen; null: full "
                                   "fine-tuning. Data parallel (ddp, fsdp, zero 1/2/3) only: not with tp or pp > 1.")
    checkpoint: CheckpointSection = Op(default_factory=CheckpointSection)
    eval: EvalSection = Op(default_factory=EvalSection)
    log_every: int = Op(10, ge=1, description="Print a progress line every N steps.")
    peak_tflops: float | None = Op(None, gt=0, description="Peak dense TFLOPS per device for MFU (and "
                                      "llmpipe plan); null: llmpipe.mfu's table by the accelerator's "
                                      "reported name and dtype (an unknown one: MFU null), on CPU a GEMM "
                                      "peak measured once per machine (cached in <artifacts_dir>/.calibration).")
    threads_per_proc: int | None = Op(None, ge=1, description="torch intra-op threads per rank "
                                         "(CPU); null: cores / nproc_per_node.")
    dist_timeout_s: int = Op(1800, ge=10, description="Timeout for process-group init and collectives.")
    hostfile: str | None = Op(None, description="Several nodes: a DeepSpeed hostfile ('host slots=N' per "
                                 "line); the stage then uses the DeepSpeed launcher instead of torchrun.")
    master_addr: str | None = Op(None, description="Several nodes: address of the rank-0 host "
                                    "(default: the hostfile's first host).")
    master_port: int = Op(29500, ge=1, le=65535, description="Several nodes: rendezvous port.")
    nodes: int = Op(1, ge=1, le=4096, description="Nodes torchrun trains on (world size = nproc_per_node x "
                    "nodes); each node runs the train stage with its own node_rank. Not with a hostfile.")
    node_rank: int = Op(0, ge=0, description="This node's index among train.nodes (0: the first).")
    rdzv_endpoint: str | None = Op(None, description="Several nodes (torchrun): host:port of the c10d "
                                      "rendezvous, served by node 0's agent; required when nodes > 1.")
    restarts: int = Op(0, ge=0, le=100, description="torchrun --max-restarts: times a failed job is "
                       "restarted in place (every rank, resuming from the newest checkpoint).")
    launcher: Literal["local", "slurm", "kubernetes"] = Op("local", description="Who starts the ranks: local "
                                                          "(torchrun, or DeepSpeed's launcher over a "
                                                          "hostfile, from this stage), slurm (sbatch) or "
                                                          "kubernetes (a TrainJob, PyTorchJob or AscendJob): the "
                                                          "stage submits the job, follows it and cancels it.")
    cluster: ClusterSection = Op(default_factory=ClusterSection, description="The job's settings with launcher "
                                 "slurm or kubernetes.")
    profile: ProfileSection = Op(default_factory=ProfileSection)
    debug: DebugSection = Op(default_factory=DebugSection)
    hccl: HcclSection = Op(default_factory=HcclSection)

    @model_validator(mode="after")
    def _launcher(self) -> TrainSection:
        """A scheduled job starts every node itself: no hostfile, no per-node settings."""
        if self.launcher == "local":
            return self
        if self.hostfile is not None:
            raise ValueError(f"launcher={self.launcher} starts torchrun on every node itself; train.hostfile "
                             "(DeepSpeed's launcher over ssh) is for launcher local")
        if self.node_rank != 0 or self.rdzv_endpoint is not None:
            raise ValueError(f"launcher={self.launcher}: the job's first node is the rendezvous; leave "
                             "train.node_rank and train.rdzv_endpoint unset")
        if self.launcher == "kubernetes" and not self.cluster.image:
            raise ValueError("launcher=kubernetes needs train.cluster.image (the container image with llmpipe)")
        return self

    @model_validator(mode="after")
    def _compile_layout(self) -> TrainSection:
        p = self.parallel
        if self.compile and p.data == "zero" and p.zero_stage == 3:
            # ZeRO-3 gathers and frees every parameter around each block's forward through module hooks
            # and swaps param.data: compiled blocks would be traced against released (empty) parameters
            raise ValueError("compile=true does not work with ZeRO-3 (DeepSpeed swaps each parameter's "
                             "storage around every block); use zero_stage 1 or 2, or data=fsdp")
        if self.compile and p.tp > 1:
            # NOTE: measured on torch 2.13 (CPU, gloo): compiled tensor-parallel blocks trained with
            # gradient norms 0.7% off eager's from the first step (pp, DDP, FSDP2, ZeRO-2 match eager);
            # a bare TP model's compiled backward raises in DTensor's Redistribute backward (a plain
            # tensor where a DTensor was expected), and with sequence_parallel the compiled block matches
            # eager on its own but the train stage's run raises in AOT autograd's subclass wrapper
            # ('Tensor' object has no attribute 'elem'). Lift when torch's DTensor + compile does.
            raise ValueError("compile=true with tp > 1 is refused: torch 2.13's compiled tensor-parallel "
                             "blocks gave gradients that differ from eager; use tp=1 or compile=false")
        return self


class ConsolidateSection(Section):
    dtype: Literal["fp32", "bf16"] = Res("fp32", description="Weight dtype of the consolidated model.")
    hf_layout: bool = Res(True, description="Also write a Hugging Face Llama folder (hf/).")


class ExportSection(Section):
    opset: int = Res(17, ge=14, le=21, description="ONNX opset (ATC reads 9-18; SDPA needs >= 14).")
    kv_cache: bool = Res(True, description="Also export decoder_with_past.onnx (KV-cache decoding).")
    parity_atol: float = Res(1.0e-3, gt=0, description="Max abs logit difference ORT vs PyTorch.")
    parity_shapes: list[tuple[int, int]] = Res([(1, 16), (2, 64)], min_length=1,
                                                 description="(batch, seq) shapes checked for parity.")
    allow_large_opset: bool = Res(False, description="Allow opset > 18 (ATC cannot read it).")
    static_decoder: bool = Res(True, description="Also export decoder_static.onnx: a KV-cache decoder whose "
                               "cache has a fixed length (what ATC can compile; decoded in place).")
    kv_cache_len: int | None = Res(None, ge=2, description="Cache slots of the static decoder (the longest "
                                   "prompt + generated text it holds); null: min(model max_seq_len, 1024).")
    ort_graph: bool = Res(False, added=True, description="Also write ort/: onnxruntime's own graph of the model "
                          "(onnxruntime-genai's model builder on consolidate's hf/: attention fused over the filled "
                          "cache only, fused norms and rotary embedding), which generate and the benchmark then run "
                          "for fp32 on the CPU. Needs consolidate.hf_layout and the onnxruntime-genai package.")
    gguf: list[Literal["f16", "q8_0", "q4_0", "q4_1"]] = Res([], added=True, description="Also write gguf/model-"
                                                             "<type>.gguf of consolidate's hf/ for llama.cpp and "
                                                             "Ollama: f16, q8_0, q4_0 (llama.cpp's quantisers), "
                                                             "q4_1 (HQQ in blocks of 32, what holds at 4 bits); "
                                                             "4-bit files keep head and embedding at q8_0. The "
                                                             "benchmark gates each as gguf_<type> when "
                                                             "llama-cpp-python is installed. Needs "
                                                             "consolidate.hf_layout.")
    gguf_adapter: Literal["merged", "separate"] = Res("merged", added=True, description="A LoRA run's 4-bit GGUF "
                                                      "files (q4_0, q4_1): merged (the fine-tuned weights), or "
                                                      "separate: each written from the base the fine-tune came "
                                                      "from, the adapter as llama.cpp's LoRA GGUF gguf/"
                                                      "adapter.lora.gguf beside them (llama.cpp --lora). A "
                                                      "fine-tune's weight changes below a 4-bit step survive "
                                                      "only so; the benchmark applies the adapter.")

    @model_validator(mode="after")
    def _opset(self) -> ExportSection:
        if self.opset > 18 and not self.allow_large_opset:
            raise ValueError(f"opset {self.opset} > 18, which ATC cannot read; set allow_large_opset: true")
        return self


class ConvertOmSection(Section):
    required: bool = Res(False, description="Fail (instead of skip) when ATC is not available.")
    atc_path: str | None = Op(None, description="Path to atc; null: PATH, then CANN's usual locations.")
    soc_version: str = Res("Ascend910B", description="--soc_version, e.g. Ascend910B, Ascend310P3.")
    input_shape: str | None = Res(None, description="--input_shape, e.g. 'input_ids:1,128' (or -1 dims).")
    dynamic_dims: str | None = Res(None, description="--dynamic_dims gears, e.g. '32;64;128'.")
    precision_mode: str | None = Res(None, description="--precision_mode (exclusive with _v2).")
    precision_mode_v2: str | None = Res("fp16", description="--precision_mode_v2, e.g. fp16, origin.")
    op_select_implmode: Literal["high_performance", "high_precision"] | None = Res(
        None, description="--op_select_implmode.")
    decoder: bool = Res(True, description="Also compile export_onnx's decoder_static.onnx to decoder.om "
                        "(static shapes: decode_batch x decode_chunk new tokens over the fixed cache).")
    decode_batch: int = Res(1, ge=1, description="Batch size decoder.om is compiled for.")
    decode_chunk: int = Res(1, ge=1, description="New tokens per decoder.om call (1: token by token).")
    log: Literal["debug", "info", "warning", "error", "null"] = Op("error", description="ATC --log level.")
    timeout_s: int = Op(3600, ge=1, description="Kill ATC after this many seconds.")

    @model_validator(mode="after")
    def _precision(self) -> ConvertOmSection:
        if self.precision_mode and self.precision_mode_v2:
            raise ValueError("set precision_mode or precision_mode_v2, not both (ATC rejects both)")
        return self


class GateSection(Section):
    """Quality limits of one variant against torch fp32 on the validation text."""

    max_ppl_increase: float | None = Res(None, ge=0, description="Largest relative perplexity increase over "
                                         "torch fp32 on the validation text (0.01 = 1%); null: no limit.")
    min_top1: float | None = Res(None, ge=0, le=1, description="Smallest top-1 agreement with torch fp32 on "
                                 "the validation text; null: no limit.")
    max_kl: float | None = Res(None, ge=0, added=True, description="Largest mean KL(torch fp32 || variant) per "
                               "token on the validation text (nats); null: no limit.")


def _gate(name: str, ppl: float, top1: float, kl: float | None = None) -> Any:
    """A GateSection subclass whose defaults are this variant's, so that setting one limit
    (`--set benchmark.quality.int8.min_top1=0.9`) keeps the other's default."""
    cls = type(f"{name.capitalize()}Gate", (GateSection,), {
        "__annotations__": {"max_ppl_increase": "float | None", "min_top1": "float | None", "max_kl": "float | None"},
        "max_ppl_increase": Res(ppl, ge=0, description=f"Largest relative perplexity increase of {name} over "
                                "torch fp32 on the validation text (0.01 = 1%); null: no limit."),
        "min_top1": Res(top1, ge=0, le=1, description=f"Smallest top-1 agreement of {name} with torch fp32 on "
                        "the validation text; null: no limit."),
        "max_kl": Res(kl, ge=0, added=True, description=f"Largest mean KL(torch fp32 || {name}) per token on the "
                      "validation text (nats); null: no limit."),
        "__module__": __name__,
    })
    return cls


# Defaults from measurement (the tiny demo, 16 validation sequences of 128 tokens): fp32 +0.000% /
# top-1 1.0, fp16 +0.001% / 1.0, int8 (dynamic, per-tensor, 7-bit weights) +0.28% / 0.959. The
# limits leave room for larger vocabularies and other text (fp16 10x, int8 ~20x the measured
# increase, and a top-1 floor several points below); the OM model runs in fp16 on the NPU with
# ATC's own kernels, so it gets a little more room than ORT fp16.
Fp32Gate, Fp16Gate, Int8Gate, OmGate = (_gate("fp32", 0.001, 0.995), _gate("fp16", 0.01, 0.98),
                                        _gate("int8", 0.05, 0.90, 0.02), _gate("om", 0.02, 0.95))
# The quantised variants, re-derived on SmolLM2-135M-Instruct (benchmarks/quant_recipes.py, 8 windows of 128
# tokens; docs/measurements/quantisation.md). What a user keeps: 8-bit weights (int8w, llama.cpp q8_0) at
# -0.2% / top-1 0.956-0.963 / KL 0.005, int4 HQQ (head at 8 bits) +0.1% / 0.978 / KL 0.002. What is broken:
# 4-bit round to nearest +29% to +85% / 0.60-0.72 / KL 0.31-0.63, dynamic int8 per tensor +130% / 0.51 / KL
# 0.91, 2 bits KL 9. The KL limits sit 4x above the kept 8-bit rows and 3x below the first broken one; the
# 8-bit top-1 floor is 0.95 (the toy demo's 0.97 rejected llama.cpp's own q8_0 on this model).
Int4Gate, Int8wGate, Int8sGate = (_gate("int4", 0.10, 0.85, 0.10), _gate("int8w", 0.02, 0.95, 0.02),
                                  _gate("int8s", 0.02, 0.95, 0.02))
# llama.cpp's files of the same weights (export.gguf) are held to the limits of the onnxruntime variant of
# the same width: f16 as fp16, q8_0 as int8w, q4_0 and q4_1 as int4.
GgufF16Gate, GgufQ80Gate, GgufQ40Gate, GgufQ41Gate = (
    _gate("gguf_f16", Fp16Gate().max_ppl_increase, Fp16Gate().min_top1, Fp16Gate().max_kl),
    _gate("gguf_q8_0", Int8wGate().max_ppl_increase, Int8wGate().min_top1, Int8wGate().max_kl),
    _gate("gguf_q4_0", Int4Gate().max_ppl_increase, Int4Gate().min_top1, Int4Gate().max_kl),
    _gate("gguf_q4_1", Int4Gate().max_ppl_increase, Int4Gate().min_top1, Int4Gate().max_kl))


class QualitySection(Section):
    samples: int = Res(16, ge=1, description="Validation sequences scored (a fixed, seeded sample).")
    seq_len: int | None = Res(None, ge=2, description="Tokens per scored sequence; null: data.seq_len.")
    continuation_prompts: int = Res(4, ge=0, description="Validation prompts continued greedily per variant.")
    continuation_tokens: int = Res(32, ge=1, description="Greedy tokens per continuation.")
    enforce: bool = Res(True, description="A variant outside its limits fails the stage; false: marked "
                        "rejected in the results.")
    fp32: Fp32Gate = Res(default_factory=Fp32Gate, description="Limits for ORT fp32.")
    fp16: Fp16Gate = Res(default_factory=Fp16Gate, description="Limits for ORT fp16.")
    int8: Int8Gate = Res(default_factory=Int8Gate, description="Limits for ORT int8.")
    int4: Int4Gate = Res(default_factory=Int4Gate, added=True,
                         description="Limits for ORT int4 (weight-only MatMulNBits).")
    int8w: Int8wGate = Res(default_factory=Int8wGate, added=True,
                           description="Limits for ORT int8w (weight-only MatMulNBits).")
    int8s: Int8sGate = Res(default_factory=Int8sGate, added=True,
                           description="Limits for ORT int8s (static, calibrated).")
    om: OmGate = Res(default_factory=OmGate, description="Limits for the OM model (ais_bench).")
    gguf_f16: GgufF16Gate = Res(default_factory=GgufF16Gate, added=True,
                                description="Limits for export.gguf's f16 file in llama.cpp.")
    gguf_q8_0: GgufQ80Gate = Res(default_factory=GgufQ80Gate, added=True,
                                 description="Limits for export.gguf's q8_0 file in llama.cpp.")
    gguf_q4_0: GgufQ40Gate = Res(default_factory=GgufQ40Gate, added=True,
                                 description="Limits for export.gguf's q4_0 file in llama.cpp.")
    gguf_q4_1: GgufQ41Gate = Res(default_factory=GgufQ41Gate, added=True,
                                 description="Limits for export.gguf's q4_1 file (HQQ) in llama.cpp.")


class WeightOnlySection(Section):
    """onnxruntime's MatMulNBits weight-only quantization of one variant (int4, int8w): each MatMul weight
    in blocks of block_size input rows, one scale (and zero point) per block."""

    bits: int = Res(4, description="Bits per weight: 2, 4 or 8 (the widths MatMulNBits packs).")
    block_size: int = Res(32, description="Input rows per scale: a power of two, 16 or more.")
    accuracy_level: int = Res(4, ge=0, le=4, description="MatMulNBits compute type of the activations: 0 "
                              "unset (the kernel's choice), 1 fp32, 2 fp16, 3 bf16, 4 int8 (the fastest on CPU).")
    symmetric: bool = Res(False, description="Symmetric scales (no zero points).")
    ort_block_size: int | None = Res(None, added=True, description="Input rows per scale of the variant's "
                                     "ORT-optimised graph (export.ort_graph: the builder's MatMulNBits, 16 to 256); "
                                     "null: block_size. The portable graphs keep block_size.")
    algorithm: Literal["rtn", "hqq"] = Res("rtn", added=True, description="How the scales and zero points are "
                                           "chosen: rtn (round to nearest from each block's range), hqq "
                                           "(onnxruntime's half-quadratic optimisation of them, float zero points).")
    head_bits: Literal[4, 8] | None = Res(None, added=True, description="Bits of the output head's weights "
                                          "(the last MatMul, whose errors go straight into the logits); null: bits.")
    zero_points: Literal["integer", "float"] = Res("integer", added=True, description="hqq's zero points: "
                                                   "integer (its float ones folded into integers plus appended "
                                                   "block-sum rows at 4 bits: onnxruntime's fast kernel, "
                                                   "llmpipe.infer.fold; other widths keep float ones) or float (as "
                                                   "HQQ found them: onnxruntime dequantises them on every call, an "
                                                   "eighth of fp32's speed). rtn's are integer.")
    kernel: Literal["onnxruntime", "llmpipe"] = Res("onnxruntime", added=True, description="What runs the 4-bit "
                                                    "matmuls of the ORT graphs: onnxruntime (MatMulNBits, MLAS) or "
                                                    "llmpipe (llmpipe's own AVX2 kernel, the custom op llmpipe.Q4Gemv "
                                                    "compiled with the machine's cc on first use: hqq's float zero "
                                                    "points as they are, no fold; needs 4 bits, hqq, blocks of 32, "
                                                    "an x86-64 CPU with AVX2, FMA and F16C). The head "
                                                    "at 8 bits stays MatMulNBits; the portable graphs never change.")
    adapter: Literal["merged", "separate"] = Res("merged", added=True, description="LoRA runs (train.lora), the "
                                                 "ORT-optimised graph: merged (the merged weights quantised) or "
                                                 "separate (the base quantised, the adapter's product appended as "
                                                 "rows of each 4-bit node: llmpipe.infer.lora_rows; needs 4 "
                                                 "bits, hqq, integer zero points). Separate keeps a fine-tune whose "
                                                 "delta is below a 4-bit step (a base that came from a 4-bit file), "
                                                 "which merged 4-bit undoes. The portable graphs stay merged.")

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (2, 4, 8):
            raise ValueError(f"{v} bits is not a width onnxruntime's MatMulNBits packs (2, 4 or 8)")
        return v

    @field_validator("block_size", "ort_block_size")
    @classmethod
    def _block(cls, v: int | None) -> int | None:
        if v is not None and (v < 16 or v & (v - 1)):
            raise ValueError(f"{v} is not a block size MatMulNBits takes (a power of two, 16 or more)")
        return v

    @model_validator(mode="after")
    def _zero_points(self) -> WeightOnlySection:
        """Float zero points are what HQQ finds; round to nearest has integer ones only."""
        if self.zero_points == "float" and self.algorithm != "hqq":
            raise ValueError(f"zero_points=float: algorithm {self.algorithm} has integer zero points only "
                             "(float ones come from algorithm hqq)")
        if self.kernel == "llmpipe":
            block = self.ort_block_size or self.block_size
            if (self.bits, self.algorithm, block) != (4, "hqq", 32):
                raise ValueError(f"kernel=llmpipe: needs bits 4, algorithm hqq and blocks of 32 (what llmpipe.Q4Gemv "
                                 f"computes), got {self.bits} bits, {self.algorithm}, blocks of {block}")
        rows_fit = self.bits == 4 and self.algorithm == "hqq" and (self.zero_points == "integer"
                                                                  or self.kernel == "llmpipe")
        if self.adapter == "separate" and not rows_fit:
            raise ValueError(f"adapter=separate: needs bits 4, algorithm hqq and zero_points integer, or kernel "
                             f"llmpipe (the rows are appended to the 4-bit nodes), got {self.bits} bits, "
                             f"{self.algorithm}, {self.zero_points} zero points, kernel {self.kernel}")
        return self


def _weight_only(name: str, bits: int, block_size: int, accuracy_level: int, ort_block_size: int | None,
                 algorithm: str = "rtn", head_bits: int | None = None, zero_points: str = "integer") -> Any:
    """A WeightOnlySection subclass with this variant's defaults (as _gate does for the limits)."""
    return type(f"{name.capitalize()}Quant", (WeightOnlySection,), {
        "__annotations__": {"bits": "int", "block_size": "int", "accuracy_level": "int",
                            "ort_block_size": "int | None", "algorithm": 'Literal["rtn", "hqq"]',
                            "head_bits": "Literal[4, 8] | None", "zero_points": 'Literal["integer", "float"]',
                            "adapter": 'Literal["merged", "separate"]',
                            "kernel": 'Literal["onnxruntime", "llmpipe"]'},
        "bits": Res(bits, description=f"Bits per weight of {name}: 2, 4 or 8 (the widths MatMulNBits packs)."),
        "block_size": Res(block_size, description=f"Input rows per scale of {name}: a power of two, 16 or more."),
        "accuracy_level": Res(accuracy_level, ge=0, le=4, description=f"MatMulNBits compute type of {name}'s "
                              "activations: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 (the fastest on CPU)."),
        "ort_block_size": Res(ort_block_size, added=True, description=f"Input rows per scale of {name}'s "
                              "ORT-optimised graph (export.ort_graph: the builder's MatMulNBits, 16 to 256); null: "
                              "block_size. The portable graphs keep block_size."),
        "algorithm": Res(algorithm, added=True, description=f"How {name}'s scales and zero points are chosen: "
                         "rtn (round to nearest from each block's range), hqq (onnxruntime's half-quadratic "
                         "optimisation of them, float zero points)."),
        "head_bits": Res(head_bits, added=True, description=f"Bits of {name}'s output head (the last MatMul, whose "
                         "errors go straight into the logits); null: bits."),
        "zero_points": Res(zero_points, added=True, description=f"{name}'s hqq zero points: integer (folded into "
                           "integers plus appended block-sum rows at 4 bits: onnxruntime's fast kernel) or float (its "
                           "slow path). rtn's are integer."),
        "adapter": Res("merged", added=True, description=f"LoRA runs, {name}'s ORT-optimised graph: merged (the "
                       "merged weights quantised) or separate (the base quantised, the adapter's product appended "
                       "as rows of each folded 4-bit node; needs 4 bits, hqq, integer zero points): what keeps a "
                       "fine-tune whose delta is below a 4-bit step. The portable graphs stay merged."),
        "kernel": Res("onnxruntime", added=True, description=f"What runs {name}'s 4-bit matmuls in the ORT graphs: "
                      "onnxruntime (MatMulNBits) or llmpipe (llmpipe's own AVX2 kernel, the custom op llmpipe.Q4Gemv, "
                      "compiled with cc on first use; needs 4 bits, hqq, blocks of 32, a CPU with "
                      "AVX2, FMA and F16C). An 8-bit head stays MatMulNBits."),
        "__module__": __name__,
    })


# Defaults from measurement on SmolLM2-135M-Instruct (benchmarks/quant_recipes.py, docs/measurements/
# quantisation.md): int4 with integer zero points from round to nearest fails its gate at every setting tried
# (blocks of 128 +85% / top-1 0.60; blocks of 32 with the head at 8 bits +29% / 0.71, the best of them; k_quant
# the same). HQQ in blocks of 32 with the head at 8 bits holds (+0.1% / 0.986 with float zero points; +1.1% /
# 0.943 folded to integer zero points at accuracy level 4), and folded it runs on onnxruntime's fast kernel
# (within a tenth of round to nearest's decode speed), so that is the default.
Int4Quant = _weight_only("int4", 4, 32, 4, None, "hqq", 8)
Int8wQuant = _weight_only("int8w", 8, 32, 4, None)


class QuantizeSection(Section):
    int4: Int4Quant = Res(default_factory=Int4Quant, description="Weight-only int4 (MatMulNBits).")
    int8w: Int8wQuant = Res(default_factory=Int8wQuant, description="Weight-only int8 (MatMulNBits).")
    calibration_samples: int = Res(32, ge=1, description="int8s: validation windows (a seeded sample) its "
                                   "activation ranges are calibrated on; at most the validation shard holds.")
    calibration_seq_len: int | None = Res(None, ge=2, description="int8s: tokens per calibration window; "
                                          "null: benchmark.quality.seq_len, else data.seq_len.")
    calibration_decode_steps: int = Res(8, ge=1, description="int8s: decoder steps recorded per calibration "
                                        "window (the static decoder is calibrated on what it is fed).")
    static_format: Literal["qdq", "qoperator"] = Res("qoperator", description="int8s: quantized operators "
                                                     "(qoperator) or QuantizeLinear/DequantizeLinear pairs (qdq).")
    static_keep_fp32: list[Literal["down", "head"]] = Res(["down", "head"], description="int8s: weight MatMuls "
                                                          "left in fp32: the feed-forward's down projection (its "
                                                          "input has outlier channels), the output head.")
    # NOTE: measured on SmolLM2-135M (docs/measurements/quantisation.md): per tensor with every weight MatMul
    # quantised +130% perplexity / top-1 0.51; per channel with down and head in fp32 +6.4% / 0.84 (still
    # outside int8's gate: dynamic activations per tensor are what breaks; int8w is the 8-bit that holds).
    dynamic_per_channel: bool = Res(True, added=True, description="int8 (dynamic): one weight scale per output "
                                    "channel instead of one per tensor.")
    dynamic_keep_fp32: list[Literal["down", "head"]] = Res(["down", "head"], added=True, description="int8 "
                                                           "(dynamic): weight MatMuls left in fp32 (see "
                                                           "static_keep_fp32).")
    # NOTE: measured on SmolLM2-135M (docs/measurements/quantisation.md): SmoothQuant's scales at 0.5 bring dynamic
    # int8 (per channel, down and head in fp32) from +6.4% / KL 0.072 / top-1 0.83 to +0.3% / 0.016 / 0.94.
    # Opt-in: a default that changed the int8 graphs would re-run every finished benchmark after an upgrade.
    smooth_alpha: float | None = Res(None, added=True, ge=0, le=1, description="int8 and int8s: SmoothQuant's "
                                     "migration strength (0.5 the paper's): each weight MatMul's input channels "
                                     "divided by max|x|^alpha / max|W|^(1-alpha) and its weight's rows multiplied "
                                     "by it, activation maxima from the calibration windows (calibration_samples, "
                                     "calibration_seq_len), before quantising; what keeps int8 on a model with "
                                     "outlier channels. null: no scales.")


class LlmBenchSection(Section):
    prompt_lens: list[int] = Res([32, 128], min_length=1, description="Prompt lengths for prefill latency "
                                 "and time to first token (batch 1).")
    batches: list[int] = Res([1, 4, 8], min_length=1, description="Batch sizes for time per output token.")
    decode_prompt_len: int = Res(32, ge=1, description="Prompt length before the decode measurements.")
    new_tokens: int = Res(32, ge=2, description="Tokens generated per decode measurement.")
    repeats: int = Res(3, ge=1, description="Timed repetitions of each measurement (after one warm-up).")
    sample_prompt: str = Res("def main(", description="Prompt of the generated sample shown per variant.")
    sample_tokens: int = Res(48, ge=1, description="Greedy tokens in each shown sample.")


class ServingBenchSection(Section):
    enabled: bool = Res(False, description="Measure `llmpipe serve` under load at the end of the stage: a server "
                        "of the run started on a free loopback port and stopped (llmpipe.bench.serving; `llmpipe "
                        "bench serve` measures at length).")
    variant: Literal["fp32", "fp16", "int8", "int4", "int8w", "int8s"] = Res("fp32", description="The variant the "
                                                                          "server serves.")
    concurrency: list[Annotated[int, Field(ge=1, le=64)]] = Res([1, 4], min_length=1, description="Concurrent "
                                                                "clients, one measurement each.")
    requests: int = Res(8, ge=1, le=1000, description="Prompts of the validation text sent per measurement.")
    prompt_tokens: int = Res(32, ge=1, description="Tokens per prompt.")
    max_tokens: int = Res(16, ge=1, description="Tokens generated per request (greedy).")


class BenchmarkSection(Section):
    variants: list[Literal["fp32", "fp16", "int8", "int4", "int8w", "int8s"]] = Res(
        ["fp32", "fp16", "int8"], min_length=1, description="Model variants to measure: fp16, int8 (dynamic), "
        "int4 / int8w (weight-only MatMulNBits), int8s (static, calibrated); fp32 is always the reference.")
    quantize: QuantizeSection = Res(default_factory=QuantizeSection, added=True,
                                    description="Settings of the quantised variants int4, int8w and int8s.")
    providers: Literal["auto"] | list[str] = Res("auto", description="ORT providers; auto: every one "
                                                   "present among CPU, CUDA, CANN.")
    shapes: list[tuple[int, int]] = Res([(1, 128), (4, 128)], min_length=1, description="(batch, seq).")
    warmup: int = Res(5, ge=0, description="Untimed iterations per measurement.")
    iters: int = Res(50, ge=1, description="Timed iterations per measurement.")
    torch_baseline: bool = Res(True, description="Measure PyTorch eager in the same run.")
    threads: int | None = Res(None, ge=1, description="Intra-op threads for ORT and torch; null: all cores.")
    llm: LlmBenchSection = Res(default_factory=LlmBenchSection, description="Generation benchmark: TTFT, "
                               "time per output token, decode tokens/s.")
    quality: QualitySection = Res(default_factory=QualitySection, description="Quality on validation text, "
                                  "and the limits a variant must meet.")
    # NOTE: operational, not hashed: it decides which rejections stop the pipeline, never what a stage measures
    # or judges (the verdicts are recorded either way), so changing it re-runs nothing that finished.
    require: list[Literal["fp32", "fp16", "int8", "int4", "int8w", "int8s"]] = Op(
        [], description="Variants that must pass their gates (benchmark.quality with its enforce, and the "
        "evaluation's with evaluate.enforce): one of them rejected fails the stage, naming every failing variant. "
        "Any other rejected variant is recorded with its numbers and not deployed (served, promoted, evaluated); "
        "the stage also fails when no variant is left deployable. Each must be in benchmark.variants.")
    serving: ServingBenchSection = Res(default_factory=ServingBenchSection, added=True,
                                       description="A short serving run: throughput and latency against "
                                       "concurrency.")
    device_id: int = Op(0, ge=0, description="NPU device ais_bench runs the OM models on.")

    @model_validator(mode="after")
    def _required_made(self) -> BenchmarkSection:
        missing = [v for v in self.require if v not in self.variants]
        if missing:
            raise ValueError(f"require: {', '.join(missing)} is not in benchmark.variants {list(self.variants)}")
        return self

    @model_validator(mode="after")
    def _smoothed_made(self) -> BenchmarkSection:
        if self.quantize.smooth_alpha is not None and not {"int8", "int8s"} & set(self.variants):
            raise ValueError(f"quantize.smooth_alpha: scales int8 and int8s, neither of which is in benchmark.variants "
                             f"{list(self.variants)}")
        return self


class MlflowSection(Section):
    """Experiment tracking and the model registry (llmpipe.tracking). Tracking never fails a stage: a
    server that cannot be reached costs one warning line and is tried again after the next stage."""

    enabled: bool = Op(False, description="Log this run to MLflow: one MLflow run per llmpipe run (params, "
                       "the train curves by global step, stage statuses, benchmark results, artifacts) and "
                       "register consolidate's hf/ as a model version.")
    tracking_uri: str | None = Op(None, description="Where: a server (http://host:5000), a database "
                                  "(sqlite:///path/mlflow.db) or a folder; null: sqlite:///<artifacts_dir>/"
                                  "mlflow.db, which needs nothing started.")
    experiment: str | None = Op(None, description="MLflow experiment; null: the config file's name "
                                "(configs/tiny.yaml: tiny), else the run name.")
    model_name: str | None = Op(None, description="Registered model that consolidate's hf/ becomes a new "
                                "version of; null: the run name.")
    timeout_s: float = Op(10.0, gt=0, le=600, description="HTTP timeout of one request to a tracking server.")
    retries: int = Op(1, ge=0, le=10, description="HTTP retries of one request (MLflow's own backoff); the "
                      "sync after the next stage retries the rest.")
    deadline_s: float = Op(600.0, gt=0, le=86400, description="At most this long for one sync of the run "
                           "folder (all its requests and uploads together): a server that answers a byte at a "
                           "time never trips timeout_s; past it, one warning line and the run goes on.")


class TrackingSection(Section):
    mlflow: MlflowSection = Op(default_factory=MlflowSection, description="MLflow tracking and registry.")


class EvalGate(Section):
    """How far one variant's task scores may fall below the reference (the hf/ folder through lm_eval's HFLM)."""

    max_drop: float | None = Res(None, ge=0, description="Largest absolute drop of any gated task metric "
                                 "(accuracy, exact match; bits per byte rising counts as a drop) against the "
                                 "reference; null: no limit.")
    tasks: dict[str, float] = Res({}, description="Per-task overrides of max_drop: {task name: largest drop}.")

    @field_validator("tasks")
    @classmethod
    def _drops(cls, v: dict[str, float]) -> dict[str, float]:
        bad = next((k for k, x in v.items() if not (isinstance(x, (int, float)) and x >= 0)), None)
        if bad is not None:
            raise ValueError(f"{bad}: a drop must be a number >= 0 (got {v[bad]!r})")
        return v


def _eval_gate(name: str, drop: float) -> Any:
    """An EvalGate subclass whose max_drop default is this variant's."""
    return type(f"{name.capitalize()}EvalGate", (EvalGate,), {
        "__annotations__": {"max_drop": "float | None"},
        "max_drop": Res(drop, ge=0, description=f"Largest absolute drop of any gated task metric of {name} against "
                        "the reference; null: no limit."),
        "__module__": __name__,
    })


# Defaults from measurement on the demo (docs/guides/evaluate.md, 40 items per task): fp32, fp16 and int8 scored the
# reference's llmpipe_choice accuracy exactly (stderr 0.076), and moved bits per byte by 0.0000, 0.0000 and
# -0.0007 (+0.0002 on another training of the same config). One item of 40 is 0.025: fp32 and fp16 may lose one
# (a near-tie flipped by rounding), int8 two; every limit is far above the bits-per-byte movement seen.
Fp32EvalGate, Fp16EvalGate, Int8EvalGate = _eval_gate("fp32", 0.03), _eval_gate("fp16", 0.03), _eval_gate("int8", 0.06)
# The quantised variants of benchmark.quantize, by their benchmark gates' room relative to int8's (int4's perplexity
# limit is twice int8's, int8w's and int8s's under half): int4 up to four items of 40, int8w and int8s one.
Int4EvalGate, Int8wEvalGate, Int8sEvalGate = (_eval_gate("int4", 0.10), _eval_gate("int8w", 0.03),
                                              _eval_gate("int8s", 0.03))


class EvalGatesSection(Section):
    fp32: Fp32EvalGate = Res(default_factory=Fp32EvalGate, description="Limits for ORT fp32.")
    fp16: Fp16EvalGate = Res(default_factory=Fp16EvalGate, description="Limits for ORT fp16.")
    int8: Int8EvalGate = Res(default_factory=Int8EvalGate, description="Limits for ORT int8.")
    int4: Int4EvalGate = Res(default_factory=Int4EvalGate, added=True, description="Limits for ORT int4.")
    int8w: Int8wEvalGate = Res(default_factory=Int8wEvalGate, added=True, description="Limits for ORT int8w.")
    int8s: Int8sEvalGate = Res(default_factory=Int8sEvalGate, added=True, description="Limits for ORT int8s.")


LOCAL_TASKS = ("llmpipe_choice", "llmpipe_ppl", "llmpipe_chat_qa")


class EvaluateSection(Section):
    tasks: list[str] = Res(["local"], min_length=1, description="lm_eval task names (offline: their datasets "
                           "must be in the local Hugging Face cache), paths to task YAML files inside the project "
                           "or the run, or `local`: the project's own tasks built from the run's data "
                           "(llmpipe_choice and llmpipe_ppl for text runs; llmpipe_ppl, and llmpipe_chat_qa with "
                           "evaluate.chat_questions, for chat runs).")
    limit: int | None = Res(40, gt=0, description="Documents per task (the first ones); null: all.")
    num_fewshot: int | None = Res(None, ge=0, description="Few-shot examples per prompt; null: each task's own.")
    batch_size: int = Res(1, ge=1, le=256, description="Requests per forward pass (1: each scored alone, as "
                          "dynamic int8 quantizes a pass's activations together).")
    seed: int = Res(1234, ge=0, description="lm_eval's seeds (few-shot sampling, python, numpy, torch).")
    choices: int = Res(4, ge=2, le=10, description="llmpipe_choice: candidates per item (the true next line "
                       "and distractors from other documents).")
    max_gen_tokens: int = Res(32, ge=1, description="Tokens generated per answer (generate_until).")
    chat_questions: str | None = Res(None, description="Chat runs: held-out conversations (JSON lines of "
                                     "{messages}, e.g. `llmpipe synth-chat`'s val.jsonl) for llmpipe_chat_qa: "
                                     "the last user turn asked, exact match against the assistant's answer.")
    torch: bool = Res(False, description="Also evaluate the consolidated weights in PyTorch eager (variant torch).")
    enforce: bool = Res(True, description="A variant beyond its gate fails the stage; false: marked rejected.")
    gates: EvalGatesSection = Res(default_factory=EvalGatesSection, description="Per variant: the largest "
                                  "task-score drop against the reference.")
    progress_every_s: float = Op(30.0, gt=0, description="Seconds between progress lines when not on a terminal.")

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str]) -> list[str]:
        for t in v:
            if not isinstance(t, str) or not t.strip() or "\n" in t:
                raise ValueError(f"{t!r}: a task is a name or a path to a YAML file")
        if len(set(v)) != len(v):
            raise ValueError("a task is listed twice")
        return v


class RunConfig(Section):
    run: RunSection = Res(default_factory=RunSection)
    data: DataSection = Res(...)
    model: ModelSection = Res(default_factory=ModelSection)
    train: TrainSection = Res(default_factory=TrainSection)
    consolidate: ConsolidateSection = Res(default_factory=ConsolidateSection)
    export: ExportSection = Res(default_factory=ExportSection)
    convert_om: ConvertOmSection = Res(default_factory=ConvertOmSection)
    benchmark: BenchmarkSection = Res(default_factory=BenchmarkSection)
    tracking: TrackingSection = Op(default_factory=TrackingSection, description="Experiment tracking.")
    evaluate: EvaluateSection = Res(default_factory=EvaluateSection)

    @model_validator(mode="after")
    def _evaluate_gates(self) -> RunConfig:
        """A gate set for a variant the benchmark does not make is a mistake, not a no-op. (Set: other than its
        default; a recorded config, which spells every default out, loads again.)"""
        gates = self.evaluate.gates
        for name, spec in type(gates).model_fields.items():
            if name not in self.benchmark.variants and getattr(gates, name) != spec.default_factory():
                raise ValueError(f"evaluate.gates.{name}: {name} is not a deployed variant (benchmark.variants: "
                                 f"{', '.join(self.benchmark.variants)})")
        return self

    @model_validator(mode="after")
    def _separate_adapter(self) -> RunConfig:
        """A separate adapter is a LoRA run's: without train.lora there is none to keep apart."""
        for name in ("int4", "int8w"):
            if getattr(self.benchmark.quantize, name).adapter == "separate" and self.train.lora is None:
                raise ValueError(f"benchmark.quantize.{name}.adapter: separate needs a LoRA run (train.lora), "
                                 "which this config does not train")
        if self.export.gguf_adapter == "separate":
            if self.train.lora is None:
                raise ValueError("export.gguf_adapter: separate needs a LoRA run (train.lora), which this config "
                                 "does not train")
            if not set(self.export.gguf) & {"q4_0", "q4_1"}:
                raise ValueError(f"export.gguf_adapter: separate applies to 4-bit files, and export.gguf "
                                 f"{self.export.gguf} has none (add q4_1)")
        return self

    @model_validator(mode="after")
    def _pretrained_tokenizer(self) -> RunConfig:
        """model.init_from: the folder's tokenizer.json is the run's tokenizer unless data.tokenizer.path
        names one; pretrained embeddings are meaningless under a tokenizer trained afresh."""
        if self.model.init_from and self.data.tokenizer.path is None:
            tok = Path(self.model.init_from) / "tokenizer.json"
            if not tok.is_file():
                raise ValueError(f"model.init_from: {tok} not found; set data.tokenizer.path to the tokenizer "
                                 "the weights were trained with")
            self.data.tokenizer.path = str(tok)
        return self

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
    preflight.check_before_run when a run is about to train)."""
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_error(err, tree)}") from None
    from llmpipe import config_checks  # lazily: its checks import torch (it imports no config: no circle)

    try:
        config_checks.check_artifacts_dir(cfg.run.artifacts_dir)
        config_checks.check_tracking(cfg.tracking.mlflow)
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
    _default_experiment(tree, path.stem)
    return from_dict(tree, source=str(path), check=check)


def _default_experiment(tree: dict[str, Any], name: str) -> None:
    """tracking.mlflow.experiment defaults to the config file's name; set here (it is recorded with the
    config, so `llmpipe track RUN` finds it later). A malformed section is left for validation to name."""
    tracking = tree.setdefault("tracking", {}) if tree.get("tracking") is None else tree["tracking"]
    if isinstance(tracking, dict):
        section = tracking.setdefault("mlflow", {}) if tracking.get("mlflow") is None else tracking["mlflow"]
        if isinstance(section, dict) and "experiment" not in section:  # a recorded null stays null
            section["experiment"] = name


def role(cls: type[BaseModel], name: str) -> str | None:
    """The role (RESULT or OPERATIONAL) a section class gives its field `name`, None if unmarked."""
    extra = cls.model_fields[name].json_schema_extra
    return extra.get(ROLE) if isinstance(extra, dict) else None


def _subsection(annotation: Any) -> type[Section] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def _result_only(cls: type[Section], data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    out = {}
    for name, value in data.items():
        if name not in cls.model_fields or role(cls, name) == OPERATIONAL:
            continue
        extra = cls.model_fields[name].json_schema_extra
        sub = _subsection(cls.model_fields[name].annotation)
        if isinstance(extra, dict) and extra.get(ADDED):
            default = cls.model_fields[name].get_default(call_default_factory=True)
            if value == (default.model_dump() if isinstance(default, BaseModel) else default):
                continue  # a section added later, at its default, counts as one field
        out[name] = _result_only(sub, value) if sub is not None else value
    return out


def _section_class(dotted: str) -> type[Section] | None:
    cls: type[Section] | None = RunConfig
    for part in dotted.split("."):
        cls = _subsection(cls.model_fields[part].annotation) if cls is not None else None
    return cls


def result_section(cfg: RunConfig, dotted: str) -> Any:
    """section() with the operational fields left out: what a stage's fingerprint hashes."""
    value = section(cfg, dotted)
    cls = _section_class(dotted)
    return _result_only(cls, value) if cls is not None else value


def operational_changes(old: dict[str, Any], new: dict[str, Any], sections: tuple[str, ...]) -> dict[str, list]:
    """{dotted field: [old, new]} of the operational fields under `sections` that differ between
    two config trees (as recorded in manifests)."""
    changes: dict[str, list] = {}

    def walk(cls: type[Section], a: Any, b: Any, prefix: str, operational: bool) -> None:
        for name in cls.model_fields:
            path, op = f"{prefix}{name}", operational or role(cls, name) == OPERATIONAL
            x = a.get(name) if isinstance(a, dict) else None
            y = b.get(name) if isinstance(b, dict) else None
            sub = _subsection(cls.model_fields[name].annotation)
            # a field added after `a` was recorded, at its default, is no change (e.g. train.launcher: local)
            absent = not isinstance(a, dict) or name not in a
            if sub is not None:
                walk(sub, x, y, path + ".", op)
            elif op and x != y and not (absent and y == cls.model_fields[name].get_default(call_default_factory=True)):
                changes[path] = [x, y]

    for dotted in sections:
        cls = _section_class(dotted)
        if cls is not None:  # a single field (run.seed) is result-defining by construction
            walk(cls, _dig(old, dotted), _dig(new, dotted), dotted + ".", False)
    return changes


def _dig(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def section(cfg: RunConfig, dotted: str) -> Any:
    """The JSON form of a (possibly nested) section, e.g. 'train' or 'run.seed'."""
    node: Any = cfg.to_dict()
    for part in dotted.split("."):
        node = node[part]
    return node
