"""FusedEngine: onnxruntime's own graph of the model, the one onnxruntime-genai's model builder writes.

The builder (`python -m onnxruntime_genai.models.builder`, run on consolidate's hf/ folder by
llmpipe.export.fused) writes one graph for the prompt and for each step, made of onnxruntime's fused
contrib ops: GroupQueryAttention (rotary embedding inside it, attention over each row's filled slots
only), SkipSimplifiedLayerNormalization (residual add + RMSNorm), MatMulNBits for its int4 precision.
Its inputs are `input_ids` (B, S), `attention_mask` (B, filled + S) int64, optionally `position_ids`
(B, S), and per layer `past_key_values.{i}.key/value`; its outputs `logits` (B, S or 1, vocab) and
`present.{i}.key/value`.

With `past_present_share_buffer` (genai_config.json; GroupQueryAttention graphs) the past and present
of a layer are one buffer: the engine allocates it with the slots the generation needs (`reserve`, which
decode.generate calls with prompt + new tokens; doubled if a step goes past them, up to `cache_len`), keeps
the two most recent shapes for reuse, and binds it as both input and output (I/O binding), so the graph
writes each step's keys/values into their slots in place, and GroupQueryAttention reads only the slots the
mask says are filled: per-token cost follows the tokens in the cache, not its capacity, and no step copies
the cache. On a CUDA session the buffers are OrtValues in the GPU's memory; ids, mask and logits stay on
the host. A graph without it (an older builder, or an attention op that concatenates) is refused.

The engine interface is decode.py's: `start(ids)` -> the last position's logits (B, vocab), `step(tokens)`
-> the next logits; `capacity` the tokens the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmpipe import device
from llmpipe.errors import UserError
from llmpipe.infer.decode import CapacityError

GENAI_CONFIG = "genai_config.json"
POOL = 2  # cache buffer sets kept for reuse (the most recent shapes): a repeated shape allocates nothing
_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
PAST, PRESENT = "past_key_values.", "present."


@dataclass(frozen=True)
class GraphConfig:
    """What the engine needs from the builder's genai_config.json."""

    kv_heads: int
    head_dim: int
    context: int  # the model's context length (RoPE tables end there)
    shared: bool  # past and present caches are one buffer

    @classmethod
    def read(cls, folder: Path) -> GraphConfig:
        """genai_config.json's few fields FusedEngine needs; GraphConfigError (one line) when it cannot say."""
        from llmpipe.manifest import read_json_file

        path = Path(folder) / GENAI_CONFIG
        config = read_json_file(path, GraphConfigError)
        try:
            decoder = config["model"]["decoder"]
            return cls(int(decoder["num_key_value_heads"]), int(decoder["head_size"]),
                       int(config["model"]["context_length"]), bool(config["search"].get("past_present_share_buffer")))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            raise GraphConfigError(f"{path}: invalid: {type(err).__name__}: {err}") from None


class GraphConfigError(UserError):
    """An ORT-optimised graph's genai_config.json that does not say what FusedEngine needs."""


def graph_problem(session: ort.InferenceSession, config: GraphConfig, args) -> str | None:
    """Why `session` is not the builder's graph of a model of `args` (ModelArgs) as FusedEngine drives it, or None."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    caches = [f"{PAST}{i}.{part}" for i in range(args.n_layers) for part in ("key", "value")]
    missing = [n for n in ["input_ids", "attention_mask", *caches] if n not in inputs]
    if missing:
        return f"no input {missing[0]!r}"
    extra = [n for n in inputs if n not in {"input_ids", "attention_mask", "position_ids", *caches}]
    if extra:
        return f"an unexpected input {extra[0]!r}"
    missing = [n for n in ["logits", *[PRESENT + c.removeprefix(PAST) for c in caches]] if n not in outputs]
    if missing:
        return f"no output {missing[0]!r}"
    vocab = outputs["logits"].shape[-1]
    if vocab != args.vocab_size:
        return f"output 'logits' has {vocab} on its last axis, expected {args.vocab_size}"
    if (config.kv_heads, config.head_dim) != (args.n_kv_heads, args.head_dim):
        return (f"genai_config.json says {config.kv_heads} kv heads of {config.head_dim}, expected "
                f"{args.n_kv_heads} of {args.head_dim}")
    return None


class FusedEngine:
    """Drives the builder's graph through a plain onnxruntime session (see the module docstring). Every
    row of a batch holds the same number of tokens (the prompts are as long as each other)."""

    def __init__(self, session: ort.InferenceSession, config: GraphConfig, cache_len: int):
        if not config.shared:
            raise ValueError("the graph's past and present caches are not one buffer (genai_config.json: "
                             "past_present_share_buffer false); FusedEngine binds one buffer as both")
        self.session, self.capacity = session, min(cache_len, config.context)
        inputs = {i.name: i for i in session.get_inputs()}
        self._past = [n for n in inputs if n.startswith(PAST)]
        # the cache's and the logits' element types (fp32 on the CPU; a CUDA build of the graph is fp16)
        self._cache_type = _NUMPY.get(inputs[self._past[0]].type, np.float32)
        self._logits_type = _NUMPY.get(session.get_outputs()[0].type, np.float32)
        # where the caches live: the CPU (numpy arrays bound by address) or the GPU of a CUDA session (OrtValues in
        # its memory, never copied to the host); the step's small inputs and the logits stay on the host
        self._device = device.ort_memory(session)
        self._present = [PRESENT + n.removeprefix(PAST) for n in self._past]
        self._positions = "position_ids" in inputs
        self._kv_heads, self._head_dim = config.kv_heads, config.head_dim
        self._vocab = int(session.get_outputs()[0].shape[-1])
        self._now: _State | None = None
        self._pool: dict[tuple[int, int], _State] = {}  # (batch, slots) -> its buffers, the newest last
        self._room: int | None = None  # reserve(): the slots the next generation needs
        self.pos = 0

    def reserve(self, tokens: int) -> None:
        """The next start() is followed by steps up to `tokens` in the cache (prompt + new tokens - 1):
        its buffers get that many slots (a step past them doubles them, up to `capacity`). Attention costs
        a little per slot of the buffer, filled or not, so a buffer sized to the work decodes faster than
        one of the whole capacity (~6% at 192 vs 1024 slots on the small flavor)."""
        self._room = max(1, min(int(tokens), self.capacity))

    def _allocate(self, batch: int, slots: int, keep: int = 0) -> None:
        """Per layer one cache buffer (B, kv_heads, slots, head_dim) bound as the past input and the present
        output (written in place), the first `keep` slots of the current buffers copied in; the step's
        arrays bound by address."""
        old = self._now
        if not keep and (batch, slots) in self._pool:  # a generation of this shape before: its memory again
            self._now = self._pool.pop((batch, slots))
            self._pool[(batch, slots)] = self._now
            return
        shape = (batch, self._kv_heads, slots, self._head_dim)
        if self._device == "cpu":
            buffers = [np.zeros(shape, self._cache_type) for _ in self._past]  # calloc: pages appear when written
            if keep:
                for new, prev in zip(buffers, old.buffers):
                    new[:, :, :keep] = prev[:, :, :keep]
        else:
            buffers = [self._device_buffer(shape, None if not keep else prev, keep)
                       for prev in (old.buffers if keep else self._past)]
        same = old is not None and old.ids.shape[0] == batch
        self._now = state = _State(self.session.io_binding(), old.ids if same else np.zeros((batch, 1), np.int64),
                                   old.positions if same else np.zeros((batch, 1), np.int64),
                                   np.ones(batch * self.capacity, np.int64),
                                   old.logits if same else np.zeros((batch, 1, self._vocab), self._logits_type),
                                   buffers)
        self._pool[(batch, slots)] = state
        while len(self._pool) > POOL:
            self._pool.pop(next(iter(self._pool)))
        state.binding.bind_output("logits", "cpu")  # first: get_outputs() lists outputs in the order they were bound
        for past, present, buf in zip(self._past, self._present, buffers):
            if self._device == "cpu":
                self._bind_array(past, buf)
                self._bind_array(present, buf, output=True)  # the same memory: written in place
            else:
                state.binding.bind_ortvalue_input(past, buf)
                state.binding.bind_ortvalue_output(present, buf)

    def _device_buffer(self, shape: tuple[int, ...], prev, keep: int):
        """A cache buffer in the GPU's memory; `keep` > 0: the first `keep` slots of `prev` copied in (through
        the host: only when a generation outgrows what reserve() asked for)."""
        host = np.zeros(shape, self._cache_type)
        if keep:
            host[:, :, :keep] = prev.numpy()[:, :, :keep]
        return ort.OrtValue.ortvalue_from_numpy(host, self._device, 0)

    def _bind_array(self, name: str, array: np.ndarray, output: bool = False) -> None:
        """Bind `array` by address (no copy, no OrtValue): onnxruntime reads or writes it in place."""
        bind = self._now.binding.bind_output if output else self._now.binding.bind_input
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def _mask(self, width: int) -> None:
        # NOTE: every slot of every row is filled, so the first B * width of a flat buffer of ones is the
        # (B, width) mask, contiguous: bound by address, nothing written per step.
        B = self._now.ids.shape[0]
        self._bind_array("attention_mask", self._now.ones[:B * width].reshape(B, width))

    def start(self, ids: np.ndarray) -> np.ndarray:
        if ids.shape[1] >= self.capacity:
            raise CapacityError(f"prompt of {ids.shape[1]} tokens does not fit the engine's cache of {self.capacity}")
        return self.prompt(ids)[:, -1]  # (B, vocab)

    def prompt(self, ids: np.ndarray) -> np.ndarray:
        """The prompt pass of `ids` (B, T): the logits of every position (B, T, vocab), a fresh array; the
        cache then holds the prompt and step() goes on from it. What the quality gates score."""
        B, T = ids.shape
        if T > self.capacity:
            raise CapacityError(f"prompt of {T} tokens does not fit the engine's cache of {self.capacity}")
        room, self._room = self._room, None
        self._allocate(B, max(T, min(room or T + 1, self.capacity)))
        self.pos = 0
        binding = self._now.binding
        prompt = np.ascontiguousarray(ids, dtype=np.int64)
        self._bind_array("input_ids", prompt)
        if self._positions:
            positions = np.tile(np.arange(T, dtype=np.int64), (B, 1))
            self._bind_array("position_ids", positions)
        self._mask(T)
        binding.bind_output("logits", "cpu")  # (B, T, vocab): onnxruntime allocates it
        self.session.run_with_iobinding(binding)
        # (B, T, vocab) fp32: ours, not the binding's memory
        logits = np.array(binding.get_outputs()[0].numpy(), dtype=np.float32)
        # the steps' arrays: bound once here, rewritten in place by each step
        self._bind_array("input_ids", self._now.ids)
        if self._positions:
            self._bind_array("position_ids", self._now.positions)
        self._bind_array("logits", self._now.logits, output=True)
        self.pos = T
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        state = self._now
        if state is None:
            raise RuntimeError("step() before start()")
        if self.pos >= self.capacity:
            raise CapacityError(f"the engine's cache of {self.capacity} slots is full")
        slots = _slots(state.buffers[0])
        if self.pos >= slots:  # past the reserved slots: twice as many, what is there copied over
            self._allocate(state.ids.shape[0], min(self.capacity, 2 * slots), keep=self.pos)
            state = self._now
            self._bind_array("input_ids", state.ids)
            if self._positions:
                self._bind_array("position_ids", state.positions)
            self._bind_array("logits", state.logits, output=True)
        state.ids[:, 0] = tokens.reshape(-1)
        if self._positions:
            state.positions[:] = self.pos
        if self._device != "cpu":  # a host input bound to a GPU session is copied when bound: bound again
            self._bind_array("input_ids", state.ids)
            if self._positions:
                self._bind_array("position_ids", state.positions)
        self._mask(self.pos + 1)
        self.session.run_with_iobinding(state.binding)
        self.pos += 1
        return state.logits[:, 0].astype(np.float32)  # (B, vocab), a copy: the buffer is the next step's output


def _slots(buffer) -> int:
    """Slots of a cache buffer (a numpy array or an OrtValue)."""
    return int(buffer.shape[2] if isinstance(buffer, np.ndarray) else buffer.shape()[2])


@dataclass
class _State:
    binding: ort.IOBinding
    ids: np.ndarray  # (B, 1) the step's tokens
    positions: np.ndarray  # (B, 1)
    ones: np.ndarray  # (B * cache_len,) the masks' memory
    logits: np.ndarray  # (B, 1, vocab) the step's output
    # per layer key, value: (B, kv_heads, slots, head_dim), numpy arrays bound by address on the CPU, OrtValues in
    # the GPU's memory for a CUDA session
    buffers: list
