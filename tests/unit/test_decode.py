"""Decoding engines, token picking and the generate loop (llmpipe.infer.decode), the streamer."""

from __future__ import annotations

import io

import numpy as np
import onnxruntime as ort
import pytest
import torch

from llmpipe.export import onnx as export
from llmpipe.infer import decode
from llmpipe.models.llama import FLAVORS, Transformer

CACHE = 40


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decode")
    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    model.eval()
    export.export_prefill(model, folder / "model.onnx", opset=17)
    export.export_static_decoder(model, folder / "decoder_static.onnx", opset=17, length=CACHE)
    sessions = [ort.InferenceSession(str(folder / f), providers=["CPUExecutionProvider"])
                for f in ("model.onnx", "decoder_static.onnx")]
    return model, decode.TorchEngine(model), decode.StaticEngine(*sessions, model.args, CACHE)


def test_static_engine_and_torch_engine_give_the_same_logits_step_by_step(engines):
    model, torch_engine, static = engines
    ids = export.random_ids(3, 7, model.args.vocab_size, seed=1)
    np.testing.assert_allclose(static.start(ids), torch_engine.start(ids), atol=1e-4, rtol=0)
    for i in range(5):
        tok = np.array([i + 1, 2 * i + 3, 7], dtype=np.int64)
        np.testing.assert_allclose(static.step(tok), torch_engine.step(tok), atol=1e-4, rtol=0)
    assert static.cache.pos == 12 and static.cache.mask[:, :12].all() and not static.cache.mask[:, 12:].any()


def test_the_cpu_decode_loop_binds_the_cache_once_and_writes_slots_in_place(engines):
    model, _, static = engines
    ids = export.random_ids(2, 5, model.args.vocab_size, seed=2)
    static.start(ids)
    arrays = [a.ctypes.data for a in static.cache.arrays]
    binding = static.cache.binding
    assert binding is not None  # onnxruntime CPU: I/O binding over the engine's own arrays
    static.step(np.array([1, 2]))
    static.start(ids)  # same batch: the cache and the binding are reused, not reallocated
    assert static.cache.binding is binding and [a.ctypes.data for a in static.cache.arrays] == arrays


def test_generate_times_and_counts_and_refuses_what_does_not_fit(engines):
    model, torch_engine, static = engines
    ids = export.random_ids(2, 6, model.args.vocab_size, seed=3)
    seen = []
    gen = decode.generate(static, ids, 5, on_tokens=seen.append)
    assert gen.tokens.shape == (2, 5) and len(seen) == 5 and len(gen.step_s) == 4
    assert 0 < gen.prefill_s <= gen.ttft_s < gen.total_s
    assert gen.tpot_s() == pytest.approx((gen.total_s - gen.ttft_s) / 4)
    assert gen.decode_tokens_per_s() == pytest.approx(2 * 4 / (gen.total_s - gen.ttft_s))
    assert np.array_equal(gen.tokens, decode.generate(torch_engine, ids, 5).tokens)
    ref, _ = decode.greedy_reference(model, ids, 5)
    assert np.array_equal(gen.tokens, ref)
    with pytest.raises(decode.CapacityError, match=r"prompt of 6 tokens \+ 40 new tokens exceeds the context of 40"):
        decode.generate(static, ids, 40)
    one = decode.generate(static, ids[:1], 30, stop_id=int(gen.tokens[0, 1]))
    assert one.tokens.shape == (1, 2)  # stopped after the stop token


def test_greedy_picks_the_argmax_and_top_k_1_is_greedy():
    logits = np.array([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert decode.pick_tokens(logits).tolist() == [1, 0]
    rng = np.random.default_rng(0)
    assert all(decode.pick_tokens(logits, temperature=2.0, top_k=1, rng=rng).tolist() == [1, 0] for _ in range(20))


def test_top_k_and_top_p_restrict_the_draw_to_the_allowed_tokens():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    top2 = {int(decode.pick_tokens(logits, 1.0, top_k=2, rng=rng)[0]) for _ in range(300)}
    assert top2 == {0, 1}
    # nucleus 0.7: 0.5 alone is below, 0.5 + 0.3 reaches it -> {0, 1}
    nucleus = {int(decode.pick_tokens(logits, 1.0, top_p=0.7, rng=rng)[0]) for _ in range(300)}
    assert nucleus == {0, 1}
    draws = np.array([decode.pick_tokens(logits, 1.0, rng=rng)[0] for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    seeded = [decode.pick_tokens(logits, 1.0, rng=np.random.default_rng(7))[0] for _ in range(3)]
    assert len(set(seeded)) == 1  # the same seed draws the same token


def test_the_streamer_prints_a_character_split_over_tokens_once_whole():
    from llmpipe.data.tokenizer import train_tokenizer
    from llmpipe.tools.generate import Streamer

    tok = train_tokenizer(["ascii only text here " * 20], vocab_size=280)
    ids = tok.encode("é!").ids  # byte-level: 'é' is two byte tokens
    assert len(ids) >= 3
    out = io.StringIO()
    stream = Streamer(tok, out)
    writes = []
    for i in ids:
        before = out.getvalue()
        stream(np.array([i]))
        writes.append(out.getvalue()[len(before):])
    assert "".join(writes) == "é!" and "\ufffd" not in "".join(writes)


def test_the_torch_engine_runs_under_inference_mode_and_keeps_its_cache(engines):
    model, torch_engine, _ = engines
    torch_engine.start(export.random_ids(1, 4, model.args.vocab_size, seed=4))
    assert torch_engine.past[0][0].shape[2] == 4 and not torch_engine.past[0][0].requires_grad
    torch_engine.step(np.array([3]))
    assert torch_engine.past[0][0].shape[2] == 5 and isinstance(torch_engine.past[0][0], torch.Tensor)
