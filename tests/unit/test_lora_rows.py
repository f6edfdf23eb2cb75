"""llmpipe.infer.lora_rows: a LoRA adapter kept apart from its 4-bit base, appended as rows of the folded
MatMulNBits nodes. Checked against the adapter's exact product on a graph named as the builder names its
projections (packed q/k/v, gate and up reading one input, down), PEFT's files read as untrusted input, and
the base taken back out of merged weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

from llmpipe.infer import fold, lora_rows, native
from llmpipe.infer.ort import _nbits
from tests.conftest import as_layout_1

H, F, R, SCALE = 256, 128, 8, 2.0  # hidden, feed-forward, rank, alpha / r
OUTS = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "gate_proj": F, "up_proj": F, "down_proj": H}
INS = {"q_proj": H, "k_proj": H, "v_proj": H, "gate_proj": H, "up_proj": H, "down_proj": F}


def _graph(seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One layer's weight MatMuls as the builder names them: qkv packed over `x`, gate and up over `m`, down
    over `h`; the weights fp32."""
    rng = np.random.default_rng(seed)
    w = {mod: (rng.standard_normal((INS[mod], n)) * 0.05).astype(np.float32) for mod, n in OUTS.items()}
    qkv = np.concatenate([w["q_proj"], w["k_proj"], w["v_proj"]], axis=1)
    spec = [("x", H, "/model/layers.0/attn/qkv_proj/MatMul", qkv, "qkv"),
            ("m", H, "/model/layers.0/mlp/gate_proj/MatMul", w["gate_proj"], "gate"),
            ("m", H, "/model/layers.0/mlp/up_proj/MatMul", w["up_proj"], "up"),
            ("h", F, "/model/layers.0/mlp/down_proj/MatMul", w["down_proj"], "down")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", k])
              for n, k in (("x", H), ("m", H), ("h", F))]
    nodes, outputs, inits = [], [], []
    for x, _, name, weight, out in spec:
        inits.append(numpy_helper.from_array(weight, out + "_W"))
        nodes.append(helper.make_node("MatMul", [x, out + "_W"], [out], name=name))
        outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, ["b", "s", weight.shape[1]]))
    graph = helper.make_graph(nodes, "layer", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def _adapter(folder: Path, step: float, seed: int = 1, modules=tuple(OUTS), **config) -> dict:
    """A PEFT folder of `modules` whose product s B A has entries of about `step` (std); returns module -> (A, B)."""
    rng = np.random.default_rng(seed)
    tensors, out = {}, {}
    for mod in modules:
        a = (rng.standard_normal((R, INS[mod])) / np.sqrt(INS[mod])).astype(np.float32)
        # s B A's entries: s sigma_B sqrt(R) / sqrt(in) = step
        b = (rng.standard_normal((OUTS[mod], R)) * step * np.sqrt(INS[mod]) / (SCALE * np.sqrt(R))).astype(np.float32)
        parent = "self_attn" if mod[0] in "qkv" else "mlp"
        tensors[f"base_model.model.model.layers.0.{parent}.{mod}.lora_A.weight"] = a
        tensors[f"base_model.model.model.layers.0.{parent}.{mod}.lora_B.weight"] = b
        out[mod] = (a, b)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / lora_rows.WEIGHTS))
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": SCALE * R, "target_modules": list(modules), **config}
    (folder / lora_rows.CONFIG).write_text(json.dumps(cfg))
    return out


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def _folded(model: onnx.ModelProto) -> onnx.ModelProto:
    out = _nbits(copy.deepcopy(model), 4, 32, 4, False, "hqq")
    assert fold.fold_model(out) == 4
    return out


@pytest.mark.parametrize("modules", [tuple(OUTS), ("q_proj", "v_proj", "up_proj")])
def test_the_appended_rows_compute_the_adapters_product(tmp_path, modules):
    """The attached graph minus the folded base is x A^T (s B^T) for every module, to within a tenth of the
    product itself (the rows' own 4-bit rounding), while the product is below a 4-bit step of the base; a
    module the adapter leaves alone (PEFT's default targets q and v only) gets nothing; one MatMul per
    distinct input the adapter reads is added and every zero point stays integer (the fast kernel)."""
    model, w = _graph()
    step = float(np.median([np.ptp(v[:32], axis=0).mean() for v in w.values()])) / 15  # a typical 4-bit step
    ab = _adapter(tmp_path / "adapter", 0.3 * step, modules=modules)
    base = _folded(model)
    attached = copy.deepcopy(base)
    changed = lora_rows.attach(attached, lora_rows.Adapter.read(tmp_path / "adapter"))
    assert changed == (4 if len(modules) == 6 else 3)  # qkv, gate (zero rows: it reads up's input) and up
    rng = np.random.default_rng(2)
    feeds = {n: rng.standard_normal((2, 3, k)).astype(np.float32) for n, k in (("x", H), ("m", H), ("h", F))}
    got = [a - b for a, b in zip(_run(attached, feeds), _run(base, feeds))]

    def product(x, mods):
        return np.concatenate([feeds[x] @ (SCALE * ab[m][1] @ ab[m][0]).T if m in ab else
                               np.zeros((2, 3, OUTS[m]), np.float32) for m in mods], axis=-1)

    want = [product("x", ["q_proj", "k_proj", "v_proj"]), product("m", ["gate_proj"]), product("m", ["up_proj"]),
            product("h", ["down_proj"])]
    for g, t, name in zip(got, want, ["qkv", "gate", "up", "down"]):
        if not t.any():  # a module the adapter leaves alone: zero rows, its outputs as they were
            assert name in ("gate", "down") and np.abs(g).max() < 1e-5, name
            continue
        err = np.linalg.norm(g - t) / np.linalg.norm(t)
        assert err < 0.1, (name, err)
    ops = [n.op_type for n in attached.graph.node]
    assert ops.count("MatMul") == (3 if len(modules) == 6 else 2)  # x A^T for each input an adapted module reads
    inits = {t.name: t for t in attached.graph.initializer}
    assert all(inits[n.input[3]].data_type == TensorProto.UINT8
               for n in attached.graph.node if n.op_type == "MatMulNBits")


@pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))
def test_the_rows_on_float_zero_points_compute_the_product_on_llmpipes_kernel(tmp_path):
    """kernel llmpipe: the unfolded HQQ nodes (float zero points) read a new concat(x, x A^T), the rows after
    the base's blocks with float zero points like the base's; swapped into llmpipe.Q4Gemv, the graph minus the
    unadapted one is the adapter's product to within a tenth of it, as on the folded nodes."""
    model, w = _graph()
    step = float(np.median([np.ptp(v[:32], axis=0).mean() for v in w.values()])) / 15
    ab = _adapter(tmp_path / "adapter", 0.3 * step)
    base = _nbits(copy.deepcopy(model), 4, 32, 4, False, "hqq")
    attached = copy.deepcopy(base)
    assert lora_rows.attach(attached, lora_rows.Adapter.read(tmp_path / "adapter")) == 4
    inits = {t.name: t for t in attached.graph.initializer}
    assert all(inits[n.input[3]].data_type == TensorProto.FLOAT
               for n in attached.graph.node if n.op_type == "MatMulNBits")
    assert [n.op_type for n in attached.graph.node].count("Concat") == 3  # one per input an adapted module reads
    # the x A^T MatMuls at 8 bits, as quantize_weight_only puts them
    attached = _nbits(attached, 8, 32, 4, False, "rtn",
                      include=[n.name for n in attached.graph.node if n.name.endswith(lora_rows.A_SUFFIX)])
    unfused = copy.deepcopy(attached)
    assert native.swap_model(base) == 4
    assert native.swap_model(attached) == 4 + 3
    # each adapted input's x A^T and concat went into its readers' optional inputs (gate and up share theirs:
    # both take it), no MatMul and no Concat left
    assert [n.op_type for n in attached.graph.node] == ["Q4Gemv"] * 4
    assert [len(n.input) for n in attached.graph.node] == [7] * 4
    # the op computes only the adapter's rows before their padding to a block: rank 8 per module, so qkv 24 of
    # 32, gate / up 16 of 32 (both modules' A side by side), down 8 of 32
    rows_a = [next(a.i for a in n.attribute if a.name == "rows_a") for n in attached.graph.node]
    assert rows_a == [24, 16, 16, 8]
    fuse = native._fuse_adapters
    native._fuse_adapters = lambda graph: 0  # the same rows as separate nodes, for comparison
    try:
        assert native.swap_model(unfused) == 4 + 3
    finally:
        native._fuse_adapters = fuse
    assert [n.op_type for n in unfused.graph.node].count("Concat") == 3
    rng = np.random.default_rng(2)
    feeds = {n: rng.standard_normal((2, 3, k)).astype(np.float32) for n, k in (("x", H), ("m", H), ("h", F))}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.register_custom_ops_library(str(native.library()))

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)

    got = [a - b for a, b in zip(run(attached), run(base))]
    for f, u in zip(run(attached), run(unfused)):
        assert np.abs(f - u).max() / np.abs(u).max() < 1e-2
    older = copy.deepcopy(attached)  # the same graph as an older llmpipe wrote it: its adapter's inputs too
    assert as_layout_1(older) == 4
    for f, o in zip(run(attached), run(older)):
        np.testing.assert_array_equal(f, o)

    def product(x, mods):
        return np.concatenate([feeds[x] @ (SCALE * ab[m][1] @ ab[m][0]).T for m in mods], axis=-1)

    want = [product("x", ["q_proj", "k_proj", "v_proj"]), product("m", ["gate_proj"]), product("m", ["up_proj"]),
            product("h", ["down_proj"])]
    for g, t, name in zip(got, want, ["qkv", "gate", "up", "down"]):
        err = np.linalg.norm(g - t) / np.linalg.norm(t)
        assert err < 0.1, (name, err)


def test_the_base_comes_back_out_of_the_merged_weights(tmp_path):
    """write_base: merged (W + s B A) minus the adapter's product is W (fp32 rounding), the other tensors and
    files as they were, a symlink not followed."""
    rng = np.random.default_rng(3)
    ab = _adapter(tmp_path / "adapter", 0.01)
    hf = tmp_path / "hf"
    hf.mkdir()
    base, merged = {}, {}
    for mod, (a, b) in ab.items():
        parent = "self_attn" if mod[0] in "qkv" else "mlp"
        key = f"model.layers.0.{parent}.{mod}.weight"
        base[key] = rng.standard_normal((OUTS[mod], INS[mod])).astype(np.float32)
        merged[key] = base[key] + SCALE * b @ a
    base["model.norm.weight"] = merged["model.norm.weight"] = np.ones(H, np.float32)
    save_file(merged, str(hf / "model.safetensors"))
    (hf / "config.json").write_text("{}")
    (tmp_path / "secret").write_text("outside")
    (hf / "link.json").symlink_to(tmp_path / "secret")
    out = lora_rows.write_base(hf, lora_rows.Adapter.read(tmp_path / "adapter"), tmp_path / "base")
    from safetensors.numpy import load_file

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(base)
    for key in base:
        np.testing.assert_allclose(got[key], base[key], atol=1e-6)
    assert (out / "config.json").read_text() == "{}" and not (out / "link.json").exists()


def _corrupt(folder: Path, how: str) -> str:
    """Damages the adapter folder one way; returns what the one-line error must say."""
    weights = folder / lora_rows.WEIGHTS
    cfg = json.loads((folder / lora_rows.CONFIG).read_text())
    if how in ("peft_type", "use_dora"):
        cfg.update({"peft_type": "IA3"} if how == "peft_type" else {"use_dora": True})
        (folder / lora_rows.CONFIG).write_text(json.dumps(cfg))
        return how
    from safetensors.numpy import load_file

    t = load_file(str(weights))
    key = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    if how == "missing":
        del t[key]
        want = "lora_B missing"
    elif how == "rank":
        t[key] = t[key][:, :R - 1].copy()
        want = "rank"
    elif how == "foreign":
        t["base_model.model.lm_head.lora_A.weight"] = np.zeros((R, H), np.float32)
        want = "not a LoRA weight"
    elif how == "layer":
        t["base_model.model.model.layers.5.mlp.up_proj.lora_A.weight"] = np.zeros((R, H), np.float32)
        t["base_model.model.model.layers.5.mlp.up_proj.lora_B.weight"] = np.zeros((F, R), np.float32)
        want = "has no 4-bit node in the graph"
    else:  # bytes that are not safetensors
        weights.write_bytes(b"\x80\x04pickle")
        return "not a readable safetensors"
    save_file(t, str(weights))
    return want


@pytest.mark.parametrize("how", ["peft_type", "use_dora", "missing", "rank", "foreign", "layer", "bytes"])
def test_a_bad_adapter_is_one_clear_line_and_the_graph_is_untouched(tmp_path, how):
    model, _ = _graph()
    _adapter(tmp_path / "adapter", 0.01)
    want = _corrupt(tmp_path / "adapter", how)
    base = _folded(model)
    before = base.SerializeToString()
    with pytest.raises(lora_rows.AdapterError, match=want) as err:
        lora_rows.attach(base, lora_rows.Adapter.read(tmp_path / "adapter"))
    assert "\n" not in str(err.value)
    assert base.SerializeToString() == before


def test_the_adapter_field_is_a_lora_runs_and_a_folded_int4s(tmp_path):
    """benchmark.quantize.<v>.adapter: at its default the fingerprints are those of a config that never named
    it; separate moves the benchmark's only; refused when the config loads without train.lora or with a
    recipe that has no folded 4-bit nodes, in one line naming the field."""
    from llmpipe.config import from_dict
    from llmpipe.errors import ConfigError
    from llmpipe.stages import fingerprints

    base = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]},
            "train": {"lora": {"rank": 8}}, "export": {"ort_graph": True}, "consolidate": {"hf_layout": True},
            "benchmark": {"variants": ["fp32", "int4"]}}

    def with_int4(section, cfg=base):
        return from_dict({**cfg, "benchmark": {**cfg["benchmark"], "quantize": {"int4": section}}})

    before = fingerprints(from_dict(base))
    assert fingerprints(with_int4({"adapter": "merged"})) == before
    changed = fingerprints(with_int4({"adapter": "separate"}))
    assert changed["benchmark"] != before["benchmark"]
    assert all(changed[s] == before[s] for s in before if s not in ("benchmark", "evaluate"))
    with pytest.raises(ConfigError, match="adapter") as err:
        with_int4({"adapter": "separate"}, {k: v for k, v in base.items() if k != "train"})
    assert "train.lora" in str(err.value)
    with pytest.raises(ConfigError, match="adapter=separate"):
        with_int4({"adapter": "separate", "algorithm": "rtn"})


def test_a_separate_adapter_the_model_or_the_export_cannot_hold_is_refused_when_the_config_loads(tmp_path):
    """Before any work: the separate adapter is the ORT-optimised graph's (export.ort_graph), and the fold
    needs each projection's input in whole blocks (the debug flavor's feed-forward, 176, is not whole blocks of
    32); one line naming the field."""
    from llmpipe.config import from_dict
    from llmpipe.errors import ConfigError

    cfg = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]},
           "model": {"flavor": "debug"}, "train": {"lora": {"rank": 8}},
           "benchmark": {"variants": ["fp32", "int4"], "quantize": {"int4": {"adapter": "separate"}}}}
    with pytest.raises(ConfigError, match=r"benchmark.quantize.int4.adapter: separate is the ORT-optimised") as err:
        from_dict(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"whole blocks of 32; the model has ffn_dim="):
        from_dict({**cfg, "export": {"ort_graph": True}, "consolidate": {"hf_layout": True}})


@pytest.mark.parametrize("packed", [False, True])
def test_the_portable_graphs_get_the_base_back_from_the_merged_weights_and_the_adapter_as_rows(tmp_path, packed):
    """llmpipe's portable graphs are of the merged weights and do not name their layers: make_variants (the
    benchmark's int4 of them, adapter separate) finds each adapted projection by its merged weight's bytes in
    consolidate's hf/ (packed: q/k/v and gate/up side by side in one MatMul, as the static decoder has them),
    takes s B A off, quantises the base and appends the adapter. Its outputs minus those of the base's own
    int4 are the adapter's product, to within a tenth of it (as above)."""
    from safetensors.numpy import save_file as save

    from llmpipe.config import QuantizeSection
    from llmpipe.infer.ort import make_variants

    _, w = _graph()
    step = float(np.median([np.ptp(v[:32], axis=0).mean() for v in w.values()])) / 15  # a typical 4-bit step
    ab = _adapter(tmp_path / "adapter", 0.3 * step)
    # node -> (its input, the modules side by side in its weight)
    names = {"/MatMul": ("x", ("q_proj", "k_proj", "v_proj")), "/MatMul_5": ("m", ("gate_proj", "up_proj")),
             "/w2/MatMul": ("h", ("down_proj",))} if packed else {
        "/wq/MatMul": ("x", ("q_proj",)), "/wk/MatMul": ("x", ("k_proj",)), "/wv/MatMul": ("x", ("v_proj",)),
        "/feed_forward/w1/MatMul": ("m", ("gate_proj",)), "/feed_forward/w3/MatMul": ("m", ("up_proj",)),
        "/feed_forward/w2/MatMul": ("h", ("down_proj",))}

    def portable(weights: dict[str, np.ndarray], path: Path) -> Path:
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", k]) for n, k in
                  (("x", H), ("m", H), ("h", F))]
        nodes, outputs, inits = [], [], []
        for i, (name, (x, mods)) in enumerate(names.items()):
            weight = np.concatenate([weights[m] for m in mods], axis=1)
            inits.append(numpy_helper.from_array(weight, f"onnx::MatMul_{i}"))
            nodes.append(helper.make_node("MatMul", [x, f"onnx::MatMul_{i}"], [f"y{i}"], name=name))
            outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["b", "s", weight.shape[1]]))
        graph = helper.make_graph(nodes, "portable", inputs, outputs, inits)
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return path

    merged = {m: (w[m] + (SCALE * ab[m][1] @ ab[m][0]).T).astype(np.float32) for m in OUTS}
    hf = tmp_path / "hf"
    hf.mkdir()
    save({f"model.layers.0.{'self_attn' if m[0] in 'qkv' else 'mlp'}.{m}.weight": np.ascontiguousarray(merged[m].T)
          for m in OUTS}, str(hf / "model.safetensors"))
    separate = QuantizeSection.model_validate({"int4": {"adapter": "separate", "head_bits": None}})
    plain = QuantizeSection.model_validate({"int4": {"head_bits": None}})
    got = make_variants(portable(merged, tmp_path / "merged.onnx"), ["int4"], tmp_path / "sep", quantize=separate,
                        lora=(hf, tmp_path / "adapter"))["int4"]
    base = make_variants(portable(w, tmp_path / "base.onnx"), ["int4"], tmp_path / "base", quantize=plain)["int4"]
    assert got.path is not None and base.path is not None, (got.error, base.error)
    rng = np.random.default_rng(2)
    feeds = {n: rng.standard_normal((2, 3, k)).astype(np.float32) for n, k in (("x", H), ("m", H), ("h", F))}
    out = [a - b for a, b in zip(_run(onnx.load(str(got.path)), feeds), _run(onnx.load(str(base.path)), feeds))]
    for (name, (x, mods)), diff in zip(names.items(), out):
        want = np.concatenate([feeds[x] @ (SCALE * ab[m][1] @ ab[m][0]).T for m in mods], axis=-1)
        err = np.linalg.norm(diff - want) / np.linalg.norm(want)
        assert err < 0.1, (name, err)


def test_a_lora_runs_rejected_merged_int4_says_what_keeps_the_fine_tune(tmp_path):
    """The benchmark's note when int4 of the merged weights is rejected on a LoRA run names the setting that
    keeps the adapter apart; none once it is set, for a full fine-tune, or when int4 passed."""
    from llmpipe.bench.run import lora_hint
    from llmpipe.config import from_dict

    cfg = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]},
           "train": {"lora": {"rank": 8}}, "export": {"ort_graph": True}, "consolidate": {"hf_layout": True},
           "benchmark": {"variants": ["fp32", "int4"]}}
    assert "benchmark.quantize.int4.adapter: separate" in lora_hint(from_dict(cfg), ["int4"])
    assert lora_hint(from_dict(cfg), ["int8"]) is None
    assert lora_hint(from_dict({k: v for k, v in cfg.items() if k != "train"}), ["int4"]) is None
    separate = {**cfg, "benchmark": {**cfg["benchmark"], "quantize": {"int4": {"adapter": "separate"}}}}
    assert lora_hint(from_dict(separate), ["int4"]) is None
