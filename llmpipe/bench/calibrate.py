"""Calibration data of the static int8 variant (int8s): what each graph is fed, on validation text.

The prefill graph is calibrated on a seeded sample of validation windows (benchmark.quantize.
calibration_samples windows of calibration_seq_len tokens). The static decoder is calibrated on what
it is fed while decoding those windows: the fp32 prefill fills the cache with the first half of each
window, then the fp32 decoder is stepped through the next calibration_decode_steps tokens of the
text (teacher forcing), and each step's inputs (token, position, mask, the whole cache) are one
calibration batch. The readers produce their batches one at a time, so memory holds one decoder
feed (rows x layers x 2 x cache slots), not all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from llmpipe.bench import quality
from llmpipe.data.shards import TokenShard
from llmpipe.infer.decode import StaticEngine
from llmpipe.infer.ort import create_session
from llmpipe.models.llama.model import ModelArgs
from llmpipe.stages import StageError

PREFILL_ROWS = 4  # validation windows per prefill calibration batch
DECODE_ROWS = 8  # windows decoded together (one decoder calibration batch per step)


def windows(val_bin: Path, n: int, seq_len: int, seed: int) -> np.ndarray:
    """(n, seq_len) int64 calibration windows, or StageError naming the field when the validation
    shard holds fewer than n (checked before any variant is made)."""
    available = TokenShard(val_bin).num_samples(seq_len - 1)
    if n > available:
        raise StageError(f"benchmark.quantize.calibration_samples={n} exceeds the {available} windows of {seq_len} "
                         f"tokens the validation shard {val_bin} holds; lower it (or calibration_seq_len)")
    return quality.val_sample(val_bin, n, seq_len, seed)


class StreamReader:
    """onnxruntime's CalibrationDataReader over a generator of feed dicts, made again on rewind."""

    def __init__(self, make: Callable[[], Iterator[dict[str, np.ndarray]]]):
        self._make = make
        self._it = make()

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = self._make()


def prefill_reader(ids: np.ndarray) -> StreamReader:
    """The prefill graph's calibration: the windows, PREFILL_ROWS at a time."""
    return StreamReader(lambda: ({"input_ids": ids[i:i + PREFILL_ROWS]} for i in range(0, len(ids), PREFILL_ROWS)))


class _Recorder:
    """A decoder session that keeps a copy of the feeds of its last run (StaticEngine feeds a non-ORT
    session by name, without I/O binding)."""

    def __init__(self, session):
        self.session, self.last = session, None

    def run(self, names, feeds):
        self.last = {k: np.array(v) for k, v in feeds.items()}
        return self.session.run(names, feeds)


def decoder_reader(prefill: Path, decoder: Path, args: ModelArgs, cache_len: int, ids: np.ndarray, steps: int,
                   provider, threads: int) -> StreamReader:
    """The static decoder's calibration: the fp32 graphs decode each window's text after its first
    half (teacher forcing), `steps` tokens, DECODE_ROWS windows at a time; one feed per step."""
    T = ids.shape[1]
    prompt = max(1, min(T // 2, cache_len - steps - 1, T - steps))
    steps = max(1, min(steps, T - prompt))

    def feeds() -> Iterator[dict[str, np.ndarray]]:
        recorder = _Recorder(create_session(decoder, provider, threads))
        engine = StaticEngine(create_session(prefill, provider, threads), recorder, args, cache_len)
        for i in range(0, len(ids), DECODE_ROWS):
            rows = ids[i:i + DECODE_ROWS]
            engine.start(rows[:, :prompt])
            for j in range(steps):
                engine.step(rows[:, prompt + j])
                yield recorder.last

    return StreamReader(feeds)
