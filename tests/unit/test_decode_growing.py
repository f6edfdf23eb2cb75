"""GrowingEngine over decoder_ort.onnx (the static decoder's maths with the cache length dynamic, for
onnxruntime only) against StaticEngine over the portable decoder_static.onnx: the same greedy tokens and
logits within 1e-4 in fp32 as its cache grows bucket by bucket, while the portable graph stays as ATC
needs it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from llmpipe.export import onnx as export
from llmpipe.infer import decode
from llmpipe.models.llama import FLAVORS, Transformer

CACHE = 64


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("growing")
    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    model.eval()
    export.export_prefill(model, folder / "model.onnx", opset=17)
    export.export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=CACHE)
    export.export_ort_decoder(model, folder / "decoder_ort.onnx", opset=17, length=CACHE)
    return model, folder


def _engine(model, folder, cls, decoder, **kw):
    sessions = [ort.InferenceSession(str(folder / f), providers=["CPUExecutionProvider"])
                for f in ("model.onnx", decoder)]
    return cls(*sessions, model.args, CACHE, **kw)


def _greedy(engine, prompt: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Tokens (B, n), each step's logits (B, n, vocab) and the cache's slots after each step."""
    logits = [engine.start(prompt)]
    tokens, slots = [logits[-1].argmax(-1)], [engine.cache.mask.shape[1]]
    for _ in range(n - 1):
        logits.append(engine.step(tokens[-1]))
        tokens.append(logits[-1].argmax(-1))
        slots.append(engine.cache.mask.shape[1])
    return np.stack(tokens, axis=1), np.stack(logits, axis=1), slots


@pytest.mark.parametrize("batch", [1, 2])
def test_the_growing_engine_picks_the_static_decoders_greedy_tokens_up_to_a_full_cache(graphs, batch):
    model, folder = graphs
    static = _engine(model, folder, decode.StaticEngine, "decoder_static.onnx")
    growing = _engine(model, folder, decode.GrowingEngine, "decoder_ort.onnx", min_bucket=8)
    prompt = export.random_ids(batch, 5, model.args.vocab_size, seed=11 + batch)
    n = CACHE - 5 + 1  # the last token is picked, never fed back: every slot ends up used
    want_tokens, want_logits, static_slots = _greedy(static, prompt, n)
    tokens, logits, slots = _greedy(growing, prompt, n)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    assert set(static_slots) == {CACHE}  # the portable decoder reads every slot, every step
    # the bucket: 8 slots for the 5-token prompt and the next token, doubled each time it is full
    assert slots[0] == 8 and sorted(set(slots)) == [8, 16, 32, 64]
    fed = 5 + np.arange(n)  # tokens in the cache when each step's logits came out
    assert all(s >= f for s, f in zip(slots, fed)) and all(s <= max(8, 2 * f) for s, f in zip(slots, fed))
    assert growing.cache.pos == CACHE and growing.cache.mask.all()
    again, again_logits, _ = _greedy(growing, prompt, n)  # the kept buckets, stale slots and all
    np.testing.assert_array_equal(again, want_tokens)
    np.testing.assert_allclose(again_logits, want_logits, atol=1e-4, rtol=0)
    with pytest.raises(decode.CapacityError, match=f"the decoder's cache of {CACHE} slots is full"):
        growing.step(tokens[:, -1])


def test_each_bucket_is_bound_once_and_kept_and_a_new_prompt_starts_in_the_smallest(graphs):
    model, folder = graphs
    growing = _engine(model, folder, decode.GrowingEngine, "decoder_ort.onnx", min_bucket=8)
    growing.start(export.random_ids(1, 7, model.args.vocab_size, seed=3))
    first = growing.cache.binding
    assert first is not None and growing.cache.arrays[0].shape[2] == 8
    growing.step(np.array([1]))  # slot 7: still the 8-slot bucket
    assert growing.cache.binding is first
    growing.step(np.array([2]))  # slot 8: the 16-slot bucket, the 8 tokens moved over
    assert growing.cache.binding is not first and growing.cache.arrays[0].shape[2] == 16
    assert growing.cache.mask[0].tolist() == [1] * 9 + [0] * 7
    sixteen = growing.cache.binding
    growing.start(export.random_ids(1, 3, model.args.vocab_size, seed=4))  # the 8-slot bucket again, as bound
    assert growing.cache.binding is first and growing.cache.arrays[0].shape[2] == 8 and growing.cache.pos == 3
    assert growing.cache.mask[0].tolist() == [1] * 3 + [0] * 5
    for token in range(6):  # into the 16-slot bucket kept from before: its stale slots are masked out
        growing.step(np.array([token]))
    assert growing.cache.binding is sixteen and growing.cache.mask[0].tolist() == [1] * 9 + [0] * 7


def test_the_portable_decoder_keeps_its_fixed_cache_and_both_use_standard_ops_at_opset_17(graphs):
    folder = graphs[1]
    shapes = {}
    for name in ("decoder_static.onnx", "decoder_ort.onnx"):
        proto = onnx.load(str(folder / name), load_external_data=False)
        assert export.file_opset(folder / name) == 17
        assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}  # no contrib ops in either
        shapes[name] = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
                        for i in proto.graph.input}
    assert shapes["decoder_static.onnx"]["cache.0.key"] == ["batch", 2, CACHE, 16]
    assert shapes["decoder_static.onnx"]["attention_mask"] == ["batch", CACHE]
    assert shapes["decoder_ort.onnx"]["cache.0.key"] == ["batch", 2, "cache", 16]
    assert shapes["decoder_ort.onnx"]["attention_mask"] == ["batch", "cache"]
    model = graphs[0]
    session = ort.InferenceSession(str(folder / "decoder_ort.onnx"), providers=["CPUExecutionProvider"])
    assert decode.graph_problem(session, "decoder_ort", model.args, CACHE) is None
    prefill = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    assert decode.graph_problem(prefill, "decoder_ort", model.args, CACHE) == \
        "no input 'position_ids' and 5 more, no output 'new.0.key' and 3 more"
