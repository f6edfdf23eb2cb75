"""Model shapes, causality, GQA, init determinism and the Hugging Face adapter."""

from __future__ import annotations

import pytest
import torch

from llmpipe.models.llama import FLAVORS, ModelArgs, Transformer, hf


def _model(seed: int = 0, **kw) -> Transformer:
    args = ModelArgs(**{**FLAVORS["debug"].to_dict(), **kw})
    with torch.device("meta"):
        m = Transformer(args)
    m.to_empty(device="cpu")
    m.init_weights(seed=seed)
    return m.eval()


def test_shapes_and_param_count():
    m = _model()
    x = torch.randint(0, m.args.vocab_size, (3, 17))
    assert m(x).shape == (3, 17, m.args.vocab_size)
    assert sum(p.numel() for p in m.parameters()) == m.args.num_params()


def test_seven_b_flavor_matches_the_seed():
    a = FLAVORS["llama-7b"]
    assert (a.dim, a.n_heads, a.n_layers, a.ffn_dim) == (4096, 32, 32, 11008)
    assert abs(a.num_params() - 6.74e9) < 0.01e9


def test_causality_future_tokens_do_not_change_the_past():
    m = _model()
    x = torch.randint(0, m.args.vocab_size, (2, 12))
    y = x.clone()
    y[:, 8:] = torch.randint(0, m.args.vocab_size, (2, 4))
    with torch.no_grad():
        a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-5)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


def test_init_is_deterministic_by_seed():
    a, b, c = _model(seed=1), _model(seed=1), _model(seed=2)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model equals the MHA model whose k/v heads are the GQA heads repeated."""
    g = _model(n_heads=4, n_kv_heads=2)
    m = _model(n_heads=4, n_kv_heads=4)
    state = g.state_dict()
    hd = g.args.head_dim
    for k in list(state):
        if k.endswith(("wk.weight", "wv.weight")):
            w = state[k].view(2, hd, -1)
            state[k] = w.repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    m.load_state_dict(state)
    x = torch.randint(0, g.args.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(g(x), m(x), rtol=1e-5, atol=1e-5)


def test_bad_head_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="n_heads=6 is not divisible by model.n_kv_heads=4"):
        ModelArgs(dim=48, n_heads=6, n_kv_heads=4)


def test_hf_names_round_trip():
    m = _model()
    for name in m.state_dict():
        assert hf.from_hf_name(hf.to_hf_name(name)) == name


def test_hf_llama_gives_the_same_logits():
    """Parity against transformers' LlamaForCausalLM loaded from our renamed weights."""
    transformers = pytest.importorskip("transformers")
    m = _model()
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf.hf_config(m.args, "fp32").items()
                                      if k not in ("architectures", "model_type", "torch_dtype")})
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.load_state_dict({hf.to_hf_name(k): v for k, v in m.state_dict().items()}, strict=True)
    x = torch.randint(0, m.args.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, m(x), rtol=1e-4, atol=1e-4)


def test_kv_cache_decoding_equals_the_full_pass():
    m = _model()
    x = torch.randint(0, m.args.vocab_size, (2, 12))
    with torch.no_grad():
        full = m(x)
        _, past = m.forward_cached(x[:, :7])
        step, present = m.forward_cached(x[:, 7:8], past)  # one token at a time
        rest, _ = m.forward_cached(x[:, 8:], present)
    torch.testing.assert_close(step, full[:, 7:8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, full[:, 8:], rtol=1e-5, atol=1e-5)
    assert present[0][0].shape == (2, m.args.n_kv_heads, 8, m.args.head_dim)  # cached before GQA repeat
