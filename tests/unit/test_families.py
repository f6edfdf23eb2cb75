"""The families users bring (Qwen2, Qwen3, Llama tied with llama3 RoPE, Mistral) as small random models that
transformers itself makes: llmpipe reads them, computes transformers' logits, writes them back as the same
model, and its exported graphs decode transformers' tokens; what it does not compute the same way is refused
with one line naming the field and value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from safetensors.torch import save_file

from llmpipe.checkpoint import consolidate as cons
from llmpipe.checkpoint import io as ckpt
from llmpipe.export import onnx as export
from llmpipe.infer.decode import StaticEngine
from llmpipe.models import adapters
from llmpipe.models.llama import hf
from llmpipe.models.llama.flavors import FLAVORS
from llmpipe.models.llama.model import Transformer

V, MAXPOS = 96, 64
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=V, max_position_embeddings=MAXPOS, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# family -> (transformers config class, its settings beyond COMMON, what llmpipe reads them as)
FAMILIES = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False, sliding_window=8,
                                  rope_theta=1e6), dict(attn_bias=True, tie_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False, rope_theta=1e6),
              dict(qk_norm=True, head_dim=32)),
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=5e5, rope_scaling=LLAMA3,
                                  eos_token_id=[2, 3]), dict(tie_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=MAXPOS, rope_theta=1e4), dict()),
}


def _config(family: str, **changes):
    name, extra, _ = FAMILIES[family]
    settings = {**COMMON, **extra, **changes}
    if "rope_scaling" in settings and transformers.__version__.startswith("5"):
        # transformers 5 spells RoPE as rope_parameters (theta inside); its config.json then reads so too
        settings["rope_parameters"] = {**settings.pop("rope_scaling"), "rope_theta": settings.pop("rope_theta")}
    return getattr(transformers, name)(**settings)


def _save(family: str, folder: Path, **changes) -> tuple[Path, torch.nn.Module]:
    """A random transformers model of `family` saved into `folder`; its weights drawn wider than
    transformers' init (std 0.02 makes near-uniform logits, where greedy ties would make token checks moot)."""
    torch.manual_seed(len(family))
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **changes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder, model = _save(request.param, tmp_path_factory.mktemp(request.param) / "src")
    args, _ = hf.read_config(folder)
    with torch.device("meta"):
        mine = Transformer(args)
    mine.to_empty(device="cpu")
    mine.init_weights(source=hf.pretrained(type("S", (), {"init_from": str(folder), "max_seq_len": None}), args))
    return request.param, folder, model, mine.eval()


IDS = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(0))  # past original_max_position


def test_each_family_reads_as_the_decoder_options_it_has(family):
    name, folder, source, mine = family
    expected = {"attn_bias": False, "qk_norm": False, "tie_embeddings": False, "head_dim": 16,
                **FAMILIES[name][2]}
    assert {k: getattr(mine.args, k) for k in expected} == expected
    assert sum(p.numel() for p in mine.parameters()) == source.num_parameters() == mine.args.num_params()
    assert (mine.output.weight is mine.tok_embeddings.weight) == expected["tie_embeddings"]
    assert hf.param_shapes(mine.args) == {n: tuple(p.shape) for n, p in mine.named_parameters()}


def test_llmpipe_logits_equal_transformers_on_the_source_within_1e_5(family):
    _, _, source, mine = family
    with torch.no_grad():
        torch.testing.assert_close(mine(IDS), source(IDS).logits, rtol=0, atol=1e-5)
        cached, past = mine.forward_cached(IDS[:, :25])  # and the cached path the exports decode with
        rest, _ = mine.forward_cached(IDS[:, 25:], past)
        torch.testing.assert_close(torch.cat([cached, rest], 1), source(IDS).logits, rtol=0, atol=1e-5)


def test_the_hf_folder_llmpipe_writes_loads_as_the_same_class_with_the_same_parameters(family, tmp_path):
    name, folder, source, mine = family
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    state = {k: v.contiguous() for k, v in mine.state_dict().items()}
    if mine.args.tie_embeddings:  # a checkpoint that carries the head anyway (hf/ must still leave it out)
        assert "output.weight" not in state
        state["output.weight"] = state["tok_embeddings.weight"].clone()
    save_file(state, checkpoint / ckpt.MODEL)
    out = tmp_path / "hf"
    out.mkdir()
    cons.consolidate(checkpoint, out, "fp32", rename=hf.to_hf_name, transform=cons.hf_transform(mine.args, None))
    config = cons.hf_config_json(mine.args, "fp32", eos_id=0, init_from=str(folder))
    (out / "config.json").write_text(json.dumps(config))
    src = json.loads((folder / "config.json").read_text())
    for key in ("architectures", "model_type", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert config[key] == src[key], key
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(source)
    assert back.num_parameters() == source.num_parameters()
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, source(IDS).logits, rtol=0, atol=1e-5)


def _hf_greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    seq = torch.from_numpy(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1]:].numpy()


def _greedy(engine, prompt: np.ndarray, n: int) -> np.ndarray:
    tokens = [engine.start(prompt).argmax(-1)]
    for _ in range(n - 1):
        tokens.append(engine.step(tokens[-1]).argmax(-1))
    return np.stack(tokens, axis=1)


def test_the_exported_graphs_decode_transformers_greedy_tokens_in_standard_ops(family, tmp_path):
    name, _, source, mine = family
    length, opset = 32, 17
    export.export_prefill(mine, tmp_path / "model.onnx", opset)
    export.export_static_decoder(mine, tmp_path / "decoder_static.onnx", opset, length)
    graphs = ["model.onnx", "decoder_static.onnx"]
    if name == "qwen3":  # the KV-cache decoder too, on the family with the most options (qk-norm, head_dim)
        export.export_decoder(mine, tmp_path / "decoder.onnx", opset)
        graphs.append("decoder.onnx")
    for g in graphs:  # what ATC reads: the default domain at opset <= 18, no contrib (com.microsoft) op
        proto = onnx.load(str(tmp_path / g), load_external_data=False)
        assert {o.domain for o in proto.opset_import} <= {"", "ai.onnx"}, g
        assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}, g
        assert max(o.version for o in proto.opset_import) <= 18, g

    def session(g):
        return ort.InferenceSession(str(tmp_path / g), providers=["CPUExecutionProvider"])

    prompt = IDS[:, :8].numpy()
    want = _hf_greedy(source, prompt, 12)
    assert (_greedy(StaticEngine(session("model.onnx"), session("decoder_static.onnx"), mine.args, length),
                    prompt, 12) == want).all()
    if name == "qwen3":  # the prefill's cache, then decoder.onnx one token at a time over the growing cache
        prefill, decoder = session("model.onnx"), session("decoder.onnx")
        out = prefill.run(None, {"input_ids": prompt})
        past = [i.name for i in decoder.get_inputs() if i.name != "input_ids"]
        tokens = []
        for _ in range(12):
            tokens.append(out[0][:, -1].argmax(-1))
            out = decoder.run(None, {"input_ids": tokens[-1][:, None], **dict(zip(past, out[1:]))})
        assert (np.stack(tokens, axis=1) == want).all()


def _config_json(name: str) -> dict:
    """config.json as save_pretrained writes it (with the architecture), without building the model."""
    arch = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral"}[name] + "ForCausalLM"
    return {**json.loads(_config(name).to_json_string()), "architectures": [arch]}


def _edited(folder: Path, tmp_path: Path, **changes) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    c = json.loads((copy / "config.json").read_text())
    c.update(changes)
    (copy / "config.json").write_text(json.dumps(c))
    return copy


REFUSALS = [
    # transformers 4's spelling (no layer_types): use_sliding_window and a layer at or past max_window_layers
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0, layer_types=None),
     "sliding_window: 8 (use_sliding_window: true) is shorter than the model's max_seq_len 64, and llmpipe's "
     "attention is full; set model.max_seq_len to at most 8"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
     "sliding_window: 8 (layer_types: sliding_attention) is shorter than the model's max_seq_len 64, and llmpipe's "
     "attention is full; set model.max_seq_len to at most 8"),
    ("mistral", dict(sliding_window=32),
     "sliding_window: 32 is shorter than the model's max_seq_len 64, and llmpipe's attention is full; set "
     "model.max_seq_len to at most 32"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act: 'gelu' is not supported (llmpipe's Qwen3ForCausalLM has 'silu')"),
    ("qwen3", dict(attention_bias=True),
     "attention_bias: True is not supported (llmpipe's Qwen3ForCausalLM has False)"),
    ("llama", dict(mlp_bias=True), "mlp_bias: True is not supported (llmpipe's LlamaForCausalLM has False)"),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
     "rope_scaling.rope_type: 'yarn' is not supported (default or llama3)"),
    ("llama", dict(partial_rotary_factor=0.5),
     "partial_rotary_factor: 0.5 is not supported (llmpipe rotates the whole head, 1.0)"),
    ("qwen2", dict(eos_token_id=[2, 500]), "eos_token_id: 500 is outside the vocabulary (0..95)"),
    ("qwen2", dict(architectures=["Qwen2MoeForCausalLM"]),
     "architectures: ['Qwen2MoeForCausalLM'] is not supported (LlamaForCausalLM, MistralForCausalLM, "
     "Qwen2ForCausalLM, Qwen3ForCausalLM)"),
]


@pytest.mark.parametrize("name,changes,line", REFUSALS, ids=[f"{r[0]}-{next(iter(r[1]))}" for r in REFUSALS])
def test_what_a_family_computes_otherwise_is_refused_in_one_line_naming_field_and_value(name, changes, line,
                                                                                       tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(_config_json(name)))
    folder = _edited(source, tmp_path, **changes)
    with pytest.raises(hf.HFFolderError) as err:
        hf.read_config(folder)
    assert str(err.value) == f"{folder / 'config.json'}: {line}"


def test_a_window_that_takes_no_effect_is_read(tmp_path):
    """Qwen's shipped configs carry sliding_window with use_sliding_window: false; Mistral's window at least the
    sequences used (model.max_seq_len) is full attention."""
    for name, changes, max_len in (("qwen2", dict(use_sliding_window=False, sliding_window=8), None),
                                   ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                                                  layer_types=None), None),
                                   ("mistral", dict(sliding_window=32), 32)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**_config_json(name), **changes}))
        assert hf.read_config(folder, max_len)[0].max_seq_len == (max_len or MAXPOS)


def test_the_named_flavors_have_the_published_sizes():
    millions = {k: round(FLAVORS[k].num_params() / 1e6, 1) for k in
                ("qwen3-0.6b", "qwen3-8b", "qwen2.5-0.5b", "qwen2.5-7b", "llama3.2-1b", "smollm2-135m")}
    assert millions == {"qwen3-0.6b": 596.0, "qwen3-8b": 8190.7, "qwen2.5-0.5b": 494.0, "qwen2.5-7b": 7615.6,
                        "llama3.2-1b": 1235.8, "smollm2-135m": 134.5}
    assert adapters.for_args(FLAVORS["qwen3-4b"]).architecture == "Qwen3ForCausalLM"
    assert adapters.for_args(FLAVORS["qwen2.5-3b"]).architecture == "Qwen2ForCausalLM"
    assert adapters.for_args(FLAVORS["smollm2-360m"]).architecture == "LlamaForCausalLM"


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(V - 1)} | {"<|endoftext|>": V - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))


def test_a_qwen_folder_is_checked_at_config_load_and_a_window_in_effect_refused_there(tmp_path):
    from llmpipe import config as config_mod

    folder, _ = _save("qwen2", tmp_path / "qwen2")
    _tokenizer(folder)
    tree = {"run": {"artifacts_dir": str(tmp_path / "a")}, "data": {"inputs": ["x/*.txt"], "seq_len": 32},
            "model": {"init_from": str(folder)}}
    assert config_mod.from_dict(tree).model.init_from == str(folder)  # config.json and weight headers read
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "use_sliding_window": True, "sliding_window": 8,
                                                    "max_window_layers": 0, "layer_types": None}))
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.from_dict(tree)
    assert str(err.value).endswith(f"model.init_from: {folder / 'config.json'}: sliding_window: 8 "
                                   "(use_sliding_window: true) is shorter than the model's max_seq_len 64, and "
                                   "llmpipe's attention is full; set model.max_seq_len to at most 8")
    assert hf.read_config(folder, 8)[0].max_seq_len == 8  # within the window it is full attention: read


def test_the_builder_is_asked_only_for_a_family_it_knows(tmp_path):
    from llmpipe.export import fused

    for arch in adapters.ADAPTERS:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
        assert fused.unsupported_family(tmp_path) is None, arch
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    assert fused.unsupported_family(tmp_path) == (
        "onnxruntime-genai's builder does not know Gemma3ForCausalLM (LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM)")
