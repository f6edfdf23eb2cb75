"""SmoothQuant's scales (llmpipe.infer.smooth, benchmark.quantize.smooth_alpha) on the debug model's portable
prefill graph: the fp32 function unchanged, an outlier channel that breaks dynamic int8 made harmless, and the
int8 / int8s variants the benchmark makes with them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from llmpipe import device
from llmpipe.bench import quality
from llmpipe.config import BenchmarkSection, QuantizeSection
from llmpipe.export.onnx import export_prefill
from llmpipe.infer.ort import FeedsReader, create_session, fp32_matmuls, make_variants, quantize_int8
from llmpipe.infer.smooth import smooth_file
from llmpipe.models.llama import FLAVORS, Transformer

OUTLIER = 100.0  # one channel of every norm's output this many times the others


@pytest.fixture(scope="module")
def outlier_graph(tmp_path_factory):
    """The debug model with an outlier channel (as real models have): every layer's norms' weights have one
    channel OUTLIER times larger and the q/k/v and gate/up rows reading it as much smaller, so the function is
    the same and only the activations carry it. Its prefill graph, calibration ids, held-out ids and the fp32
    logits."""
    root = tmp_path_factory.mktemp("smooth")
    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(30)  # clear next-token choices (random weights give near-ties)
        for layer in model.layers.values():
            for norm, readers in ((layer.attention_norm, (layer.attention.wq, layer.attention.wk, layer.attention.wv)),
                                  (layer.ffn_norm, (layer.feed_forward.w1, layer.feed_forward.w3))):
                norm.weight[3] *= OUTLIER
                for w in readers:
                    w.weight[:, 3] /= OUTLIER
    model.eval()
    export_prefill(model, root / "model.onnx", opset=17)
    rng = np.random.default_rng(0)
    calib = rng.integers(1, model.args.vocab_size, (8, 32))
    ids = rng.integers(1, model.args.vocab_size, (4, 32))
    return root, calib, ids, _logits(root / "model.onnx", ids)


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return create_session(path, device.ort_providers(["cpu"])[0], 2).run(["logits"], {"input_ids": ids})[0]


def _reader(calib: np.ndarray) -> FeedsReader:
    return FeedsReader([{"input_ids": calib[i:i + 4]} for i in range(0, len(calib), 4)])


def test_the_scales_leave_the_fp32_function_unchanged_and_fold_into_the_norms(outlier_graph, tmp_path):
    root, calib, ids, ref = outlier_graph
    n = smooth_file(root / "model.onnx", tmp_path / "smoothed.onnx", _reader(calib), 0.5)
    assert n == 2 * 4 + 1  # per layer: q/k/v's input, o's, gate/up's, down's; the head's
    got = _logits(tmp_path / "smoothed.onnx", ids)
    # measured max |diff| ~2e-5 of logits spanning ~100
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-4, np.abs(got - ref).max()
    graph = onnx.load(str(tmp_path / "smoothed.onnx")).graph
    # x / s went into the norms' weights (q/k/v's, gate/up's and the head's inputs, shared ones through an
    # Identity copied first) and the up projections (down's input): only the attention's output (into o_proj)
    # needed a Mul of its own
    assert sum(node.name.endswith("_smooth") for node in graph.node) == 2
    assert not list(tmp_path.glob("*calibration*")) and not list(root.glob("*calibration*"))


def test_an_outlier_channel_breaks_dynamic_int8_and_the_scales_bring_it_back(outlier_graph, tmp_path):
    """The benchmark's dynamic int8 (per channel, down and head in fp32): the outlier costs it KL ~1e-3 (the
    other channels get a few of the per-tensor range's levels; measured 9e-4), the scaled graph's int8 ~1e-6."""
    root, calib, ids, ref = outlier_graph
    keep = fp32_matmuls(root / "model.onnx", ["down", "head"])
    quantize_int8(root / "model.onnx", tmp_path / "plain.onnx", True, ["down", "head"])
    assert smooth_file(root / "model.onnx", tmp_path / "smoothed.onnx", _reader(calib), 0.5, keep) == 2 * 3
    quantize_int8(tmp_path / "smoothed.onnx", tmp_path / "int8.onnx", True, ["down", "head"])
    plain = quality.text_metrics(ids, ref, _logits(tmp_path / "plain.onnx", ids))
    smoothed = quality.text_metrics(ids, ref, _logits(tmp_path / "int8.onnx", ids))
    assert plain["kl"] > 1e-4 and smoothed["kl"] < plain["kl"] / 10, (plain, smoothed)


def test_the_benchmark_makes_int8_and_int8s_from_the_scaled_graph_and_keeps_nothing_else(outlier_graph,
                                                                                            tmp_path):
    root, calib, ids, ref = outlier_graph
    q = QuantizeSection.model_validate({"smooth_alpha": 0.5})
    made = make_variants(root / "model.onnx", ["int8", "int8s"], tmp_path, quantize=q,
                         calibration=lambda: _reader(calib))
    plain = make_variants(root / "model.onnx", ["int8"], tmp_path / "plain", quantize=QuantizeSection())
    for name in ("int8", "int8s"):
        assert made[name].error is None, made[name].error
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["model.onnx"], name
    kl = {name: quality.text_metrics(ids, ref, _logits(v.path, ids))["kl"] for name, v in made.items()
          if name != "fp32"}
    kl_plain = quality.text_metrics(ids, ref, _logits(plain["int8"].path, ids))["kl"]
    assert kl["int8"] < kl_plain / 10 and kl["int8s"] < kl_plain, (kl, kl_plain)
    assert sorted(p.name for p in root.iterdir()) == ["model.onnx"]  # nothing written beside the source
    # without calibration data the variant is recorded as not made, with the reason
    none = make_variants(root / "model.onnx", ["int8"], tmp_path / "none", quantize=q)
    assert "smooth_alpha needs calibration data" in none["int8"].error


def test_smooth_alpha_is_checked_when_the_config_loads():
    assert BenchmarkSection.model_validate({"variants": ["fp32", "int8"]}).quantize.smooth_alpha is None
    with pytest.raises(ValueError, match="quantize.smooth_alpha: scales int8 and int8s, neither of which"):
        BenchmarkSection.model_validate({"variants": ["fp32", "int4"], "quantize": {"smooth_alpha": 0.5}})
    with pytest.raises(ValueError, match="smooth_alpha"):
        QuantizeSection.model_validate({"smooth_alpha": 1.5})
