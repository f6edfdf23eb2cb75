"""Token-by-token decoding with a KV cache: PyTorch eager, onnxruntime, and OM models (ais_bench).

An engine holds one batch's cache. `start(ids)` runs the prompt (batch, T) and returns the last
position's logits (batch, vocab); `step(tokens)` feeds one new token per row and returns the next
logits. `generate` drives an engine and times it:

    time to first token (TTFT)   from the call to the first new token picked: the prompt pass
                                 plus picking one token
    time per output token (TPOT) the mean time of each later token: (end - first token) / (n - 1)
    decode tokens/s              batch * (n - 1) / (end - first token): the first token excluded
    end-to-end tokens/s          batch * n / (end - start)

Engines:
- TorchEngine: Transformer.forward_cached, the cache grows by torch.cat (the eager baseline).
- StaticEngine: export_onnx's prefill graph (model.onnx, which also returns the prompt's cache) and
  decoder_static.onnx (a fixed-size cache it only reads). The cache is a set of numpy arrays the
  engine owns; each step writes one token's keys/values into its slot. With onnxruntime on the CPU
  the arrays are bound once through I/O binding (the OrtValues share their memory), so no step
  copies the cache. On other providers, and for OM models, each call passes the cache (a host to
  device copy per call; a device-resident cache is future work). Every step reads the whole cache.
- GrowingEngine: the same over decoder_ort.onnx, whose cache length is dynamic (onnxruntime only): the
  cache holds a power-of-two bucket of slots that doubles as it fills, so a step reads what the cache
  holds (at most twice that), not its capacity.

`graph_contract` is what StaticEngine feeds and reads (names, types, fixed sizes); `graph_problem`
says how a loaded graph differs from it, so a foreign graph is refused before it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
import torch

from llmpipe import device
from llmpipe.errors import UserError
from llmpipe.infer.graphs import decoder_names, static_inputs
from llmpipe.models.llama.model import ModelArgs, Transformer


class CapacityError(UserError, ValueError):
    """The prompt plus the tokens asked for do not fit the engine's cache or the model's context."""


class TorchEngine:
    """PyTorch eager with its KV cache (Transformer.forward_cached): the baseline."""

    def __init__(self, model: Transformer, dev: torch.device | str = "cpu"):
        self.model, self.dev = model.eval(), torch.device(dev)
        self.capacity = model.args.max_seq_len
        self.past = None

    def _logits(self, ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            logits, self.past = self.model.forward_cached(torch.from_numpy(ids).to(self.dev), self.past)
            out = logits[:, -1].float().cpu().numpy()  # (B, vocab)
        device.synchronize(self.dev)
        return out

    def start(self, ids: np.ndarray) -> np.ndarray:
        self.past = None
        return self._logits(ids)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self._logits(tokens.reshape(-1, 1))


@dataclass
class _Cache:
    """One batch's fixed-size cache: per layer keys and values (B, Hkv, L, hd), and the slot mask."""

    arrays: list[np.ndarray]  # cache.0.key, cache.0.value, cache.1.key, ...
    mask: np.ndarray  # (B, L) int64, 1 where a slot holds a token
    binding: ort.IOBinding | None = None
    pos: int = 0  # slots in use (the same for every row)


class StaticEngine:
    """Prefill graph + static-cache decoder; `prefill` and `decoder` are onnxruntime sessions or
    objects with the same `run(output_names, feeds)` (llmpipe.infer.ais.OmSession).

    `prefill_lens`: the sequence lengths the prefill model accepts (an OM compiled with gears);
    a prompt is padded on the right to the smallest that fits (padding is causal-invisible to the
    prompt, and its cache slots stay masked). `batch`: the only batch size the models take, if fixed.
    """

    def __init__(self, prefill, decoder, args: ModelArgs, cache_len: int,
                 prefill_lens: Sequence[int] | None = None, batch: int | None = None):
        self.prefill, self.decoder, self.args = prefill, decoder, args
        self.capacity, self.prefill_lens, self.batch = cache_len, sorted(prefill_lens or []), batch
        self.cache: _Cache | None = None
        self._names = static_inputs(args.n_layers)[3:]
        self._new = decoder_names(args.n_layers, "new")
        self._present = decoder_names(args.n_layers, "present")
        self._bind = isinstance(decoder, ort.InferenceSession) and \
            decoder.get_providers()[0] == device.ort_providers(["cpu"])[0].ort_name

    def _slots(self, needed: int) -> int:
        """How many cache slots the decoder is fed when `needed` are in use: all of them (a static graph)."""
        return self.capacity

    def _allocate(self, batch: int, slots: int) -> _Cache:
        if self.cache is not None and self.cache.mask.shape == (batch, slots):
            self.cache.mask[:] = 0
            self.cache.pos = 0
            return self.cache  # NOTE: stale slots are masked out, never read
        a = self.args
        arrays = [np.zeros((batch, a.n_kv_heads, slots, a.head_dim), np.float32) for _ in self._names]
        self.cache = self._bound(_Cache(arrays, np.zeros((batch, slots), np.int64)))
        return self.cache

    def _bound(self, cache: _Cache) -> _Cache:
        """`cache` with its arrays bound to the decoder's inputs (onnxruntime on the CPU)."""
        if self._bind:
            cache.binding = self.decoder.io_binding()
            # NOTE: OrtValues over numpy memory (CPU): writing a slot in the array is seen by the
            # next run; nothing is copied per step.
            for name, arr in zip(["attention_mask", *self._names], [cache.mask, *cache.arrays]):
                cache.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
            for name in ["logits", *self._new]:
                cache.binding.bind_output(name)
        return cache

    def _grow(self, slots: int) -> _Cache:
        """The cache moved into arrays of `slots` slots (GrowingEngine's next bucket)."""
        old = self.cache
        B, n = old.mask.shape
        grown = self._allocate(B, slots)
        grown.pos = old.pos
        for dst, src in zip(grown.arrays, old.arrays):
            dst[:, :, :n] = src
        grown.mask[:, :n] = old.mask
        self.cache = grown
        return grown

    def _padded(self, ids: np.ndarray) -> np.ndarray:
        if not self.prefill_lens:
            return ids
        T = ids.shape[1]
        fits = [n for n in self.prefill_lens if n >= T]
        if not fits:
            raise CapacityError(f"prompt of {T} tokens is longer than the prefill model's largest shape "
                                f"{self.prefill_lens[-1]}")
        return np.pad(ids, ((0, 0), (0, fits[0] - T)))

    def start(self, ids: np.ndarray) -> np.ndarray:
        B, T = ids.shape
        if self.batch is not None and B != self.batch:
            raise CapacityError(f"the models were compiled for batch {self.batch}, not {B}")
        if T >= self.capacity:
            raise CapacityError(f"prompt of {T} tokens does not fit the decoder's cache of {self.capacity}")
        cache = self._allocate(B, self._slots(T + 1))
        out = self.prefill.run(["logits", *self._present], {"input_ids": self._padded(ids)})
        for arr, present in zip(cache.arrays, out[1:]):
            arr[:, :, :T] = present[:, :, :T]  # (B, Hkv, T, hd)
        cache.mask[:, :T] = 1
        cache.pos = T
        return np.ascontiguousarray(out[0][:, T - 1])  # (B, vocab)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        cache = self.cache
        if cache is None:
            raise RuntimeError("step() before start()")
        if cache.pos >= self.capacity:
            raise CapacityError(f"the decoder's cache of {self.capacity} slots is full")
        B, slots = cache.mask.shape
        if cache.pos >= slots:  # GrowingEngine: the bucket is full, the next one holds this token too
            cache = self._grow(self._slots(cache.pos + 1))
        ids = tokens.reshape(B, 1).astype(np.int64)
        positions = np.full((B, 1), cache.pos, np.int64)
        if cache.binding is not None:
            cache.binding.bind_cpu_input("input_ids", ids)
            cache.binding.bind_cpu_input("position_ids", positions)
            self.decoder.run_with_iobinding(cache.binding)
            logits, *new = [v.numpy() for v in cache.binding.get_outputs()]
        else:
            feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": cache.mask,
                     **dict(zip(self._names, cache.arrays))}
            logits, *new = self.decoder.run(["logits", *self._new], feeds)
        for arr, kv in zip(cache.arrays, new):
            arr[:, :, cache.pos] = kv[:, :, 0]  # (B, Hkv, hd): one slot
        cache.mask[:, cache.pos] = 1
        cache.pos += 1
        # NOTE: a copy: with I/O binding the output buffer may be reused by the next run.
        return np.array(logits[:, -1])  # (B, vocab)


class GrowingEngine(StaticEngine):
    """StaticEngine over decoder_ort.onnx (export_onnx's decoder with the cache length dynamic, for
    onnxruntime only): its cache holds a bucket of slots, `min_bucket` doubled until the tokens fit (at most
    `cache_len`), and moves into the next bucket when full (a copy of what it holds, log2(cache_len /
    min_bucket) times per generation at most). Each step's attention then reads the bucket, between the
    filled slots and twice them, not the whole capacity: per-token time follows the tokens in the cache.
    Each bucket's arrays are kept for the next generation of the same batch (at most twice the capacity in
    all) and, on the CPU, bound once, as StaticEngine binds its one cache."""

    def __init__(self, prefill, decoder, args: ModelArgs, cache_len: int, min_bucket: int = 64):
        super().__init__(prefill, decoder, args, cache_len)
        self.min_bucket = min_bucket
        self._pool: dict[tuple[int, int], _Cache] = {}  # (batch, slots) -> that bucket's arrays, bound once

    def _allocate(self, batch: int, slots: int) -> _Cache:
        self.cache = self._pool.get((batch, slots))
        self._pool[batch, slots] = super()._allocate(batch, slots)  # reset (mask 0, pos 0) or made and bound
        return self.cache

    def _slots(self, needed: int) -> int:
        slots = self.min_bucket
        while slots < needed:
            slots *= 2
        return min(slots, self.capacity)


# --------------------------------------------------------------------------- the graphs' contract


@dataclass(frozen=True)
class Tensor:
    """A graph input or output as StaticEngine uses it: onnxruntime's type and the size of each axis
    (None: any size)."""

    type: str
    dims: tuple[int | None, ...]


def graph_contract(kind: str, args: ModelArgs, cache_len: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(inputs, outputs) of export_onnx's `kind` graph, "prefill" (model.onnx), "decoder"
    (decoder_static.onnx) or "decoder_ort" (decoder_ort.onnx: the cache length dynamic), for a model of
    `args` with a cache of `cache_len` slots: what StaticEngine (GrowingEngine) feeds and reads (names from
    llmpipe.export.onnx)."""
    ids = Tensor("tensor(int64)", (None, None))  # (B, T)
    logits = Tensor("tensor(float)", (None, None, args.vocab_size))  # (B, T, vocab)
    kv = Tensor("tensor(float)", (None, args.n_kv_heads, None, args.head_dim))  # (B, Hkv, T, hd)
    if kind == "prefill":
        return {"input_ids": ids}, {"logits": logits, **dict.fromkeys(decoder_names(args.n_layers, "present"), kv)}
    slots = None if kind == "decoder_ort" else cache_len  # decoder_ort.onnx: any number of slots
    mask = Tensor("tensor(int64)", (None, slots))  # (B, L)
    cache = Tensor("tensor(float)", (None, args.n_kv_heads, slots, args.head_dim))  # (B, Hkv, L, hd)
    names = static_inputs(args.n_layers)
    inputs = dict(zip(names, [ids, ids, mask, *[cache] * (len(names) - 3)]))
    return inputs, {"logits": logits, **dict.fromkeys(decoder_names(args.n_layers, "new"), kv)}


def _first(what: str, names: list[str]) -> list[str]:
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return [f"{what} {names[0]!r}{more}"] if names else []


def _tensor_problem(where: str, want: Tensor, have) -> str | None:
    shape = list(have.shape or [])
    if have.type != want.type or len(shape) != len(want.dims):
        return f"{where} is {have.type} of rank {len(shape)}, expected {want.type} of rank {len(want.dims)}"
    for axis, (size, fixed) in enumerate(zip(shape, want.dims)):
        if isinstance(size, int) and fixed is not None and size != fixed:  # a named (dynamic) axis fits any size
            return f"{where} has {size} on axis {axis}, expected {fixed}"
    return None


def graph_problem(session, kind: str, args: ModelArgs, cache_len: int) -> str | None:
    """Why `session` is not the `kind` graph of `graph_contract` (its first difference), or None.
    An onnxruntime session is checked by name, type, rank and fixed sizes; an OM session by name."""
    inputs, outputs = graph_contract(kind, args, cache_len)
    if isinstance(session, ort.InferenceSession):
        have_in = {a.name: a for a in session.get_inputs()}
        have_out = {a.name: a for a in session.get_outputs()}
    else:  # llmpipe.infer.ais.OmSession
        have_in, have_out = dict.fromkeys(session.input_names), dict.fromkeys(session.output_names)
    problems = [*_first("no input", [n for n in inputs if n not in have_in]),
                *_first("an unexpected input", [n for n in have_in if n not in inputs]),
                *_first("no output", [n for n in outputs if n not in have_out])]
    if problems:
        return ", ".join(problems)
    for role, wanted, have in (("input", inputs, have_in), ("output", outputs, have_out)):
        for name, want in wanted.items():
            problem = have[name] is not None and _tensor_problem(f"{role} {name!r}", want, have[name])
            if problem:
                return problem
    return None


# --------------------------------------------------------------------------- picking tokens


def pick_tokens(logits: np.ndarray, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, rng: np.random.Generator | None = None) -> np.ndarray:
    """Next token per row from logits (B, vocab): greedy (argmax) at temperature 0, else a draw
    from softmax(logits / temperature) restricted to the top_k tokens and to the smallest set whose
    probability reaches top_p (nucleus)."""
    if temperature <= 0:
        return logits.argmax(axis=-1).astype(np.int64)
    rng = rng or np.random.default_rng()
    z = logits.astype(np.float64)
    # NOTE: the max subtracted before dividing: a tiny temperature then sends the others to -inf,
    # never to +inf (which would make inf - inf = NaN probabilities below)
    with np.errstate(over="ignore"):
        z = (z - z.max(axis=-1, keepdims=True)) / temperature
    if top_k is not None and 0 < top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        # keep a token while the mass before it is below top_p (the first token always stays)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p], dtype=np.int64)


# --------------------------------------------------------------------------- the loop


@dataclass
class Generation:
    """New tokens (B, n) and the times of one `generate` call (seconds, perf_counter)."""

    tokens: np.ndarray
    prompt_tokens: int
    prefill_s: float
    ttft_s: float
    total_s: float
    step_s: list[float] = field(default_factory=list)  # each token after the first

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for a single token)."""
        n = self.tokens.shape[1]
        return (self.total_s - self.ttft_s) / (n - 1) if n > 1 else None

    def decode_tokens_per_s(self) -> float | None:
        n = self.tokens.shape[1]
        spent = self.total_s - self.ttft_s
        return self.batch * (n - 1) / spent if n > 1 and spent > 0 else None

    def e2e_tokens_per_s(self) -> float:
        return self.batch * self.tokens.shape[1] / self.total_s


def generate(engine, ids: np.ndarray, max_new_tokens: int,
             pick: Callable[[np.ndarray], np.ndarray] = pick_tokens,
             on_tokens: Callable[[np.ndarray], None] | None = None, stop_id: int | Collection[int] | None = None,
             stop: Callable[[], bool] | None = None) -> Generation:
    """Continue the prompt `ids` (B, T) by up to `max_new_tokens` tokens per row. `on_tokens` sees
    each step's tokens (B,) as they are picked (streaming). With `stop_id` (one id or several: eos and a
    chat template's end-of-turn tokens), a batch of one stops after such a token; `stop`, asked after
    each step (after `on_tokens`), ends it too (a stop string seen in the text)."""
    stops = {stop_id} if isinstance(stop_id, int) else set(stop_id or ())
    B, T = ids.shape
    if T + max_new_tokens > engine.capacity + 1:  # the last token is picked, never fed back
        raise CapacityError(f"prompt of {T} tokens + {max_new_tokens} new tokens exceeds the context of "
                            f"{engine.capacity} tokens")
    if hasattr(engine, "reserve"):  # an engine whose cache is sized to the work (FusedEngine)
        engine.reserve(T + max_new_tokens - 1)
    out = []
    t0 = time.perf_counter()
    logits = engine.start(ids)
    prefill_s = time.perf_counter() - t0
    token = pick(logits)
    ttft = time.perf_counter() - t0
    steps, last = [], t0 + ttft
    while True:
        out.append(token)
        if on_tokens is not None:
            on_tokens(token)
        if len(out) == max_new_tokens or (B == 1 and int(token[0]) in stops) or (stop is not None and stop()):
            break
        token = pick(engine.step(token))
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    total = time.perf_counter() - t0
    return Generation(np.stack(out, axis=1), T, prefill_s, ttft, total, steps)


def greedy_reference(model: Transformer, ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation by PyTorch with a KV cache (Transformer.forward_cached: the prompt once, then
    one token per step over the cache, O(1) passes per token instead of re-running the whole sequence):
    tokens (B, n) and each step's logits (B, n, vocab)."""
    logits = []
    tokens = []
    with torch.inference_mode():
        out, past = model.forward_cached(torch.from_numpy(ids))
        for i in range(n):
            last = out[:, -1].float()  # (B, vocab)
            logits.append(last.numpy())
            tokens.append(last.argmax(-1, keepdim=True))
            if i < n - 1:
                out, past = model.forward_cached(tokens[-1], past)
    return torch.cat(tokens, dim=1).numpy(), np.stack(logits, axis=1)
