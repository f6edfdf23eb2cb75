"""Continuous batching (iteration-level scheduling, as Orca and vLLM do): sequences join and leave a
running decode batch between steps, each at its own position.

StaticEngine keeps one position for the whole batch (every row started together). The static decoder
graph itself takes `position_ids` (B, 1) and `attention_mask` (B, L) per row, and only reads the
cache, so rows need not be in step: `SlotBatch` keeps a position per row, writes each row's new keys
and values into that row's own next slot, and masks each row's cache by itself. A new sequence is
prefilled (the newcomers of one step together: one prompt pass) and its cache copied into a free row; a finished one
leaves by moving the last row into its place, so the active rows are always 0..n-1 and a step runs
the decoder on n rows, not on every slot (with onnxruntime's I/O binding on the CPU, one binding per
n over views of the same arrays: nothing is copied per step). A model compiled for one batch size
(an OM decoder, convert_om.decode_batch) runs all its rows every step; the idle ones compute nothing
anyone reads.

`FusedSlots` does the same over the ORT-optimised graph (llmpipe.infer.fused): its attention takes each
row's length from a right-padded mask, so rows at different positions step together in one run.

`EngineSlots` is the fallback for an engine without per-row positions (TorchEngine: its cache grows
by torch.cat, one length for the batch): one engine per slot, stepped one after the other, so
sequences still join and leave between steps, but a step costs n batch-1 passes (no batching gain).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from llmpipe import device
from llmpipe.infer.decode import CapacityError, StaticEngine
from llmpipe.infer.graphs import decoder_names, static_inputs


class SlotBatch:
    """Up to `slots` sequences over one static cache (B = slots rows, or the compiled batch size), each at
    its own position."""

    def __init__(self, engine: StaticEngine, slots: int):
        self.engine, self.args, self.capacity = engine, engine.args, engine.capacity
        self.fixed = engine.batch  # a compiled batch size: every step runs all of its rows
        self.rows = engine.batch or slots  # rows of the cache arrays
        self.slots = min(slots, self.rows)  # sequences at once (at most the compiled batch)
        a, L = self.args, self.capacity
        self._names = static_inputs(a.n_layers)[3:]
        self._new = decoder_names(a.n_layers, "new")
        self._present = decoder_names(a.n_layers, "present")
        self.arrays = [np.zeros((self.rows, a.n_kv_heads, L, a.head_dim), np.float32) for _ in self._names]
        self.mask = np.zeros((self.rows, L), np.int64)  # 1 where a row's slot holds one of its tokens
        self.pos = np.zeros(self.rows, np.int64)  # each row's next position (= its tokens so far)
        self.n = 0  # active rows: 0..n-1
        dec = engine.decoder
        self._bind = isinstance(dec, ort.InferenceSession) and \
            dec.get_providers()[0] == device.ort_providers(["cpu"])[0].ort_name
        self._bindings: dict[int, ort.IOBinding] = {}

    def free(self) -> int:
        return self.slots - self.n

    def admit(self, prompts: list[list[int]]) -> np.ndarray:
        """Prefill `prompts` together (one pass, right-padded to the longest: padding comes after each
        prompt, so causal attention never shows it to the prompt) into rows n, n+1, ...; their last
        positions' logits (k, vocab). A model compiled for one batch size takes them one at a time."""
        if self.fixed:
            return np.concatenate([self._admit([p]) for p in prompts])
        return self._admit(prompts)

    def _admit(self, prompts: list[list[int]]) -> np.ndarray:
        k, lengths = len(prompts), [len(p) for p in prompts]
        if self.n + k > self.slots:
            raise RuntimeError(f"admit() of {k} with {self.free()} slots free")
        if max(lengths) >= self.capacity:
            raise CapacityError(f"prompt of {max(lengths)} tokens does not fit the decoder's cache of {self.capacity}")
        e = self.engine
        batch = np.zeros((k, max(lengths)), np.int64)
        for i, p in enumerate(prompts):
            batch[i, :len(p)] = p
        out = e._padded(batch)
        out = e.prefill.run(["logits", *self._present], {"input_ids": out})
        logits = np.empty((k, out[0].shape[-1]), np.float32)
        for i, T in enumerate(lengths):
            row = self.n
            for arr, present in zip(self.arrays, out[1:]):
                arr[row, :, :T] = present[i, :, :T]  # (Hkv, T, hd)
            self.mask[row] = 0
            self.mask[row, :T] = 1
            self.pos[row] = T
            logits[i] = out[0][i, T - 1]
            self.n += 1
        return logits

    def _binding(self, rows: int) -> ort.IOBinding:
        if rows not in self._bindings:
            b = self.engine.decoder.io_binding()
            # NOTE: views of the first `rows` rows (contiguous along axis 0): the OrtValues share the
            # arrays' memory, so writes into the cache are seen by the next run.
            for name, arr in zip(["attention_mask", *self._names], [self.mask, *self.arrays]):
                b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr[:rows]))
            for name in ["logits", *self._new]:
                b.bind_output(name)
            self._bindings[rows] = b
        return self._bindings[rows]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per active row (n,); the next logits (n, vocab)."""
        n = self.n
        if n == 0:
            raise RuntimeError("step() with no active row")
        if int(self.pos[:n].max()) >= self.capacity:
            raise CapacityError(f"the decoder's cache of {self.capacity} slots is full")
        rows = self.rows if self.fixed else n
        ids = np.zeros((rows, 1), np.int64)
        ids[:n, 0] = tokens
        positions = self.pos[:rows].reshape(rows, 1).copy()
        if self._bind:
            b = self._binding(rows)
            b.bind_cpu_input("input_ids", ids)
            b.bind_cpu_input("position_ids", positions)
            self.engine.decoder.run_with_iobinding(b)
            logits, *new = [v.numpy() for v in b.get_outputs()]
        else:
            feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": self.mask[:rows],
                     **{name: arr[:rows] for name, arr in zip(self._names, self.arrays)}}
            logits, *new = self.engine.decoder.run(["logits", *self._new], feeds)
        r, p = np.arange(n), self.pos[:n]
        for arr, kv in zip(self.arrays, new):
            arr[r, :, p] = kv[:n, :, 0]  # (n, Hkv, hd): each row's own next slot
        self.mask[r, p] = 1
        self.pos[:n] += 1
        return np.array(logits[:n, -1])  # (n, vocab); a copy: the bound output buffer is reused

    def release(self, row: int) -> int | None:
        """Free `row`; the last row moves into its place. Returns the moved row's old index, or None."""
        last = self.n - 1
        moved = None
        if row != last:
            for arr in self.arrays:
                arr[row] = arr[last]
            self.mask[row], self.pos[row] = self.mask[last], self.pos[last]
            moved = last
        self.mask[last], self.pos[last] = 0, 0
        self.n -= 1
        return moved


class EngineSlots:
    """Up to `slots` sequences, one engine each (made by `make()`), stepped in turn."""

    def __init__(self, make, slots: int, capacity: int):
        self.make, self.slots, self.capacity = make, slots, capacity
        self.engines: list = []
        self._idle: list = []

    @property
    def n(self) -> int:
        return len(self.engines)

    def free(self) -> int:
        return self.slots - self.n

    def admit(self, prompts: list[list[int]]) -> np.ndarray:
        if self.n + len(prompts) > self.slots:
            raise RuntimeError(f"admit() of {len(prompts)} with {self.free()} slots free")
        for ids in prompts:
            if len(ids) >= self.capacity:
                raise CapacityError(f"prompt of {len(ids)} tokens does not fit the model's context of "
                                    f"{self.capacity}")
        out = []
        for ids in prompts:
            engine = self._idle.pop() if self._idle else self.make()
            self.engines.append(engine)
            out.append(engine.start(np.array([ids], np.int64))[0])
        return np.stack(out)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return np.concatenate([e.step(np.array([t], np.int64)) for e, t in zip(self.engines, tokens)])

    def release(self, row: int) -> int | None:
        last = self.n - 1
        self._idle.append(self.engines[row])
        if row != last:
            self.engines[row] = self.engines.pop()
            return last
        self.engines.pop()
        return None


class FusedSlots:
    """Continuous batching over the ORT-optimised graph (llmpipe.infer.fused.FusedEngine's session): up to
    `slots` sequences, each at its own position, in one cache buffer per layer (slots, kv_heads, capacity,
    head_dim) that the graph reads and writes in place.

    The graph's GroupQueryAttention takes each row's length from the attention mask (seqlens_k = the row's
    ones - 1) and writes the row's new keys and values at that slot, with the rotary position it implies; a
    step's mask is right-padded (row r: its tokens and the new one, then zeros), so rows of any fill step
    together. A newcomer is prefilled alone into its row (the prompt pass on a batch-1 view of the buffer); a
    finished one leaves by moving the last row into its place, so the active rows are always 0..n-1 and a
    step runs n rows (views of the first n rows of each buffer, bound by address: nothing copied per step)."""

    def __init__(self, engine, slots: int):
        self.engine, self.session, self.capacity = engine, engine.session, engine.capacity
        self.slots = self.rows = slots
        e = engine
        self.buffers = [np.zeros((slots, e._kv_heads, self.capacity, e._head_dim), e._cache_type) for _ in e._past]
        self.pos = np.zeros(slots, np.int64)  # each row's tokens in the cache
        self.n = 0
        self._bindings: dict[int, ort.IOBinding] = {}

    def free(self) -> int:
        return self.slots - self.n

    def _bind(self, binding: ort.IOBinding, name: str, array: np.ndarray, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def _bound(self, start: int, rows: int, binding: ort.IOBinding | None = None) -> ort.IOBinding:
        """A binding whose caches are rows start..start+rows-1 of every buffer (contiguous views)."""
        binding = binding or self.session.io_binding()
        binding.bind_output("logits", "cpu")
        for past, present, buf in zip(self.engine._past, self.engine._present, self.buffers):
            view = buf[start:start + rows]
            self._bind(binding, past, view)
            self._bind(binding, present, view, output=True)
        return binding

    def admit(self, prompts: list[list[int]]) -> np.ndarray:
        """Prefill each prompt into rows n, n+1, ...; their last positions' logits (k, vocab)."""
        k = len(prompts)
        if self.n + k > self.slots:
            raise RuntimeError(f"admit() of {k} with {self.free()} slots free")
        longest = max(len(p) for p in prompts)
        if longest >= self.capacity:
            raise CapacityError(f"prompt of {longest} tokens does not fit the engine's cache of {self.capacity}")
        out = []
        for p in prompts:
            row, T = self.n, len(p)
            binding = self._bound(row, 1)
            ids = np.array([p], np.int64)
            self._bind(binding, "input_ids", ids)
            mask = np.ones((1, T), np.int64)
            self._bind(binding, "attention_mask", mask)
            if self.engine._positions:
                positions = np.arange(T, dtype=np.int64)[None]
                self._bind(binding, "position_ids", positions)
            self.session.run_with_iobinding(binding)
            out.append(np.asarray(binding.get_outputs()[0].numpy()[0, -1], dtype=np.float32))
            self.pos[row] = T
            self.n += 1
        return np.stack(out)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per active row (n,); the next logits (n, vocab)."""
        n = self.n
        if n == 0:
            raise RuntimeError("step() with no active row")
        if int(self.pos[:n].max()) >= self.capacity:
            raise CapacityError(f"the engine's cache of {self.capacity} slots is full")
        if n not in self._bindings:
            self._bindings[n] = self._bound(0, n)
        binding = self._bindings[n]
        ids = np.asarray(tokens, np.int64).reshape(n, 1)
        width = int(self.pos[:n].max()) + 1
        mask = (np.arange(width)[None, :] <= self.pos[:n, None]).astype(np.int64)  # each row: its tokens + the new
        logits = np.empty((n, 1, self.engine._vocab), self.engine._logits_type)
        self._bind(binding, "input_ids", ids)
        self._bind(binding, "attention_mask", mask)
        if self.engine._positions:
            positions = self.pos[:n].reshape(n, 1).copy()
            self._bind(binding, "position_ids", positions)
        self._bind(binding, "logits", logits, output=True)
        self.session.run_with_iobinding(binding)
        self.pos[:n] += 1
        return logits[:, 0].astype(np.float32)

    def release(self, row: int) -> int | None:
        """Free `row`; the last row moves into its place. Returns the moved row's old index, or None."""
        last = self.n - 1
        moved = None
        if row != last:
            filled = int(self.pos[last])
            for buf in self.buffers:
                buf[row, :, :filled] = buf[last, :, :filled]
            self.pos[row] = self.pos[last]
            moved = last
        self.pos[last] = 0
        self.n -= 1
        return moved
