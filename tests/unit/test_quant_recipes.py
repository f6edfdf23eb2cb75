"""The quantisation recipes of benchmark.quantize (round to nearest or HQQ, the head at 8 bits, 2 bits as the
damaged control) on the debug model, and the GGUF export (llmpipe.export.gguf) with its benchmark variants."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from llmpipe import device
from llmpipe.bench import gguf_variants, quality
from llmpipe.config import BenchmarkSection, QualitySection, QuantizeSection
from llmpipe.errors import StageError
from llmpipe.export import gguf as gguf_export
from llmpipe.export.onnx import export_prefill
from llmpipe.infer.ort import create_session, quantize_weight_only
from llmpipe.models.llama import FLAVORS, Transformer

# (bits, algorithm, head_bits, zero_points) of each recipe; what quant_recipes.py measures on SmolLM2-135M
RECIPES = {"rtn-head8": (4, "rtn", 8, "integer"), "hqq-head8": (4, "hqq", 8, "integer"),
           "hqq-head8-float": (4, "hqq", 8, "float"), "rtn2": (2, "rtn", None, "integer")}


@pytest.fixture(scope="module")
def confident(tmp_path_factory):
    """The debug model with a head scaled up so its next-token choices are clear (random weights otherwise
    give near-ties, where any rounding flips top-1), its prefill graph, and validation-like ids."""
    root = tmp_path_factory.mktemp("recipes")
    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(30)
    model.eval()
    export_prefill(model, root / "model.onnx", opset=17)
    ids = np.random.default_rng(0).integers(1, model.args.vocab_size, (4, 32))
    return root, model, ids, _logits(root / "model.onnx", ids)


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return create_session(path, device.ort_providers(["cpu"])[0], 2).run(["logits"], {"input_ids": ids})[0]


def _matmulnbits_bits(path: Path) -> list[int]:
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    return [next(a.i for a in n.attribute if a.name == "bits") for n in nodes if n.op_type == "MatMulNBits"]


def test_each_recipe_loads_and_its_quality_numbers_are_computed_with_the_head_at_its_own_width(confident):
    root, _, ids, ref = confident
    for name, (bits, algorithm, head_bits, zero_points) in RECIPES.items():
        out = root / f"{name}.onnx"
        quantize_weight_only(root / "model.onnx", out, bits, 32, 4, bits == 2, algorithm, head_bits, zero_points)
        m = quality.text_metrics(ids, ref, _logits(out, ids))
        assert all(np.isfinite(m[k]) for k in ("ppl", "kl", "top1")) and m["kl"] > 0, (name, m)
        widths = _matmulnbits_bits(out)
        # the 7 projections of each of the 2 layers, then the head (the graph's last weight MatMul)
        assert len(widths) == 2 * 7 + 1 and widths[-1] == (head_bits or bits) and set(widths[:-1]) == {bits}, name


def test_dynamic_int8_per_channel_keeps_the_down_projections_and_the_head_in_fp32_and_is_scored(confident):
    from llmpipe.infer.ort import quantize_int8

    root, _, ids, ref = confident
    q = QuantizeSection()
    quantize_int8(root / "model.onnx", root / "int8.onnx", q.dynamic_per_channel, q.dynamic_keep_fp32)
    ops = [n.op_type for n in onnx.load(str(root / "int8.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulInteger") == 2 * 6  # wq, wk, wv, wo, w1, w3 of each layer; w2 and the head stay fp32
    m = quality.text_metrics(ids, ref, _logits(root / "int8.onnx", ids))
    assert all(np.isfinite(m[k]) for k in ("ppl", "kl", "top1")) and m["kl"] > 0, m


def test_a_recipe_forced_to_damage_the_model_is_rejected_by_the_default_gates_and_4_bit_is_not(confident):
    root, _, ids, ref = confident
    gates = QualitySection()
    verdicts = {}
    for name in ("hqq-head8", "rtn2"):
        bits, algorithm, head_bits, zero_points = RECIPES[name]
        if not (root / f"{name}.onnx").is_file():  # made by the test above when it ran
            quantize_weight_only(root / "model.onnx", root / f"{name}.onnx", bits, 32, 4, bits == 2, algorithm,
                                 head_bits, zero_points)
        m = quality.text_metrics(ids, ref, _logits(root / f"{name}.onnx", ids))
        verdicts[name] = quality.judge({"int4": m}, gates)[0]
    assert verdicts["hqq-head8"].passed, verdicts["hqq-head8"].message()
    assert not verdicts["rtn2"].passed
    assert verdicts["rtn2"].message().startswith("benchmark: int4 fails its quality gate: ")


def test_the_int4_default_is_folded_hqq_with_the_head_at_8_bits_and_rtn_is_an_option():
    from llmpipe.export import fused

    q = QuantizeSection()
    assert (q.int4.algorithm, q.int4.zero_points, q.int4.head_bits, q.int4.block_size, q.int4.ort_block_size) == \
        ("hqq", "integer", 8, 32, None)
    assert (q.int8w.algorithm, q.int8w.head_bits) == ("rtn", None)
    assert (q.dynamic_per_channel, q.dynamic_keep_fp32) == (True, ["down", "head"])
    assert fused.weight_only_options(q.int4)[1]["matmul_mixed_precision"] == "last_matmul:int8"
    assert "matmul_mixed_precision" not in fused.weight_only_options(q.int8w)[1]
    assert QuantizeSection.model_validate({"int4": {"algorithm": "rtn"}}).int4.algorithm == "rtn"
    # a tied model's builder graph with the head at other bits keeps its own embedding (the shared one breaks)
    assert fused.weight_only_options(q.int4)[1]["shared_embeddings"] == "false"


# ------------------------------------------------------------------------------------------------ GGUF


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, confident):
    from llmpipe.data.tokenizer import train_tokenizer
    from llmpipe.export.fused import write_hf_folder

    _, model, _, _ = confident
    text = ["def main(argv):\n    return len(argv) + 1\n" * 5, "import os\nprint(os.getcwd())\n" * 5]
    tok = train_tokenizer(text, vocab_size=model.args.vocab_size)
    return write_hf_folder(model, tmp_path_factory.mktemp("hf") / "hf", tok)


def test_gguf_export_round_trips_names_shapes_and_types(hf_folder, tmp_path):
    import gguf
    from safetensors.numpy import load_file

    weights = load_file(str(hf_folder / "model.safetensors"))
    config = json.loads((hf_folder / "config.json").read_text())
    T = gguf.GGMLQuantizationType
    for qtype, matrix, wide in (("f16", T.F16, T.F16), ("q4_0", T.Q4_0, T.Q8_0)):  # q4_0 holds q8_0 too
        reader = gguf.GGUFReader(gguf_export.write(hf_folder, tmp_path / f"m-{qtype}.gguf", qtype))
        tensors = {t.name: t for t in reader.tensors}
        assert set(tensors) == {gguf_export.gguf_name(k) for k in weights}, qtype
        for hf_name, w in weights.items():
            t = tensors[gguf_export.gguf_name(hf_name)]
            assert tuple(int(d) for d in t.shape) == w.shape[::-1], hf_name  # GGUF lists the fastest dim first
            want = T.F32 if w.ndim == 1 else wide if hf_name in ("model.embed_tokens.weight",
                                                                 "lm_head.weight") else matrix
            if w.ndim == 2 and w.shape[1] % 32 and want != T.F16:
                want = T.F16  # rows not in whole blocks of 32 (the debug model's 176-wide down projection)
            assert t.tensor_type == want, (qtype, hf_name, t.tensor_type)
        assert reader.fields["llama.block_count"].contents() == config["num_hidden_layers"]
        assert reader.fields["llama.attention.head_count_kv"].contents() == config["num_key_value_heads"]
        assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]
    # q8_0 (the head of the q4_0 file) reads back within one quantisation step of the weights
    t = next(t for t in gguf.GGUFReader(tmp_path / "m-q4_0.gguf").tensors if t.name == "output.weight")
    w = weights["lm_head.weight"]
    back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
    assert float(np.abs(back - w).max()) <= float(np.abs(w).max()) / 127 + 1e-6


def test_gguf_q4_1_is_hqq_blocks_that_read_back_on_the_grid_they_came_from(hf_folder, tmp_path):
    """q4_1's blocks are HQQ's scale and float zero point as llama.cpp's d and m: weights on a Q4_1 grid (the
    shipped SmolLM2 file's) read back almost exactly, where round to nearest with integer zero points cannot;
    any weights read back within one 4-bit step; the embedding / head stay q8_0; a bad method is one line."""
    import gguf

    rng = np.random.default_rng(0)
    d = rng.uniform(0.002, 0.02, (64, 8, 1)).astype(np.float32)  # 64 rows, 8 blocks of 32
    m = rng.uniform(-0.1, 0.0, (64, 8, 1)).astype(np.float32)
    q = rng.integers(0, 16, (64, 8, 32))
    q[:, :, 0], q[:, :, 1] = 0, 15  # each block spans its grid, as a Q4_1 block's min and max do
    on_grid = (d * q + m).reshape(64, 256).astype(np.float16).astype(np.float32)
    back = gguf.quants.dequantize(gguf_export.q4_1_hqq(on_grid), gguf.GGMLQuantizationType.Q4_1).reshape(64, 256)
    err = np.abs(back - on_grid) / np.repeat(d.reshape(64, 8), 32, axis=1)  # in steps of each weight's block
    # HQQ's fit lands on the grid (fp16 d and m aside) for >= 99% of the weights, and moves no weight a whole step
    assert float(np.mean(err < 0.05)) >= 0.99 and float(err.mean()) < 0.01 and float(err.max()) < 1.0
    w = rng.standard_normal((48, 128)).astype(np.float32)
    back = gguf.quants.dequantize(gguf_export.q4_1_hqq(w), gguf.GGMLQuantizationType.Q4_1).reshape(w.shape)
    span = (w.reshape(48, 4, 32).max(-1) - w.reshape(48, 4, 32).min(-1)).max() / 15
    assert float(np.abs(back - w).mean()) < 0.3 * span  # HQQ's l_0.7 fit: well inside one step on average
    reader = gguf.GGUFReader(gguf_export.write(hf_folder, tmp_path / "m-q4_1.gguf", "q4_1"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    T = gguf.GGMLQuantizationType
    assert types["token_embd.weight"] == T.Q8_0 and types["blk.0.attn_q.weight"] == T.Q4_1
    with pytest.raises(StageError, match="hqq writes q4_1 only"):
        gguf_export.write(hf_folder, tmp_path / "m-q4_0.gguf", "q4_0", method="hqq")
    assert not (tmp_path / "m-q4_0.gguf").exists()


def test_llama_cpp_decodes_the_f16_export_like_torch_or_the_rows_say_why_not(hf_folder, confident, tmp_path):
    _, model, ids, _ = confident
    path = gguf_export.write(hf_folder, tmp_path / "model-f16.gguf", "f16")
    cfg = BenchmarkSection.model_validate({"llm": {"decode_prompt_len": 8, "new_tokens": 4, "repeats": 1},
                                           "quality": {"enforce": False}})
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[:2])).float().numpy()
    reason = gguf_variants.unavailable_reason()
    out = gguf_variants.results({"gguf_f16": path}, ids[:2], ref, cfg, 2, model.args.vocab_size, 0)
    row = out["variants"]["gguf_f16"]
    if reason is not None:
        assert row == {"file": path.name, "bytes": path.stat().st_size, "skipped": reason}
        return
    # llama.cpp computes in f16 here: the same next tokens as torch fp32, KL near zero (measured 2e-5)
    assert row["top1"] >= 0.99 and row["kl"] < 1e-3 and row["verdict"] == "accepted", row
    assert row["decode_tokens_per_s"] > 0


def test_a_lora_adapter_written_for_llama_cpp_adds_the_fine_tunes_weights_to_its_base(hf_folder, confident,
                                                                                      tmp_path):
    """write_lora's A and B (query and key B permuted like the base) times its alpha / rank, added to the base
    file's tensors, are the merged model's tensors in the same file layout; where llama-cpp-python is present,
    base + adapter decodes the merged model's logits (f16 files: within 0.2% of the largest logit, where the base
    alone is off by more than 5%)."""
    import shutil

    import gguf
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(3)
    base = load_file(str(hf_folder / "model.safetensors"))
    r, alpha = 4, 8.0
    peft, merged = {}, dict(base)
    for key, w in base.items():
        if w.ndim == 2 and ".layers." in key and key.endswith("_proj.weight"):
            a = (0.1 * rng.standard_normal((r, w.shape[1]))).astype(np.float32)
            b = (0.1 * rng.standard_normal((w.shape[0], r))).astype(np.float32)
            stem = "base_model.model." + key[: -len(".weight")]
            peft[stem + ".lora_A.weight"], peft[stem + ".lora_B.weight"] = a, b
            merged[key] = w + alpha / r * (b @ a)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha}))
    save_file(peft, str(adapter / "adapter_model.safetensors"))
    merged_hf = tmp_path / "merged"
    shutil.copytree(hf_folder, merged_hf)
    save_file(merged, str(merged_hf / "model.safetensors"))

    lora = gguf.GGUFReader(gguf_export.write_lora(adapter, merged_hf, tmp_path / "lora.gguf"))
    assert lora.fields["general.type"].contents() == "adapter"
    assert lora.fields["adapter.type"].contents() == "lora"
    assert lora.fields["adapter.lora.alpha"].contents() == pytest.approx(alpha)
    ab = {t.name: np.asarray(t.data, dtype=np.float32) for t in lora.tensors}
    assert len(ab) == 2 * len(peft) // 2
    plain = {t.name: np.asarray(t.data, dtype=np.float32) for t in
             gguf.GGUFReader(gguf_export.write(hf_folder, tmp_path / "base.gguf", "f16")).tensors}
    want = {t.name: np.asarray(t.data, dtype=np.float32) for t in
            gguf.GGUFReader(gguf_export.write(merged_hf, tmp_path / "merged.gguf", "f16")).tensors}
    for name in {n[: -len(".lora_a")] for n in ab if n.endswith(".lora_a")}:
        got = plain[name] + alpha / r * (ab[name + ".lora_b"] @ ab[name + ".lora_a"])
        np.testing.assert_allclose(got, want[name], atol=2e-3, err_msg=name)  # f16 rounding of both files
    if gguf_variants.unavailable_reason() is not None:  # the suite never needs the optional extra
        return
    import llama_cpp

    _, _, ids, _ = confident
    outs = []
    for path, lora_path in ((tmp_path / "merged.gguf", None), (tmp_path / "base.gguf", tmp_path / "lora.gguf"),
                            (tmp_path / "base.gguf", None)):
        llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False,
                              lora_path=str(lora_path) if lora_path else None)
        llm.eval(ids[0, :16].tolist())
        outs.append(np.array(llm.scores[:16], dtype=np.float32))
        llm.close()
    top = float(np.abs(outs[0]).max())
    assert float(np.abs(outs[1] - outs[0]).max()) <= 2e-3 * top  # measured 4e-4: f16 rounding
    assert float(np.abs(outs[2] - outs[0]).max()) > 5e-2 * top  # the adapter is what closes the gap
    # the benchmark's GGUF variants: export.gguf_adapter's file is applied to the 4-bit base, and is what brings
    # it to the merged model (the reference here: the merged f16 file's logits of the same windows)
    windows = ids[:2, :16]
    ref = np.stack([outs[0]] + [_llama_logits(tmp_path / "merged.gguf", row) for row in windows[1:]])
    q41 = gguf_export.write(hf_folder, tmp_path / "base-q4_1.gguf", "q4_1")
    cfg = BenchmarkSection.model_validate({"llm": {"decode_prompt_len": 8, "new_tokens": 4, "repeats": 1},
                                           "quality": {"enforce": False}})
    kl = {}
    for lora_file in (tmp_path / "lora.gguf", None):
        out = gguf_variants.results({"gguf_q4_1": q41}, windows, ref, cfg, 2, ref.shape[-1], 0, lora_file)
        row = out["variants"]["gguf_q4_1"]
        assert row.get("adapter") == (lora_file.name if lora_file else None)
        kl[lora_file is not None] = row["kl"]
    assert kl[True] < 0.5 * kl[False], kl


def _llama_logits(path: Path, row: np.ndarray) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    llm.eval(row.tolist())
    out = np.array(llm.scores[:len(row)], dtype=np.float32)
    llm.close()
    return out


def test_without_llama_cpp_the_gguf_variants_are_recorded_as_skipped_with_the_reason(hf_folder, tmp_path,
                                                                                      monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    path = gguf_export.write(hf_folder, tmp_path / "model-q8_0.gguf", "q8_0")
    out = gguf_variants.results({"gguf_q8_0": path}, None, None, BenchmarkSection(), 2, 300, 0)
    why = "llama-cpp-python is not installed (pip install 'llmpipe[llamacpp]')"
    assert out == {"variants": {"gguf_q8_0": {"file": path.name, "bytes": path.stat().st_size, "skipped": why}},
                   "rejected": [], "verdicts": []}
    assert f"skipped: {why}" in gguf_variants.markdown(out)


def test_the_gguf_variants_are_found_from_export_onnxs_manifest_as_written(hf_folder, tmp_path):
    from llmpipe.manifest import Manifest, file_entry

    (tmp_path / "gguf").mkdir()
    gguf_export.write(hf_folder, tmp_path / "gguf" / "model-q8_0.gguf", "q8_0")
    manifest = Manifest("export_onnx", "completed", "fp", {"gguf_q8_0": file_entry(tmp_path, "gguf/model-q8_0.gguf")})
    manifest.write(tmp_path)
    found = gguf_variants.files(tmp_path, Manifest.read(tmp_path))
    assert found == {"gguf_q8_0": tmp_path / "gguf" / "model-q8_0.gguf"}


def test_llama_cpps_decode_steps_pick_from_its_real_last_logits(hf_folder, confident, tmp_path):
    """Without logits_all llama-cpp-python leaves Llama.scores unset: the engine the benchmark times reads the
    last token's logits from llama.cpp's context instead, the same as the logits_all engine's last row."""
    _, _, ids, _ = confident
    if gguf_variants.unavailable_reason() is not None:  # the suite never needs the optional extra
        assert gguf_variants.unavailable_reason().startswith("llama-cpp-python is not installed")
        return
    path = gguf_export.write(hf_folder, tmp_path / "model-f16.gguf", "f16")
    fast = gguf_variants.LlamaCppEngine(path, 2, 64)
    full = gguf_variants.LlamaCppEngine(path, 2, 64, logits_all=True)
    for engine in (fast, full):
        engine.start(ids[:1, :8])
    np.testing.assert_allclose(fast.step(np.array([5])), full.step(np.array([5])), atol=1e-3)


def test_zero_points_defines_the_benchmark_and_float_ones_need_hqq(tmp_path):
    """An added result field: at its default the fingerprints are those of a config that never named it; float
    zero points move the benchmark's (another graph) and nothing upstream; rtn with float ones is refused when
    the config loads, in one line naming the field."""
    from llmpipe.config import from_dict
    from llmpipe.errors import ConfigError
    from llmpipe.stages import fingerprints

    base = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]},
            "benchmark": {"variants": ["fp32", "int4"]}}

    def with_int4(section):
        return fingerprints(from_dict({**base, "benchmark": {**base["benchmark"], "quantize": {"int4": section}}}))

    before = fingerprints(from_dict(base))
    assert with_int4({"zero_points": "integer"}) == before
    changed = with_int4({"zero_points": "float"})
    assert changed["benchmark"] != before["benchmark"] and changed["export_onnx"] == before["export_onnx"]
    with pytest.raises(ConfigError, match="zero_points"):
        from_dict({**base, "benchmark": {**base["benchmark"],
                                         "quantize": {"int4": {"algorithm": "rtn", "zero_points": "float"}}}})


def test_gguf_adapter_is_an_added_export_field_and_separate_needs_a_lora_run_and_a_4_bit_file(tmp_path):
    """export.gguf_adapter at its default leaves every fingerprint as a config that never named it; separate
    moves export_onnx's; without train.lora, or without a 4-bit type in export.gguf, the config is refused when
    it loads, in one line naming the field."""
    from llmpipe.config import from_dict
    from llmpipe.errors import ConfigError
    from llmpipe.stages import fingerprints

    base = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]}}
    lora = {**base, "train": {"lora": {"rank": 4}}}

    def export(tree, section):
        return from_dict({**tree, "export": section})

    before = fingerprints(export(lora, {"gguf": ["q4_1"]}))
    assert fingerprints(export(lora, {"gguf": ["q4_1"], "gguf_adapter": "merged"})) == before
    after = fingerprints(export(lora, {"gguf": ["q4_1"], "gguf_adapter": "separate"}))
    assert after["export_onnx"] != before["export_onnx"] and after["consolidate"] == before["consolidate"]
    with pytest.raises(ConfigError, match="export.gguf_adapter: separate needs a LoRA run"):
        export(base, {"gguf": ["q4_1"], "gguf_adapter": "separate"})
    with pytest.raises(ConfigError, match="export.gguf_adapter: separate applies to 4-bit files"):
        export(lora, {"gguf": ["q8_0"], "gguf_adapter": "separate"})


# ------------------------------------------------------------------ calibrated recipes (benchmarks/quant_recipes.py)


@pytest.fixture(scope="module")
def tied_hf(tmp_path_factory):
    """The debug model with its head tied to the embedding (as SmolLM2's), as a Hugging Face folder."""
    import dataclasses

    from llmpipe.data.tokenizer import train_tokenizer
    from llmpipe.export.fused import write_hf_folder

    model = Transformer(dataclasses.replace(FLAVORS["debug"], tie_embeddings=True))
    model.init_weights(seed=0)
    model.eval()
    text = ["def main(argv):\n    return len(argv) + 1\n" * 5, "import os\nprint(os.getcwd())\n" * 5]
    tok = train_tokenizer(text, vocab_size=model.args.vocab_size)
    return write_hf_folder(model, tmp_path_factory.mktemp("tied") / "hf", tok)


@pytest.fixture(scope="module")
def builder_fp32(tied_hf, tmp_path_factory):
    """benchmarks/quant_recipes.py and the builder's fp32 graph of the tied debug model (its reference)."""
    import sys

    from llmpipe.export import fused

    if fused.unavailable_reason():
        pytest.fail(fused.unavailable_reason())
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import quant_recipes

    hf_folder = tied_hf
    work = tmp_path_factory.mktemp("calibrated")
    fp32 = quant_recipes.build(quant_recipes.Recipe("fp32", "fp32", "builder", {"precision": "fp32"}), hf_folder,
                               work, None)
    ids = quant_recipes.text_windows(hf_folder / "tokenizer.json", 3, 24, 1234, calibration=False)
    return quant_recipes, work, fp32, ids, quant_recipes.OrtRunner(fp32, 2, 40).logits(ids)


def test_smoothquant_scales_leave_the_fp32_graph_unchanged_and_its_dynamic_int8_is_scored(builder_fp32, tied_hf):
    qr, work, fp32, ids, ref = builder_fp32
    hf_folder = tied_hf
    out = work / "smoothed"
    _config_files(fp32, out)
    qr.smooth(fp32, out / "model.onnx", hf_folder, 0.5, windows=2, seq=24)
    graph = onnx.load(str(out / "model.onnx")).graph
    # x / s went into the norms' weights (q/k/v, gate/up, the head), the up projections (down's input) and one
    # Mul per layer (o_proj's input, the attention's output)
    muls = [n for n in graph.node if n.name.endswith("_smooth")]
    assert len(muls) == 2 and all(n.op_type == "Mul" for n in muls)
    before = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(fp32 / "model.onnx")).graph.initializer}
    changed = [i.name for i in graph.initializer if i.name in before and
               not np.array_equal(onnx.numpy_helper.to_array(i), before[i.name])]
    assert any("layernorm" in n for n in changed) and any("up_proj" in n for n in changed), changed
    # the tied head's weight is also the embedding's table (a Transpose reads it): the head gets a scaled copy
    head = next(n for n in graph.node if n.op_type == "MatMul" and "lm_head" in n.name)
    assert "_smoothed" in head.input[1] and not any("lm_head" in n for n in changed), head.input
    # the same function in fp32 (measured max |diff| 1e-5 of logits spanning ~20)
    got = qr.OrtRunner(out, 2, 40).logits(ids)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), np.abs(got - ref).max()
    folder = qr.build(qr.Recipe("dyn8-channel-smooth", "int8", "dyn8", {"per_channel": True, "smooth": 0.5}),
                      hf_folder, work, fp32)
    assert any(n.op_type == "MatMulInteger" for n in onnx.load(str(folder / "model.onnx")).graph.node)
    m = quality.text_metrics(ids, ref, qr.OrtRunner(folder, 2, 40).logits(ids))
    assert all(np.isfinite(m[k]) for k in ("ppl", "kl", "top1")) and m["kl"] > 0, m


def test_gptq_quantises_the_projections_at_4_bits_keeps_the_head_at_8_and_is_scored(builder_fp32, tied_hf):
    qr, work, fp32, ids, ref = builder_fp32
    hf_folder = tied_hf
    folder = qr.build(qr.Recipe("gptq-b32-head8-acc4", "int4", "gptq", {"block_size": 32}), hf_folder, work, fp32)
    graph = onnx.load(str(folder / "model.onnx")).graph
    widths = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node
              if n.op_type == "MatMulNBits"}
    head = [n for n in widths if "lm_head" in n]
    assert len(head) == 1 and widths[head[0]] == 8, widths
    assert len(widths) == 1 + 2 * 5 and {w for n, w in widths.items() if n not in head} == {4}  # qkv, o, gate, up, down
    assert not any(n.op_type == "MatMul" and "proj" in n.name for n in graph.node)
    m = quality.text_metrics(ids, ref, qr.OrtRunner(folder, 2, 40).logits(ids))
    assert all(np.isfinite(m[k]) for k in ("ppl", "kl", "top1")) and m["kl"] > 0, m


def _config_files(src: Path, dst: Path) -> None:
    """The graph folder's files but the graph (genai_config.json and the tokenizer)."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.onnx", "model.onnx.data"))
