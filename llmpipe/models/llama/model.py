"""LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention via SDPA.

Architecture only: no device, distributed, checkpoint or orchestration code here. Layers live in a
ModuleDict keyed "0".."n-1" and `forward` tolerates a missing embedding, norm or head, so a
pipeline stage is cut by deleting modules. RoPE uses the rotate-half convention of Hugging Face's
Llama, so converting weights to HF names is a pure rename. The families' differences are options of
this one decoder (ModelArgs: head_dim, tie_embeddings, attn_bias, qk_norm), not copies of it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 8192
    ffn_dim: int = 688
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Llama 3.1's frequency scaling: {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; None: plain RoPE.
    rope_scaling: dict | None = None
    # The options below are the families' differences (Qwen2, Qwen3, Llama 3.2, SmolLM2); each default is
    # the original LLaMA, so a model made before they existed builds and initialises bitwise as it did.
    # head_dim: per-head width; None (the default) resolves to dim // n_heads in __post_init__, so
    # `args.head_dim` is always an int. Qwen3 sets it apart (0.6B: hidden 1024, 16 heads of 128).
    head_dim: int | None = None
    # tie_embeddings: the output head IS the embedding matrix (one Parameter, one tensor in a state dict).
    tie_embeddings: bool = False
    # attn_bias: q/k/v projections carry a bias, o_proj does not (Qwen2 / Qwen2.5).
    attn_bias: bool = False
    # qk_norm: an RMSNorm over head_dim on each head of q and k, before RoPE (Qwen3's q_norm / k_norm).
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for RoPE")

    def explicit_head_dim(self) -> bool:
        """Whether head_dim differs from dim // n_heads (a value set apart, as Qwen3's)."""
        return self.dim % self.n_heads != 0 or self.head_dim != self.dim // self.n_heads

    def to_dict(self) -> dict:
        """Every field; the options at their defaults are left out, so a model without them records what it
        did before they existed (checkpoint meta.json, model_config.json)."""
        out = asdict(self)
        for key, default in _OPTION_DEFAULTS.items():
            if out[key] == default:
                del out[key]
        if not self.explicit_head_dim():
            del out["head_dim"]
        return out

    def num_params(self, embeddings: bool = True) -> int:
        """Distinct parameters (a tied head counted once). embeddings=False leaves out the input
        embedding but keeps the output head (its matmul is compute; llmpipe.mfu), tied or not."""
        d, f, hd = self.dim, self.ffn_dim, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q * 2 + d * kv * 2 + ((q + 2 * kv) if self.attn_bias else 0) + (2 * hd if self.qk_norm else 0)
        block = attn + 3 * d * f + 2 * d
        n = self.n_layers * block + d + d * self.vocab_size  # blocks, final norm, output head
        return n + (d * self.vocab_size if embeddings and not self.tie_embeddings else 0)


_OPTION_DEFAULTS = {"tie_embeddings": False, "attn_bias": False, "qk_norm": False}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32 (as HF Llama does) so bf16/fp16 autocast stays stable.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cache(args: ModelArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each (max_seq_len, head_dim)."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    if args.rope_scaling:
        inv_freq = _llama3_scaled(inv_freq, args.rope_scaling)
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (as Meta's reference and HF's `_compute_llama3_parameters`): long
    wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor, low, high, old = (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                              s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def sdpa_enable_gqa(device_type: str) -> bool:
    """Whether grouped-query attention goes through SDPA's `enable_gqa` (k and v read in place at
    n_kv_heads) rather than an explicit repeat of k and v: on CPU and CUDA. The NPU keeps the repeat
    until torch_npu's SDPA is checked with enable_gqa; llmpipe.plan counts either way. (Here, not in
    llmpipe.device: this module imports nothing of llmpipe's.)"""
    return device_type in ("cpu", "cuda")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        bias = args.attn_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Qwen3: per-head RMSNorm of q and k over head_dim (one weight shared by every head), before RoPE
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        # Head counts come from the weights, so a tensor-parallel shard (fewer local heads) works.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd), (B, Hkv, T, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        B, _, T, _ = q.shape
        rep = q.shape[1] // k.shape[1]  # GQA: each kv head serves `rep` query heads
        # NOTE: without a mask (training, the full pass) SDPA's enable_gqa reads each kv head for its query
        # heads in place, as transformers' sdpa path does: repeating k and v first costs a copy forward and a
        # sum backward per layer, and autograd then keeps k and v at n_kv_heads (plan.py counts that).
        # Forward is bitwise the same; k/v gradients differ from the repeat's in summation order only.
        # Masked decoding (and the ONNX graphs exported from it) keeps the explicit repeat, the form the
        # ONNX/ATC converters were checked with; so does the NPU (sdpa_enable_gqa).
        gqa = rep > 1 and mask is None and sdpa_enable_gqa(q.device.type)
        if rep > 1 and not gqa:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, H, T, hd)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: None (causal), or a bool (B, 1, T, T) one, True where a query may attend (packed documents)."""
        return self._attend(*self._qkv(x, cos, sin), mask=mask)

    def forward_cached(self, x, cos, sin, mask, past: tuple[torch.Tensor, torch.Tensor] | None):
        """Attention over past keys/values plus this chunk; returns (out, (keys, values)) where the
        cache is (B, Hkv, past + T, hd), kept before the GQA repeat so it stays small."""
        q, k, v = self._qkv(x, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        return self._attend(q, k, v, mask), (k, v)


    def forward_static(self, x, cos, sin, cache_mask: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]):
        """Attention of a chunk over a fixed-size cache plus the chunk itself, without copying the
        cache: scores against the cache and against the chunk are computed apart and joined.

        x (B, C, d); cos/sin (B, 1, C, hd) at each token's position; cache_mask (B, 1, 1, L) bool,
        true where a cache slot holds an earlier token; cache keys/values (B, Hkv, L, hd).
        Returns (out (B, C, d), (k, v) of the chunk, each (B, Hkv, C, hd)).
        """
        B, C, _ = x.shape
        H, Hkv, hd = self.wq.weight.shape[0] // self.head_dim, self.wk.weight.shape[0] // self.head_dim, self.head_dim
        # NOTE: one projection for q, k and v (the exporter folds the weight concat into one initializer)
        # and one RoPE for q and k: fewer, larger ops per decode step.
        w = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])
        b = torch.cat([self.wq.bias, self.wk.bias, self.wv.bias]) if self.wq.bias is not None else None
        qkv = F.linear(x, w, b).view(B, C, H + 2 * Hkv, hd)  # (B, C, H + 2 Hkv, hd)
        qk = qkv[:, :, :H + Hkv]
        if self.q_norm is not None:  # the two norms' weights differ: normalise q's heads and k's apart
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, :, H + Hkv:].transpose(1, 2)  # (B, H, C, hd), (B, Hkv, C, hd) x2
        qg = q.reshape(B, Hkv, (H // Hkv) * C, hd) * hd ** -0.5
        old = qg @ cache[0].transpose(-1, -2)  # (B, Hkv, rep * C, L)
        new = qg @ k.transpose(-1, -2)  # (B, Hkv, rep * C, C)
        causal = torch.ones(C, C, dtype=torch.bool, device=x.device).tril().repeat(H // Hkv, 1)  # (rep * C, C)
        # NOTE: fp16's lowest value (not -inf): the same graph converted to fp16 must not overflow,
        # and no row is ever fully masked (a token always sees itself).
        low = torch.finfo(torch.float16).min
        scores = torch.cat([old.masked_fill(~cache_mask.reshape(B, 1, 1, -1), low),
                            new.masked_fill(~causal, low)], dim=-1)
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        L = cache[0].shape[2]
        out = p[..., :L] @ cache[1] + p[..., L:] @ v  # (B, Hkv, rep * C, hd)
        out = out.reshape(B, H, C, hd).transpose(1, 2).reshape(B, C, -1)
        return self.wo(out), (k, v)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The same, gate and up in one projection (for exported decoders: one matmul fewer)."""
        gate, up = F.linear(x, torch.cat([self.w1.weight, self.w3.weight])).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: the mask goes by keyword only when there is one, so tensor parallel's PrepareModuleInput
        # (positional layouts for x, cos, sin) and every wrapper see the unpacked call unchanged
        a = self.attention(self.attention_norm(x), cos, sin) if mask is None else \
            self.attention(self.attention_norm(x), cos, sin, mask=mask)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_cached(self, x, cos, sin, mask, past):
        a, present = self.attention.forward_cached(self.attention_norm(x), cos, sin, mask, past)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h)), present


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            # One Parameter under two modules: named_parameters() and optimizers see it once; the state dict
            # keeps it once too (under tok_embeddings.weight, as transformers' tied checkpoints do).
            self.output.weight = self.tok_embeddings.weight
            self._register_state_dict_hook(_drop_tied_head)
            self._register_load_state_dict_pre_hook(_fill_tied_head, with_module=True)
        cos, sin = rope_cache(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # NOTE: moving off the meta device (to_empty) makes new Parameters, one per module; the head is tied
        # again to the embedding's, as transformers' tie_weights does after loading.
        out = super()._apply(fn, recurse)
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None \
                and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return out

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, assign=None, source=None) -> None:
        """(Re)initialise every parameter and buffer in place; works after `to_empty` and on a
        pipeline stage (the layers it holds).

        With a seed, each parameter's *full* tensor is drawn on CPU from its own generator, seeded by
        (seed, parameter name), so every layout (one process, DDP, FSDP2, tp, pp) starts from bitwise
        the same weights and a rank only draws the parameters it holds. `assign(param, full)` copies
        a full tensor into a parameter (default: `param.copy_(full)`); sharded parameters pass one
        that copies the local shard (llmpipe.models.llama.parallelize.init_weights). `source(name)`,
        when given, supplies each full tensor instead of drawing it (pretrained weights, model.init_from).
        """
        cos, sin = rope_cache(self.args, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for name, p in self.named_parameters():
            clean = name.replace(_WRAPPED, "")
            full = source(clean) if source is not None else init_tensor(self.args, clean, tuple(p.shape), seed)
            (assign or _copy)(p, full)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab); pipeline stages pass hidden states (B, T, d).

        doc_ids (B, T) int64, for sequences packed with several documents (each a contiguous run of one
        id): a token attends only to earlier tokens of its own document (a block-causal mask) and its
        position restarts at 0 where its document starts, so each document is computed as if alone."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        T = h.shape[1]
        if doc_ids is None:
            cos, sin = self.rope_cos[:T].to(h.dtype), self.rope_sin[:T].to(h.dtype)
            mask = None
        else:
            positions, mask = document_positions_and_mask(doc_ids)
            cos = self.rope_cos[positions].to(h.dtype).unsqueeze(1)  # (B, 1, T, hd)
            sin = self.rope_sin[positions].to(h.dtype).unsqueeze(1)
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def forward_cached(self, tokens: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """Incremental decoding: tokens (B, T) continue a sequence whose keys/values per layer are
        `past` (each (B, Hkv, P, hd)); returns logits (B, T, vocab) and the extended caches.

        NOTE: SDPA's is_causal mask is top-left aligned, which is wrong once P > 0; the explicit mask
        lets query i (absolute position P + i) see keys 0 .. P + i (bottom-right aligned).
        """
        h = self.tok_embeddings(tokens)
        T = h.shape[1]
        P = past[0][0].shape[2] if past else 0
        cos, sin = self.rope_cos[P:P + T].to(h.dtype), self.rope_sin[P:P + T].to(h.dtype)
        q_pos = torch.arange(T, device=h.device) + P
        allowed = torch.arange(P + T, device=h.device)[None, :] <= q_pos[:, None]  # (T, P + T)
        # NOTE: an additive float mask built once, not a bool one: exported, a bool mask becomes a
        # Where over every layer's (B, H, T, P + T) scores plus a NaN guard; this is one Add per layer.
        # fp16's lowest value instead of -inf, so the graph converted to fp16 stays finite.
        mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill(
            ~allowed, torch.finfo(torch.float16).min)
        presents = []
        for i, layer in enumerate(self.layers.values()):
            h, kv = layer.forward_cached(h, cos, sin, mask, past[i] if past else None)
            presents.append(kv)
        return self.output(self.norm(h)), presents


    def forward_static(self, tokens: torch.Tensor, positions: torch.Tensor, cache_mask: torch.Tensor,
                       cache: list[tuple[torch.Tensor, torch.Tensor]]):
        """Decoding over a cache of fixed length L (what a static-shape compiler such as ATC needs):
        tokens and positions (B, C) int64, cache_mask (B, L) (non-zero: the slot holds an earlier
        token of the sequence), cache per layer (keys, values) each (B, Hkv, L, hd). The cache is only
        read; returns logits (B, C, vocab) and the chunk's keys/values per layer, (B, Hkv, C, hd) each,
        which the caller writes into the slots of `positions`."""
        h = self.tok_embeddings(tokens)
        cos = self.rope_cos[positions].to(h.dtype).unsqueeze(1)  # (B, 1, C, hd)
        sin = self.rope_sin[positions].to(h.dtype).unsqueeze(1)
        valid = cache_mask != 0  # (B, L)
        new = []
        for i, layer in enumerate(self.layers.values()):
            a, kv = layer.attention.forward_static(layer.attention_norm(h), cos, sin, valid, cache[i])
            h = h + a
            h = h + layer.feed_forward.forward_fused(layer.ffn_norm(h))
            new.append(kv)
        return self.output(self.norm(h)), new


def document_positions_and_mask(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed documents, doc_ids (B, T): each token's position within its document (B, T) int64, and
    the block-causal attention mask (B, 1, T, T) bool, True where query i may see key j (j <= i, same
    document). Every row holds at least its own token, so SDPA never meets a fully masked row."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # where each token's run began
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    return idx - first, mask.unsqueeze(1)


_WRAPPED = "_checkpoint_wrapped_module."  # the prefix activation checkpointing's wrapper adds


def init_tensor(args: ModelArgs, name: str, shape: tuple[int, ...], seed: int | None) -> torch.Tensor:
    """The initial value of parameter `name` (llmpipe naming), full size, fp32 on CPU: norms 1, biases 0,
    embeddings N(0, 1) (N(0, dim^-0.5) when tied to the head), the output head truncated N(0, dim^-0.5),
    other matrices truncated N(0, 0.02) with wo/w2 scaled by 1/sqrt(2 n_layers)."""
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    t = torch.empty(shape, dtype=torch.float32)
    if name.endswith(".bias"):
        return nn.init.zeros_(t)
    if len(shape) == 1:
        return nn.init.ones_(t)
    if name.startswith("tok_embeddings"):
        # tied, the embedding is also the head: the head's scale, or the first logits would be sqrt(dim) wide
        return nn.init.normal_(t, std=args.dim ** -0.5 if args.tie_embeddings else 1.0, generator=gen)
    if name.startswith("output"):
        s = args.dim ** -0.5
    else:
        s = 0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
    return nn.init.trunc_normal_(t, std=s, a=-3 * s, b=3 * s, generator=gen)


def _tied(model: Transformer) -> bool:
    """Whether this (whole or pipeline-cut) module holds both ends of a tied head as one Parameter."""
    return (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)


def _drop_tied_head(model, state_dict, prefix, local_metadata):
    if _tied(model):
        state_dict.pop(prefix + "output.weight", None)
    return state_dict


def _fill_tied_head(model, state_dict, prefix, *args):
    # A tied state dict has no output.weight: the head is loaded with the embedding it is.
    emb = prefix + "tok_embeddings.weight"
    if _tied(model) and emb in state_dict:
        state_dict.setdefault(prefix + "output.weight", state_dict[emb])


def _copy(param: torch.Tensor, full: torch.Tensor) -> None:
    param.copy_(full)
