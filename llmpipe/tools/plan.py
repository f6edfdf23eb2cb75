"""Size a training run before it starts: memory per device, FLOPs and time, gradient-sync volume,
pipeline bubble, and the largest micro-batch that fits a memory budget. Arithmetic only: no process
group, no model built (`llmpipe plan CONFIG`).

Memory follows what llmpipe keeps per device (AdamW, fp32 moments):
  ddp    fp32 weights 4 + fp32 grads 4 + AdamW 8 B/param; bf16/fp16 by autocast over fp32 weights.
  zero   params w + grads w + fp32 master 4 + AdamW 8 (w = 4 fp32, 2 bf16/fp16, DeepSpeed casts the
         module); stage 1 shards master+AdamW over dp, stage 2 also grads, stage 3 also params.
  fsdp   fp32 params + grads + AdamW sharded: 16/dp B/param (no separate master).
  lora   (train.lora) the frozen base counts its parameter bytes only (no gradient, master or AdamW
         state); the adapters (rank x (in + out) per targeted layer) count all of the above, and the
         step temporaries, unsharded gradients and gradient buffers are the adapters' size.
tp divides the matrices (not the norms); pp gives each rank its stage's layers, the embedding to the
first stage and the final norm and head to the last. A tied head (model.tie_embeddings) is the embedding:
counted once (parameters, memory, and the 6N of FLOPs, where the head's matmul counts once either way),
and once on each of the two pipeline stages that hold a copy. Besides model states: `working` copies (bf16 casts of
the weights, FSDP/ZeRO-3 gathered units, FSDP's unsharded gradients while accumulating), activations and
communication buffers. precision auto is planned as bf16 (what it means on an accelerator).

NOTE: activations use a count of what llmpipe's LLaMA block saves for backward
(`llama_layer_activation_bytes`, exact in fp32 on CPU). Korthikanti et al. 2022's GPT-shaped formula
(`layer_activation_bytes`) is kept for comparison: on LLaMA blocks (SwiGLU, RoPE, SDPA without the
score matrix) it is 6-15% off, either way depending on the sequence length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from llmpipe import device
from llmpipe import mfu as mfu_mod
from llmpipe.config import ConfigError, RunConfig
from llmpipe.models.llama.flavors import model_args
from llmpipe.models.llama.lora import LoraSpec, block_adapter_params
from llmpipe.models.llama.model import ModelArgs, sdpa_enable_gqa
from llmpipe.parallel import mesh, pipeline

GIB = 1 << 30
MIB = 1 << 20
ALPHA_S = 50e-6  # assumed latency per collective (one gradient bucket) for the latency term
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal budget
DEFAULT_MEMORY_GIB = device.PLAN_MEMORY_GIB  # the planning device's memory (llmpipe.device)
# The peak per device when neither --peak-tflops nor train.peak_tflops is given: the planning device's
# (the one the memory default is for) from llmpipe.mfu's table, as training reports MFU against.
DEFAULT_PEAK = {p: mfu_mod.table_peak(device.PLAN_DEVICE, p) for p in ("fp32", "bf16", "fp16")}
DAY_S = 86400.0
YEAR_S = 365.25 * DAY_S


# -- formulas on raw numbers --------------------------------------------------------------------------

def train_time_s(total_flops: float, n_devices: int, peak_tflops: float, mfu: float = 1.0) -> float:
    """Seconds to do `total_flops` on `n_devices` each sustaining peak_tflops * mfu."""
    return total_flops / (n_devices * peak_tflops * 1e12 * mfu)


def ring_factor(n: int) -> float:
    """Bytes each of n ranks sends per byte all-reduced by a ring: 2(n-1)/n."""
    return 2 * (n - 1) / n


def sync_time_s(nbytes: float, gbps: float, ring_n: int | None = None) -> float:
    """Seconds to move `nbytes` at `gbps` gigabits/s; with `ring_n`, as a ring all-reduce over that many ranks."""
    return nbytes * (ring_factor(ring_n) if ring_n else 1.0) * 8 / (gbps * 1e9)


def layer_activation_bytes(seq: int, batch: int, dim: int, heads: int, tp: int = 1, fp32: bool = False) -> float:
    """One transformer layer's saved activations for `batch` sequences (Korthikanti et al. 2022, 16-bit,
    no sequence parallel): s*b*h*(10 + 24/tp + 5*a*s/(h*tp)); fp32 doubles it."""
    s, b, h, a = seq, batch, dim, heads
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) * (2 if fp32 else 1)


def llama_layer_activation_bytes(seq: int, batch: int, dim: int, ffn_dim: int, heads: int, tp: int = 1,
                                 fp32: bool = False, kv_heads: int | None = None) -> float:
    """One llmpipe LLaMA block's saved activations for `batch` sequences, counted from what autograd keeps
    (SDPA without the s^2 score matrix, SwiGLU, rotary embeddings), per token in elements:

        6h + 2          replicated over tp: each RMSNorm keeps its input, its normalised output and the
                        rsqrt (2h + 1), and its weighted output is the next matmuls' saved input (h)
        (2h + 2k + 4f + a)/tp
                        split by tp: q after rotary (h), k after rotary and v (k each: kv_heads x
                        head_dim, what SDPA's enable_gqa keeps), the attention output (h, + a log-sum-exp
                        per head), wo's input; w1 and w3 outputs, SiLU output and the product w2 reads

    kv_heads None (or = heads) is multi-head attention, or GQA where the model repeats k and v before
    SDPA (on the NPU: model.Attention._attend), which keeps them at `heads`.
    fp32: 4 bytes each. bf16 autocast: the norms' fp32 internals (4h + 2) stay 4 bytes, the rest 2.
    Matches torch.autograd's saved tensors of a TransformerBlock exactly in fp32 (tests/unit/test_plan.py).
    """
    h, f, a = dim, ffn_dim, heads
    k = h * (kv_heads or heads) // heads
    split = (2 * h + 2 * k + 4 * f + a) / tp
    per_token = 4 * (6 * h + 2 + split) if fp32 else 4 * (4 * h + 2) + 2 * (2 * h + split)
    return seq * batch * per_token


def checkpointed_layer_bytes(seq: int, batch: int, dim: int, fp32: bool = False) -> float:
    """One checkpointed layer's saved input (B, T, d): 2*s*b*h bytes in 16-bit, twice that in fp32."""
    return 2 * seq * batch * dim * (2 if fp32 else 1)


def state_bytes_per_param(data: str, zero_stage: int, precision: str, dp: int, offload_optimizer: bool = False,
                          offload_param: bool = False) -> dict[str, float]:
    """Model-state bytes per (local) parameter on one device: params, grads, optimizer (master + AdamW), and
    `host` for what ZeRO offloads to host memory."""
    if data == "ddp":
        return {"params": 4.0, "grads": 4.0, "optimizer": 8.0, "host": 0.0}
    if data == "fsdp":
        return {"params": 4 / dp, "grads": 4 / dp, "optimizer": 8 / dp, "host": 0.0}
    w = 4.0 if precision == "fp32" else 2.0
    # NOTE: DeepSpeed keeps a separate fp32 master copy also in fp32 runs (measured with the torch client
    # optimizer: benchmarks/memory_per_rank.py), so ZeRO-3 in fp32 is 20/dp, not 16/dp.
    out = {"params": w / dp if zero_stage >= 3 else w, "grads": w / dp if zero_stage >= 2 else w,
           "optimizer": 12 / dp, "host": 0.0}
    if offload_optimizer:
        out["host"], out["optimizer"] = out["optimizer"], 0.0
    if offload_param:
        out["host"], out["params"] = out["host"] + out["params"], 0.0
    return out


# -- the layout ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What the plan needs from a config, flat, so the recommendation can vary one field at a time."""

    args: ModelArgs
    dp: int
    tp: int
    pp: int
    data: str  # ddp | zero | fsdp
    zero_stage: int
    precision: str  # fp32 | bf16 | fp16 (auto resolved to bf16: the plan is for accelerators)
    seq_len: int
    micro: int
    accum: int
    checkpointing: bool
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    split_points: tuple[int, ...] | None = None
    offload_optimizer: bool = False
    offload_param: bool = False
    bucket_cap_mb: float = 25.0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reshard_after_forward: bool = True
    # the choices training makes on run.device (auto: planned as for the NPU, repeated k/v and foreach AdamW)
    gqa_in_sdpa: bool = True  # GQA k/v kept at n_kv_heads (SDPA's enable_gqa), not repeated to n_heads
    fused_adamw: bool = False  # torch's fused AdamW: no step temporaries
    lora: LoraSpec | None = None  # train.lora: only the adapters are trained

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def fp32(self) -> bool:
        return self.precision == "fp32"


def planned_vocab(cfg: RunConfig) -> int | None:
    """The vocabulary to plan with: data.tokenizer.vocab_size for a tokenizer the run trains; None (the
    model's own) for model.init_from, whose folder's tokenizer and config.json define it (issue 36 item 14:
    the default 8,192 against an init_from's 4,096 refused the plan), and for data.tokenizer.path."""
    if cfg.model.init_from or cfg.data.tokenizer.path:
        return None
    return cfg.data.tokenizer.vocab_size


def setup_from_config(cfg: RunConfig, world_size: int | None = None) -> Setup:
    """The Setup of `cfg` at `world_size` (default: dp*tp*pp, or nproc_per_node when dp is inferred);
    the layout is validated as training validates it (LayoutError, or ConfigError for the model)."""
    t, par = cfg.train, cfg.train.parallel
    try:
        args = model_args(cfg.model, planned_vocab(cfg))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.data.seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len={args.max_seq_len}")
    from llmpipe.train.cluster import planned_world  # a scheduler's job: its nodes x nproc_per_node

    world = planned_world(cfg, world_size) or (par.dp * par.tp * par.pp if par.dp is not None
                                               else t.nproc_per_node)
    dims = mesh.validate(par, args, world, t.micro_batch_size)
    precision = "bf16" if t.precision.dtype == "auto" else t.precision.dtype
    if dims.tp * dims.pp > 1:
        from llmpipe.parallel.mesh import check_supported

        check_supported(cfg, precision)  # what training refuses, the plan refuses too
    return Setup(args=args, dp=dims.dp, tp=dims.tp, pp=dims.pp, data=par.data, zero_stage=par.zero_stage,
                 precision=precision, seq_len=cfg.data.seq_len, micro=t.micro_batch_size, accum=t.grad_accum_steps,
                 checkpointing=t.activation_checkpointing, schedule=par.pp_schedule, microbatches=par.microbatches,
                 virtual_stages=par.virtual_stages,
                 split_points=tuple(par.split_points) if par.split_points is not None else None,
                 offload_optimizer=par.offload_optimizer != "none", offload_param=par.offload_param != "none",
                 bucket_cap_mb=par.bucket_cap_mb, reduce_bucket_size=par.reduce_bucket_size,
                 allgather_bucket_size=par.allgather_bucket_size, overlap_comm=par.overlap_comm,
                 contiguous_gradients=par.contiguous_gradients, reshard_after_forward=par.reshard_after_forward,
                 gqa_in_sdpa=sdpa_enable_gqa(cfg.run.device), fused_adamw=device.fused_adamw({cfg.run.device}),
                 lora=LoraSpec.of(t.lora))


@dataclass(frozen=True)
class StageParams:
    """Local parameter counts on one pipeline rank (tp shards counted locally)."""

    layers: int
    block: int  # one transformer block: matrices / tp + its two norms
    block_norms: int  # of `block`, the norm weights (never tp-split, never autocast)
    embedding: int  # first stage only
    head: int  # last stage only: output matrix / tp + final norm (a tied head on the embedding's stage: the norm)
    head_matmul: int = 0  # the head's matrix / tp that its matmul reads (tied or not), on the last stage

    @property
    def total(self) -> int:
        return self.layers * self.block + self.embedding + self.head


def stage_params(args: ModelArgs, tp: int = 1, pp: int = 1, virtual_stages: int = 1,
                 split_points: list[int] | tuple[int, ...] | None = None) -> list[StageParams]:
    """StageParams of each pipeline rank, from the model's shapes (the dry run's DTensor shards agree). A tied
    head (model.tie_embeddings) is the embedding: counted once where one rank holds both, and once on each of
    the first and last pipeline stages, which each hold a copy (llmpipe.parallel.tied)."""
    d, hd = args.dim, args.head_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    matrices = d * q * 2 + d * kv * 2 + 3 * d * args.ffn_dim
    # q/k/v biases are split with their columns; the q/k norms (head_dim each) are replicated like the block norms
    split = matrices + ((q + 2 * kv) if args.attn_bias else 0)
    norms = 2 * d + (2 * hd if args.qk_norm else 0)
    n_stages = pp * virtual_stages
    splits = pipeline.split_layers(args.n_layers, n_stages, list(split_points) if split_points else None)
    out, table = [], args.vocab_size * d // tp
    for r in range(pp):
        ids = pipeline.stage_ids(r, pp, virtual_stages)
        first, last = 0 in ids, n_stages - 1 in ids
        shared = args.tie_embeddings and first  # the head is this stage's embedding
        out.append(StageParams(layers=sum(len(splits[s]) for s in ids), block=split // tp + norms, block_norms=norms,
                               embedding=table if first else 0,
                               head=(0 if shared else table) + d if last else 0,
                               head_matmul=table if last else 0))
    return out


# -- memory -------------------------------------------------------------------------------------------

@dataclass
class Memory:
    """Bytes on one device (the pipeline rank `pp_rank`). `working`: transient parameter copies (bf16 casts,
    gathered FSDP/ZeRO-3 units) and FSDP's unsharded gradients while accumulating. `activations` is the
    config's choice of the two variants; `total` includes it."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    working: int
    activations_full: int
    activations_checkpointed: int
    activations: int
    buffers: int
    total: int
    host: int
    step: int = 0  # the optimizer step's temporaries (not at the same time as working copies and activations)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer


def trained_params(s: Setup, st: StageParams) -> int:
    """Parameters with gradients and optimizer state on this stage: all of them, or LoRA's adapters."""
    return st.total if s.lora is None else st.layers * block_adapter_params(s.args, s.lora)


def _adapters(s: Setup, st: StageParams) -> int:
    """LoRA's adapter parameters on this stage (0 without LoRA): stored beside the base."""
    return 0 if s.lora is None else trained_params(s, st)


def _working_bytes(s: Setup, st: StageParams) -> int:
    half = not s.fp32
    if s.data == "ddp" and s.tp * s.pp == 1:  # torch DDP: autocast caches bf16 casts of the matrices
        matrices = st.layers * (st.block - st.block_norms) + st.head_matmul  # the head's cast, tied or not
        return 2 * matrices if half else 0  # (the cache lives until forward ends, beside the activations)
    if s.data == "ddp":  # replicate (FSDP2 machinery): bf16 copies of all parameters, kept forward to backward
        return 2 * st.total if half else 0
    unit = 2 if half else 4
    if s.data == "zero":  # ZeRO-3 gathers one block at a time; 1/2 hold whole params already
        return unit * st.block if s.zero_stage == 3 else 0
    gathered = unit * (st.embedding + st.head + (st.block if s.reshard_after_forward else st.layers * st.block))
    accumulating = (s.accum > 1) if s.pp == 1 else (s.microbatches > 1)
    return gathered + (4 * trained_params(s, st) if accumulating else 0)  # unsharded fp32 grads until the last
    # micro-step


def _step_bytes(s: Setup, n: int) -> int:
    """Temporaries of the optimizer step on the device (benchmarks/build_memory.py): torch's foreach
    AdamW allocates its denominator, one fp32 tensor per optimizer parameter it updates (4 B/param,
    measured for DDP and FSDP2 within 1%); the fused AdamW used on CPU allocates none. Under ZeRO,
    DeepSpeed also hands the fp32 master partition an fp32 gradient of its own and copies the updated
    master back: ZeRO-3 measured 12 B per local parameter in all, with foreach and with fused AdamW
    alike (4.57 and 4.43 GiB peaks of benchmarks/build_memory.py's 285M model); stages 1/2 are taken as
    8 (not measured). Activations are freed by then, so the peak is the larger of this and
    forward/backward's working set."""
    local = n if s.data == "ddp" else n / s.dp  # the parameters this device's optimizer updates
    if s.data != "zero":
        return 0 if s.fused_adamw else int(4 * local)
    return 0 if s.offload_optimizer else int((12 if s.zero_stage == 3 else 8) * local)


def _in_flight(s: Setup, r: int) -> tuple[int, float]:
    """(pipeline micro-batches whose activations pp rank r holds at once, layers each covers)."""
    st_layers = stage_params(s.args, s.tp, s.pp, s.virtual_stages, s.split_points)[r].layers
    if s.pp == 1:
        return 1, st_layers
    m, v = s.microbatches, s.virtual_stages
    if s.schedule == "gpipe":
        return m, st_layers
    if s.schedule == "interleaved_1f1b":  # Megatron's warm-up count, in chunks of layers / v
        return min((s.pp - r - 1) * 2 + (v - 1) * s.pp + 1, v * m), st_layers / v
    return min(s.pp - r, m), st_layers


def _activation_bytes(s: Setup, r: int, checkpointing: bool) -> float:
    b = s.micro // s.microbatches if s.pp > 1 else s.micro
    a = s.args
    n, layers = _in_flight(s, r)
    full = llama_layer_activation_bytes(s.seq_len, b, a.dim, a.ffn_dim, a.n_heads, s.tp, s.fp32,
                                        a.n_kv_heads if s.gqa_in_sdpa else None)
    if checkpointing:
        kept = n * layers * checkpointed_layer_bytes(s.seq_len, b, a.dim, s.fp32) + full  # + one recomputed layer
    else:
        kept = n * layers * full
    if r == s.pp - 1:  # fp32 logits for cross-entropy (replicated over tp: no loss parallel)
        kept += (s.microbatches if s.pp > 1 and s.schedule == "gpipe" else 1) * b * s.seq_len * a.vocab_size * 4
    return kept


def _buffers(s: Setup, st: StageParams) -> int:
    if s.dp == 1:
        return 0
    if s.data == "ddp" and s.tp * s.pp == 1:  # two buckets in flight, never more than the gradients
        return int(min(2 * s.bucket_cap_mb * MIB, 4 * trained_params(s, st)))
    if s.data in ("ddp", "fsdp"):  # FSDP2 machinery: the largest unit's unsharded fp32 gradients and the
        # flat reduce input they are copied into, both alive during the copy (measured: build_memory.py)
        if s.lora is not None:  # only the blocks' adapters have gradients
            return 2 * 4 * block_adapter_params(s.args, s.lora)
        return 2 * 4 * max(st.block, st.embedding + st.head)
    w = 4 if s.fp32 else 2
    # NOTE: with contiguous_gradients DeepSpeed allocates the whole reduce bucket (two with overlap_comm in
    # stages 1/2) however small the model; the all-gather bucket is bounded by the parameters.
    reduce = s.reduce_bucket_size if s.contiguous_gradients else min(s.reduce_bucket_size, st.total)
    reduce *= 2 if s.overlap_comm and s.zero_stage < 3 else 1
    gather = min(s.allgather_bucket_size, st.total) if s.zero_stage < 3 else 0
    return w * (reduce + gather)


def memory(s: Setup) -> list[Memory]:
    """Memory of each pipeline rank."""
    per = state_bytes_per_param(s.data, s.zero_stage, s.precision, s.dp, s.offload_optimizer, s.offload_param)
    out = []
    for r, st in enumerate(stage_params(s.args, s.tp, s.pp, s.virtual_stages, s.split_points)):
        n, trained = st.total + _adapters(s, st), trained_params(s, st)
        params = int(per["params"] * n)
        grads, opt = (int(per[k] * trained) for k in ("grads", "optimizer"))
        full, ckpt = int(_activation_bytes(s, r, False)), int(_activation_bytes(s, r, True))
        act = ckpt if s.checkpointing else full
        working, buffers, step = _working_bytes(s, st), _buffers(s, st), _step_bytes(s, trained)
        out.append(Memory(r, params, grads, opt, working, full, ckpt, act, buffers,
                          params + grads + opt + max(working + act, step) + buffers,
                          _host(s, per, n, trained), step))
    return out


def _host(s: Setup, per: dict[str, float], n: int, trained: int) -> int:
    """Bytes ZeRO offloads to host memory: the optimizer's (trained parameters) and the parameters'."""
    if s.lora is None:
        return int(per["host"] * n)
    kept = state_bytes_per_param(s.data, s.zero_stage, s.precision, s.dp)  # before offloading
    return int((kept["optimizer"] * trained if s.offload_optimizer else 0)
               + (kept["params"] * n if s.offload_param else 0))


def peak_memory(s: Setup) -> Memory:
    """The pipeline rank with the most memory."""
    return max(memory(s), key=lambda m: m.total)


# -- communication ------------------------------------------------------------------------------------

def sync_volume_bytes(data: str, zero_stage: int, grad_bytes: float, param_bytes: float, dp: int, accum: int = 1,
                      reshard_after_forward: bool = True) -> float:
    """Bytes each device sends per optimizer step for data-parallel sync, with ring collectives over dp
    ((n-1)/n per reduce-scatter or all-gather, twice that per all-reduce). With fp32 and no accumulation
    ZeRO-1/2 equal DDP's all-reduce, ZeRO-3 and FSDP 1.5x it (parameters gathered for forward and again for
    backward); ZeRO-2/3 reduce every micro-step and FSDP/ZeRO-3 gather every micro-step."""
    f = (dp - 1) / dp
    if data == "ddp":
        return 2 * f * grad_bytes
    if data == "fsdp":
        return f * ((2 if reshard_after_forward else 1) * accum * param_bytes + grad_bytes)
    if zero_stage == 1:
        return f * (grad_bytes + param_bytes)
    if zero_stage == 2:
        return f * (accum * grad_bytes + param_bytes)
    return f * accum * (2 * param_bytes + grad_bytes)


def _comm(s: Setup, st: StageParams) -> tuple[int, float, int]:
    """(gradient bytes, bytes sent per step, collectives per step) for this device's stage."""
    if s.dp == 1:
        return 0, 0.0, 0
    n, w, trained = st.total + _adapters(s, st), 4 if s.fp32 else 2, trained_params(s, st)
    # ZeRO reduces in the module's dtype (DeepSpeed's default communication_data_type); DDP reduces fp32
    # gradients and FSDP2/replicate reduce in fp32 (reduce_dtype), gathering parameters in param_dtype.
    grad_bytes = trained * (w if s.data == "zero" else 4)
    param_bytes = n * (4 if s.data == "ddp" else w)
    volume = sync_volume_bytes(s.data, s.zero_stage, grad_bytes, param_bytes, s.dp, s.accum, s.reshard_after_forward)
    units = st.layers + 1  # FSDP2/replicate: one collective per block and one for the root
    if s.data == "ddp":
        calls = math.ceil(grad_bytes / (s.bucket_cap_mb * MIB)) if s.tp * s.pp == 1 else units
    elif s.data == "fsdp":
        calls = units * (1 + (2 if s.reshard_after_forward else 1) * s.accum)
    else:
        buckets = math.ceil(n / s.reduce_bucket_size)
        gathers = math.ceil(n / s.allgather_bucket_size)
        calls = {1: buckets + gathers, 2: s.accum * buckets + gathers}.get(s.zero_stage,
                                                                          s.accum * (buckets + 2 * units))
    return grad_bytes, volume, calls


# -- recommendation -----------------------------------------------------------------------------------

@dataclass
class Recommendation:
    memory_gib: float
    fits: bool  # the config as it is
    micro_batch_size: int | None  # the largest power of two that fits (after `change`), None if none does
    grad_accum_steps: int | None  # keeps micro * accum * dp of the config
    total: int | None  # bytes on the busiest device at that micro-batch
    change: str | None  # a setting that has to change for anything to fit
    note: str


def micro_batch_candidates(s: Setup) -> list[int]:
    """Powers of two that divide micro * accum (the samples per replica per step) and, with a pipeline,
    split into `microbatches` equal pipeline micro-batches."""
    per_replica = s.micro * s.accum
    out, b = [], 1
    while b <= per_replica:
        if per_replica % b == 0 and (s.pp == 1 or b % s.microbatches == 0):
            out.append(b)
        b *= 2
    return out


def _largest_fit(s: Setup, budget: float) -> tuple[int, int] | None:
    per_replica = s.micro * s.accum
    for b in reversed(micro_batch_candidates(s)):
        total = peak_memory(replace(s, micro=b, accum=per_replica // b)).total
        if total <= budget:
            return b, total
    return None


def _alternatives(s: Setup) -> list[tuple[str, Setup]]:
    """Settings to try when nothing fits, least disruptive first."""
    out = []
    if not s.checkpointing:
        out.append(("activation_checkpointing=true", replace(s, checkpointing=True)))
    acs = [False, True] if not s.checkpointing else [True]
    with_ac = lambda ac: ", activation_checkpointing=true" if ac != s.checkpointing else ""
    if s.tp * s.pp == 1:  # data=zero does not compose with tp/pp in llmpipe
        for k in range(s.zero_stage + 1 if s.data == "zero" else 1, 4):
            for ac in acs:
                out.append((f"data=zero, zero_stage={k}{with_ac(ac)}",
                            replace(s, data="zero", zero_stage=k, checkpointing=ac)))
    if s.data != "fsdp":
        for ac in acs:
            out.append((f"data=fsdp{with_ac(ac)}", replace(s, data="fsdp", zero_stage=0, checkpointing=ac,
                                                           offload_optimizer=False, offload_param=False)))
    return out


def recommend(s: Setup, memory_gib: float = DEFAULT_MEMORY_GIB) -> Recommendation:
    """The largest power-of-two micro-batch that fits `memory_gib` per device, with the accumulation that
    keeps the global batch; when none does, the first of `_alternatives` that makes one fit."""
    budget, per_replica = memory_gib * GIB, s.micro * s.accum
    fits = peak_memory(s).total <= budget
    candidates = micro_batch_candidates(s)
    if not candidates:
        return Recommendation(memory_gib, fits, None, None, None, None,
                              f"no power of two divides micro x accum = {per_replica} into whole pipeline "
                              f"micro-batches (microbatches={s.microbatches})")
    found = _largest_fit(s, budget)
    if found:
        b, total = found
        return Recommendation(memory_gib, fits, b, per_replica // b, total, None,
                              f"micro_batch_size={b}, grad_accum_steps={per_replica // b} fits "
                              f"({total / GIB:.1f} of {memory_gib:g} GiB) and keeps {per_replica * s.dp} sequences "
                              "per step")
    smallest = f"even micro-batch {candidates[0]} does not fit in {memory_gib:g} GiB"
    for label, alt in _alternatives(s):
        found = _largest_fit(alt, budget)
        if found:
            b, total = found
            return Recommendation(memory_gib, fits, b, per_replica // b, total, label,
                                  f"{smallest}; with {label}: micro_batch_size={b}, grad_accum_steps="
                                  f"{per_replica // b} fits ({total / GIB:.1f} GiB)")
    return Recommendation(memory_gib, fits, None, None, None, None,
                          f"{smallest}, nor with activation checkpointing or a higher ZeRO stage / FSDP: use more "
                          "devices (tp, pp), offload, or a shorter seq_len")


# -- the plan -----------------------------------------------------------------------------------------

@dataclass
class Plan:
    """Everything `llmpipe plan` prints. Bytes, FLOPs and seconds are raw numbers; the table converts."""

    flavor: str
    n_params: int
    n_params_non_embedding: int
    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int
    world_size: int
    dp: int
    tp: int
    pp: int
    data: str
    zero_stage: int
    precision: str
    precision_auto: bool
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    activation_checkpointing: bool
    memory: Memory  # the busiest device
    stage_totals: list[int]  # total bytes of each pipeline rank
    flops_per_token: float
    tokens_per_step: int
    flops_per_step: float
    tokens: float
    total_flops: float
    peak_tflops: float | None  # per device; None: no figure for the planning device in this dtype
    peak_source: str  # where peak_tflops comes from, or why there is none
    mfu: float
    step_s: float | None  # None without a peak, as are the training times
    train_days: float | None
    train_years_one_device: float | None
    grad_bytes: int
    sync_volume_bytes: float
    bandwidth_gbps: float
    sync_plain_s: float  # grad_bytes * 8 / bandwidth
    sync_ring_s: float  # a ring all-reduce of grad_bytes over dp
    sync_s: float  # sync_volume_bytes at the bandwidth
    collectives: int
    alpha_s: float
    latency_s: float
    schedule: str
    microbatches: int
    virtual_stages: int
    bubble: float
    recommendation: Recommendation

    def to_dict(self) -> dict:
        out = asdict(self)
        out["memory"]["model_states"] = self.memory.model_states
        return out


def _check_positive(**values: float | None) -> None:
    for name, v in values.items():
        if v is not None and not v > 0:
            raise ConfigError(f"{name.replace('_', '-')} must be > 0 (got {v:g})")


def _over(x: float | None, unit: float) -> float | None:
    return None if x is None else x / unit


def plan(cfg: RunConfig, world_size: int | None = None, *, peak_tflops: float | None = None, mfu: float = 0.4,
         bandwidth_gbps: float = 100.0, tokens: float | None = None, memory_gib: float | None = None) -> Plan:
    """Size `cfg`'s run at `world_size`: see the module docstring for what is counted."""
    _check_positive(world_size=world_size, peak_tflops=peak_tflops, mfu=mfu, bandwidth_gbps=bandwidth_gbps,
                    tokens=tokens, memory_gib=memory_gib)
    if mfu > 1:
        raise ConfigError(f"mfu is a fraction of peak, at most 1 (got {mfu:g})")
    s = setup_from_config(cfg, world_size)
    a = s.args
    stages = memory(s)
    busiest = max(stages, key=lambda m: m.total)
    override = peak_tflops or cfg.train.peak_tflops
    peak = mfu_mod.Peak(override, "--peak-tflops" if peak_tflops else "train.peak_tflops") if override \
        else DEFAULT_PEAK[s.precision]
    fpt = mfu_mod.flops_per_token(a, s.seq_len)

    def seconds(flops: float, devices: int) -> float | None:
        return train_time_s(flops, devices, peak.tflops, mfu) if peak.tflops else None

    tokens_per_step = s.micro * s.accum * s.dp * s.seq_len
    budget = tokens if tokens is not None else TOKENS_PER_PARAM * a.num_params()
    grad_bytes, volume, calls = _comm(s, stage_params(a, s.tp, s.pp, s.virtual_stages, s.split_points)[busiest.pp_rank])
    return Plan(
        flavor=cfg.model.shown(), n_params=a.num_params(), n_params_non_embedding=a.num_params(embeddings=False),
        n_layers=a.n_layers, dim=a.dim, n_heads=a.n_heads, vocab_size=a.vocab_size, world_size=s.world, dp=s.dp,
        tp=s.tp, pp=s.pp, data=s.data, zero_stage=s.zero_stage, precision=s.precision,
        precision_auto=cfg.train.precision.dtype == "auto", seq_len=s.seq_len,
        micro_batch_size=s.micro, grad_accum_steps=s.accum, activation_checkpointing=s.checkpointing,
        memory=busiest, stage_totals=[m.total for m in stages],
        flops_per_token=fpt, tokens_per_step=tokens_per_step, flops_per_step=fpt * tokens_per_step, tokens=budget,
        total_flops=fpt * budget, peak_tflops=peak.tflops, peak_source=peak.source, mfu=mfu,
        step_s=seconds(fpt * tokens_per_step, s.world),
        train_days=_over(seconds(fpt * budget, s.world), DAY_S),
        train_years_one_device=_over(seconds(fpt * budget, 1), YEAR_S),
        grad_bytes=grad_bytes, sync_volume_bytes=volume, bandwidth_gbps=bandwidth_gbps,
        sync_plain_s=sync_time_s(grad_bytes, bandwidth_gbps),
        sync_ring_s=sync_time_s(grad_bytes, bandwidth_gbps, ring_n=s.dp) if s.dp > 1 else 0.0,
        sync_s=sync_time_s(volume, bandwidth_gbps), collectives=calls, alpha_s=ALPHA_S, latency_s=calls * ALPHA_S,
        schedule=s.schedule, microbatches=s.microbatches, virtual_stages=s.virtual_stages,
        bubble=pipeline.bubble_fraction(s.pp, s.microbatches, s.virtual_stages) if s.pp > 1 else 0.0,
        recommendation=recommend(s, memory_gib or DEFAULT_MEMORY_GIB))


# -- the table ----------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GIB:10.3f} GiB"


def _other_total(m: Memory, checkpointing: bool) -> int:
    """The total with the other activation choice (checkpointing on or off)."""
    other = m.activations_full if checkpointing else m.activations_checkpointed
    return m.model_states + max(m.working + other, m.step) + m.buffers


def _memory_lines(p: Plan) -> list[str]:
    m, ac = p.memory, p.activation_checkpointing
    state = {"ddp": "fp32 weights, grads, AdamW", "fsdp": f"fp32, sharded over dp={p.dp}",
             "zero": f"ZeRO-{p.zero_stage} over dp={p.dp}"}[p.data]
    where = f"pp rank {m.pp_rank} of {p.pp}, the fullest" if p.pp > 1 else "every device alike"
    lines = [f"memory per device ({where}; * = the config's activation checkpointing)",
             f"  parameters                {_gib(m.params)}   ({state})",
             f"  gradients                 {_gib(m.grads)}",
             f"  optimizer (master, AdamW) {_gib(m.optimizer)}",
             f"  working copies            {_gib(m.working)}   (bf16 casts, gathered units, unsharded grads)",
             f"  activations, checkpointed {_gib(m.activations_checkpointed)} {'*' if ac else ' '}",
             f"  activations, full         {_gib(m.activations_full)} {' ' if ac else '*'}",
             f"  communication buffers     {_gib(m.buffers)}",
             f"  optimizer step temps      {_gib(m.step)}   (instead of working copies and activations, if larger)",
             f"  total                     {_gib(m.total)}   (the other activation choice: "
             f"{_other_total(m, ac) / GIB:.2f} GiB)"]
    if m.host:
        lines.append(f"  host memory (offload)     {_gib(m.host)}")
    if p.pp > 1:
        lines.append("  per pp rank               " + ", ".join(f"{t / GIB:.2f}" for t in p.stage_totals) + " GiB")
    return lines


def _time_lines(p: Plan) -> list[str]:
    budget = f"  token budget              {p.tokens / 1e9:14,.1f} B tokens"
    if p.step_s is None:  # no peak for the planning device in this dtype: no times, and why
        return [f"  step time                 {'n/a':>14}          ({p.peak_source})", budget,
                f"  training time             {'n/a':>14}"]
    return [f"  step time                 {p.step_s:14.4g} s        (at {p.peak_tflops:g} TFLOPS x MFU {p.mfu:g} "
            f"x {p.world_size} devices; peak: {p.peak_source})", budget,
            f"  training time             {p.train_days:14,.4g} days     on {p.world_size} devices "
            f"({p.train_years_one_device:,.4g} years on one)"]


def format_table(p: Plan) -> str:
    """A readable report of a Plan (GiB, GFLOPs, s, days)."""
    r = p.recommendation
    data = f"zero stage {p.zero_stage}" if p.data == "zero" else p.data
    seqs = p.micro_batch_size * p.grad_accum_steps * p.dp
    lines = [
        f"model    {p.flavor}: {p.n_params / 1e9:.3f}B parameters ({p.n_params_non_embedding / 1e9:.3f}B "
        f"non-embedding), {p.n_layers} layers, dim {p.dim}, {p.n_heads} heads, vocab {p.vocab_size}",
        f"layout   dp={p.dp} x tp={p.tp} x pp={p.pp} = {p.world_size} devices, data={data}, {p.precision}"
        + (" (precision auto: bf16, as on an accelerator)" if p.precision_auto else ""),
        f"batch    micro {p.micro_batch_size} x accum {p.grad_accum_steps} x dp {p.dp} = {seqs} sequences x "
        f"{p.seq_len} tokens = {p.tokens_per_step:,} tokens per step",
        "", *_memory_lines(p), "",
        "compute",
        f"  FLOPs per token           {p.flops_per_token / 1e9:14,.2f} GFLOPs   (6N + 12*L*d*T)",
        f"  FLOPs per step            {p.flops_per_step / 1e9:14,.0f} GFLOPs",
        *_time_lines(p),
        "",
        f"gradient sync per device per step (dp={p.dp}, {p.bandwidth_gbps:g} Gbps)",
        f"  gradients                 {_gib(p.grad_bytes)}",
        f"  sent (ring collectives)   {_gib(p.sync_volume_bytes)}",
        f"  time                      {p.sync_s:10.4g} s     (gradients alone: {p.sync_plain_s:.4g} s as plain "
        f"bytes, {p.sync_ring_s:.4g} s as a ring all-reduce)",
        f"  latency                   {p.latency_s:10.4g} s     ({p.collectives} collective(s) x "
        f"{p.alpha_s * 1e6:g} us assumed)",
        "",
        f"pipeline bubble             {p.bubble:10.3f}         " + (
            f"({p.schedule}, p={p.pp}, m={p.microbatches}" + (f", v={p.virtual_stages}" if p.virtual_stages > 1
                                                               else "") + ")" if p.pp > 1 else "(no pipeline)"),
        "",
        f"fits {r.memory_gib:g} GiB per device   {'yes' if r.fits else 'NO'}",
        f"recommendation              {r.note}",
    ]
    return "\n".join(lines)
