"""LoRA fine-tuning of a pretrained Hugging Face folder (model.init_from, the main use) under DDP, FSDP2
and ZeRO-3 on two gloo ranks: the base weights stay bitwise the pretrained ones, only the adapters
change and only they have optimizer state, a resumed run ends bitwise where the uninterrupted one does,
and consolidate's merged model gives the logits PEFT gives from the base plus the adapter folder (and
the benchmark's reading of the checkpoint, merged the same way)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpipe import stages
from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint import portable
from llmpipe.models.llama import hf
from llmpipe.models.llama.lora import is_adapter
from tests.integration.test_init_from import _config, _save_hf

pytestmark = pytest.mark.slow
LORA = {"rank": 4, "alpha": 8, "targets": ["wq", "wv", "wo", "w2"]}
LAYOUTS = {
    "ddp": {"parallel": {"data": "ddp"}},
    "fsdp": {"parallel": {"data": "fsdp"}},
    "zero3": {"parallel": {"data": "zero", "zero_stage": 3}},
}
# fp32 logits of the merged weights (W + s B A, rounded once) against PEFT's W x + s B (A x): equal to
# rounding, measured about 5e-7 on this model
PEFT_ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(layout, name=layout, **train) -> the config of a LoRA fine-tune of one tiny HF folder on 2
    ranks (4 steps, checkpoints at 2 and 4), trained and consolidated once per name."""
    root = tmp_path_factory.mktemp("lora")
    folder = _save_hf(root / "llama")
    done: dict[str, object] = {}

    def run(layout: str, name: str | None = None, **train):
        name = name or layout
        if name not in done:
            train = {"nproc_per_node": 2, "max_steps": 4, "lora": LORA, "optim": {"lr": 1e-2},
                     "checkpoint": {"every_steps": 2}, **LAYOUTS[layout], **train}
            cfg = _config(root, folder, name, **train)
            for s in ("prepare_data", "train", "consolidate"):
                stages.run_stage(s, cfg)
            done[name] = cfg
        return done[name]

    run.hf_folder = folder
    return run


def _checkpoint(cfg, step: int = 4) -> Path:
    return ckpt.step_dir(cfg.run_dir() / "02_train" / "checkpoints", step)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_trains_the_adapters_alone_and_leaves_the_pretrained_weights_bitwise(runs, layout):
    cfg = runs(layout)
    state = portable.read(_checkpoint(cfg))  # the layout-free reader: full tensors by llmpipe name
    args = hf.read_config(runs.hf_folder)[0]
    pretrained = hf.HFWeights(runs.hf_folder, args, tied=False)
    base = [n for n in state.model if not is_adapter(n)]
    adapters = [n for n in state.model if is_adapter(n)]
    assert len(adapters) == 2 * len(LORA["targets"]) * args.n_layers
    for name in base:
        assert torch.equal(state.model[name], pretrained.tensor(name)), name
    assert sorted(state.optim) == sorted(adapters)  # AdamW's moments: the adapters' alone
    assert all(state.model[n].abs().max() > 0 for n in adapters if ".lora_b." in n)  # B starts at zero


def test_a_resumed_lora_run_ends_bitwise_where_the_uninterrupted_one_does(runs):
    from llmpipe.checkpoint import portable

    ref = runs("ddp")
    resumed = runs("ddp", "resumed", checkpoint={"every_steps": 2, "resume": str(_checkpoint(ref, 2))})
    manifest = json.loads((resumed.run_dir() / "02_train" / "manifest.json").read_text())
    assert manifest["metrics"]["resumed_from"] == 2
    ra, rb = portable.read(_checkpoint(ref)), portable.read(_checkpoint(resumed))
    a, b = ra.model, rb.model
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = ra.optim, rb.optim
    assert oa.keys() == ob.keys() and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_merged_model_gives_the_logits_peft_gives_from_the_base_and_the_adapter(runs, layout):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from llmpipe.bench.quality import checkpoint_logits_model

    out = runs(layout).run_dir() / "03_consolidate"
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, [
        "down_proj", "o_proj", "q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == str(runs.hf_folder)
    x = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        merged = LlamaForCausalLM.from_pretrained(out / "hf").eval()(x).logits
        base = LlamaForCausalLM.from_pretrained(runs.hf_folder).eval()
        before = base(x).logits
        peft = PeftModel.from_pretrained(base, out / "adapter").eval()(x).logits
        checkpoint = checkpoint_logits_model(runs(layout).run_dir() / "02_train")(x)  # the benchmark's reference
    assert (merged - before).abs().max() > 1e-3  # the adapters moved the model
    torch.testing.assert_close(merged, peft, rtol=0, atol=PEFT_ATOL)
    torch.testing.assert_close(checkpoint, merged, rtol=0, atol=PEFT_ATOL)


def test_the_benchmark_keeps_the_adapter_apart_at_int4_from_consolidates_folders(runs, tmp_path):
    """benchmark.quantize.int4.adapter: separate on a fine-tune consolidate wrote (q, v, o and down adapted:
    the packed q/k/v node gets rows for q and v only): the stage finds the adapter in consolidate's manifest,
    and its int4 graph is the base quantised plus the adapter, which moves it toward the merged model as far
    as the adapter moved the base (KL to the merged fp32 graph at most half the base's int4; measured 5e-5 against
    7e-3),
    every zero point integer."""
    import onnx

    from llmpipe.bench import quality
    from llmpipe.bench.run import lora_adapter
    from llmpipe.config import QuantizeSection
    from llmpipe.export import fused
    from llmpipe.manifest import Manifest

    if fused.unavailable_reason():
        pytest.fail(fused.unavailable_reason())
    folder = runs("ddp").run_dir() / "03_consolidate"
    manifest = Manifest.load(folder)
    adapter = lora_adapter(folder, manifest)
    assert adapter == folder / "adapter"
    hf = manifest.path(folder, "hf/config.json").parent
    # blocks of 16: the tiny model's feed-forward (176) is whole blocks of 16, not of 32
    separate = QuantizeSection.model_validate({"int4": {"adapter": "separate", "block_size": 16}}).int4
    merged_int4 = QuantizeSection.model_validate({"int4": {"block_size": 16}}).int4
    graphs = {"separate": fused.build_weight_only(hf, tmp_path / "separate", separate, adapter_dir=adapter),
              "base": fused.build_weight_only(runs.hf_folder, tmp_path / "base", merged_int4),
              "fp32": fused.build(hf, tmp_path / "fp32", "fp32")}
    graph = onnx.load(str(graphs["separate"]), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    assert all(inits[n.input[3]].data_type == onnx.TensorProto.UINT8 for n in graph.node if n.op_type == "MatMulNBits")
    ids = np.random.default_rng(0).integers(1, 300, (4, 24))
    logits = {k: _graph_logits(p.parent, ids) for k, p in graphs.items()}
    kl = {k: quality.text_metrics(ids, logits["fp32"], logits[k])["kl"] for k in ("separate", "base")}
    assert kl["separate"] < 0.5 * kl["base"], kl


def _graph_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    from llmpipe import device
    from llmpipe.infer.fused import FusedEngine, GraphConfig
    from llmpipe.infer.ort import create_session

    session = create_session(folder / "model.onnx", device.ort_providers(["cpu"])[0], 2)
    return FusedEngine(session, GraphConfig.read(folder), 64).prompt(ids)


def test_export_writes_a_lora_runs_4_bit_gguf_from_its_base_with_the_adapter_beside_it(runs, tmp_path):
    """export.gguf_adapter: separate: the q4_1 file is the base the fine-tune came from (its tensors nearer the
    pretrained folder's than the merged ones), gguf/adapter.lora.gguf carries one A and B per adapted projection,
    the q8_0 file stays merged, and no base.partial folder is left; a separate adapter without adapter/ is one
    line naming the field, before any file."""
    import shutil
    from types import SimpleNamespace

    import gguf
    from safetensors.numpy import load_file

    from llmpipe.config import ExportSection
    from llmpipe.errors import StageError
    from llmpipe.export import gguf as gguf_export
    from llmpipe.export.onnx import _gguf_adapter, _gguf_files
    from llmpipe.manifest import Manifest

    folder = runs("ddp").run_dir() / "03_consolidate"
    manifest = Manifest.load(folder)
    hf_dir = tmp_path / "hf"  # consolidate's hf/ without the fixture's Llama-3 rope_scaling (GGUF refuses it)
    shutil.copytree(manifest.path(folder, "hf/config.json").parent, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_scaling", None)
    (hf_dir / "config.json").write_text(json.dumps(config))
    ctx_dir = tmp_path / "export"
    ctx_dir.mkdir()
    section = ExportSection.model_validate({"gguf": ["q8_0", "q4_1"], "gguf_adapter": "separate"})
    ctx = SimpleNamespace(cfg=SimpleNamespace(export=section, run=SimpleNamespace(name="t")),
                          inputs={"consolidate": (folder, manifest)}, work_dir=ctx_dir)
    out = _gguf_files(ctx, hf_dir)
    assert out == {"gguf_q8_0": "gguf/model-q8_0.gguf", "gguf_q4_1": "gguf/model-q4_1.gguf",
                   "lora_gguf": "gguf/adapter.lora.gguf"}
    assert sorted(p.name for p in (ctx_dir / "gguf").iterdir()) == sorted(Path(p).name for p in out.values())
    lora = {t.name for t in gguf.GGUFReader(ctx_dir / "gguf" / "adapter.lora.gguf").tensors}
    assert len(lora) == 2 * len(LORA["targets"]) * hf.read_config(runs.hf_folder)[0].n_layers
    base = {k: v for f in sorted(runs.hf_folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    merged = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    q41 = {t.name: t for t in gguf.GGUFReader(ctx_dir / "gguf" / "model-q4_1.gguf").tensors}
    q80 = {t.name: t for t in gguf.GGUFReader(ctx_dir / "gguf" / "model-q8_0.gguf").tensors}
    key = "model.layers.0.self_attn.v_proj.weight"  # adapted, not permuted
    assert q41[gguf_export.gguf_name(key)].tensor_type == gguf.GGMLQuantizationType.Q4_1

    def back(t):
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(merged[key].shape)

    delta = float(np.abs(merged[key] - base[key]).mean())
    assert delta > 0  # the fine-tune moved this projection
    assert np.abs(back(q80[gguf_export.gguf_name(key)]) - merged[key]).mean() < 0.5 * delta  # q8_0: merged
    w = back(q41[gguf_export.gguf_name(key)])
    assert np.abs(w - base[key]).mean() < np.abs(w - merged[key]).mean()  # q4_1: the base
    no_adapter = SimpleNamespace(outputs={k: v for k, v in manifest.outputs.items() if not k.startswith("adapter/")})
    ctx.inputs = {"consolidate": (folder, no_adapter)}
    with pytest.raises(StageError, match="export.gguf_adapter: separate, but consolidate wrote no LoRA adapter"):
        _gguf_adapter(ctx)
