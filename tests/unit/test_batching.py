"""Continuous batching (llmpipe.infer.batching): sequences that join and leave a running batch between
steps, each at its own position, pick the same greedy tokens as each decoded alone with StaticEngine,
whichever row they end up in when another leaves; the torch fallback (one engine per slot) likewise."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest

from llmpipe.export import onnx as export
from llmpipe.infer.batching import EngineSlots, SlotBatch
from llmpipe.infer.decode import CapacityError, StaticEngine, TorchEngine, generate
from llmpipe.models.llama import FLAVORS, Transformer

CACHE = 48
ARGS = replace(FLAVORS["debug"], vocab_size=97, max_seq_len=64)
PROMPTS = [[5, 9, 2, 44, 7, 1, 3], [11, 12], [60, 2, 2, 8, 90]]
NEW = 12


@pytest.fixture(scope="module")
def model_and_graphs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batching")
    model = Transformer(ARGS)
    model.init_weights(seed=3)
    model.eval()
    export.export_prefill(model, folder / "model.onnx", opset=17)
    export.export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=CACHE)
    sessions = [ort.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])
                for name in ("model.onnx", "decoder_static.onnx")]
    return model, sessions


def _alone(engine) -> list[list[int]]:
    pick = lambda logits: logits.argmax(-1)
    return [generate(engine, np.array([p]), NEW, pick).tokens[0].tolist() for p in PROMPTS]


def _interleaved(slots) -> list[list[int]]:
    """A joins; two steps later B and C join together; B leaves early (C moves into its row) and joins again
    as a fresh sequence once A has finished."""
    out: dict[int, list[int]] = {}
    rows: list[int] = []  # which prompt each active row decodes

    def admit(*which: int) -> None:
        for i, logits in zip(which, slots.admit([PROMPTS[i] for i in which])):
            out[i] = [int(logits.argmax())]
            rows.append(i)

    def release(i: int) -> None:
        row = rows.index(i)
        moved = slots.release(row)
        last = rows.pop()
        if moved is not None:
            rows[row] = last

    def step() -> None:
        logits = slots.step(np.array([out[i][-1] for i in rows]))
        for i, row in zip(rows, logits):
            out[i].append(int(row.argmax()))
        for i in [i for i in rows if len(out[i]) == NEW]:
            release(i)

    admit(0)
    step(), step()
    admit(1, 2)  # together: one prefill pass, padded to the longer
    step(), step()
    early = out.pop(1)
    release(1)
    while 0 in rows:
        step()
    admit(1)
    while rows:
        step()
    assert early == out[1][:len(early)]
    return [out[0], out[1], out[2]]


@pytest.mark.parametrize("how", ["io binding", "feeds", "compiled batch"])
def test_sequences_joining_and_leaving_the_static_batch_pick_their_tokens_alone(model_and_graphs, how):
    """io binding: onnxruntime on the CPU; feeds: the cache passed each call (other providers, OM);
    compiled batch: a decoder of one batch size (an OM decode_batch, here 4 for 3 sequences), every row run
    each step."""
    model, (prefill, decoder) = model_and_graphs
    alone = _alone(StaticEngine(prefill, decoder, ARGS, CACHE))
    batch = SlotBatch(StaticEngine(prefill, decoder, ARGS, CACHE, batch=4 if how == "compiled batch" else None), 3)
    batch._bind = how == "io binding"  # NOTE: set by provider; forced here to run both paths on the CPU
    assert _interleaved(batch) == alone
    assert batch.n == 0 and not batch.mask.any()


def test_the_torch_fallback_one_engine_per_slot_does_the_same(model_and_graphs):
    model, (prefill, decoder) = model_and_graphs
    alone = _alone(StaticEngine(prefill, decoder, ARGS, CACHE))
    assert _interleaved(EngineSlots(lambda: TorchEngine(model), 3, ARGS.max_seq_len)) == alone


def test_a_prompt_that_fills_the_cache_is_refused(model_and_graphs):
    _, (prefill, decoder) = model_and_graphs
    batch = SlotBatch(StaticEngine(prefill, decoder, ARGS, CACHE), 2)
    with pytest.raises(CapacityError, match=f"prompt of {CACHE} tokens does not fit the decoder's cache of {CACHE}"):
        batch.admit([[1, 2], [1] * CACHE])
