"""llmpipe import-gguf: the real SmolLM2-135M-Instruct GGUF becomes an HF folder whose logits equal transformers'
own GGUF-loaded model; crafted bad files (gguf.GGUFWriter) are each one line and leave no folder behind."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmpipe.models.gguf import GGUFError, import_gguf
from tests.conftest import SMOLLM2_GGUF

# A short chat-formatted sequence of SmolLM2's own ids: <|im_start|>user\nHello, how are you?<|im_end|>
IDS = [[1, 4093, 198, 19556, 28, 638, 359, 346, 47, 2, 198]]


def test_the_real_gguf_loads_in_transformers_as_llama_with_its_logits(smollm2_hf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_hf / "config.json").read_text())
    assert (config["architectures"], config["tie_word_embeddings"]) == (["LlamaForCausalLM"], True)
    assert (config["bos_token_id"], config["eos_token_id"], config["rms_norm_eps"]) == (1, 2, 1e-05)
    ours = AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)
    assert type(ours).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008  # tied: the head is the embedding
    ref = AutoModelForCausalLM.from_pretrained(SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name,
                                               dtype=torch.float32)
    with torch.no_grad():
        got, want = ours(torch.tensor(IDS)).logits, ref(torch.tensor(IDS)).logits
    # NOTE: both dequantise the same Q4_1/Q8_0 blocks to fp32 and run the same fp32 maths: equal to 1e-5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    tok = AutoTokenizer.from_pretrained(smollm2_hf)
    assert tok("Hello, how are you?").input_ids == IDS[0][3:9]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def _tiny(path: Path, arch: str = "llama", layers: int = 1, embd_shape=(32, 8), norm_dtype=np.float32) -> Path:
    """A llama GGUF of 1 layer, width 8, 2 heads (1 kv), vocab 32 -- or one of its faults."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(32)])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": embd_shape, "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8),
              "blk.0.ffn_down.weight": (8, 16), "blk.0.ffn_norm.weight": (8,)}
    for name, shape in shapes.items():
        dtype = norm_dtype if name.endswith("norm.weight") else np.float32
        w.add_tensor(name, rng.standard_normal(shape).astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _refused(src: Path, dest: Path) -> str:
    with pytest.raises(GGUFError) as err:
        import_gguf(src, dest)
    assert not dest.exists() and not list(dest.parent.glob(f".{dest.name}.partial-*"))  # nothing half-written
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_truncated_gguf_is_one_line_and_writes_no_folder(tmp_path: Path):
    src = _tiny(tmp_path / "m.gguf")
    data = src.read_bytes()
    for keep in (len(data) - 16, 100, 10):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        message = _refused(cut, tmp_path / "out")
        assert message.startswith(f"{cut}: "), message
        assert "truncated" in message or "not a GGUF file" in message, message


def test_an_unknown_architecture_is_named(tmp_path: Path):
    src = _tiny(tmp_path / "m.gguf", arch="gpt2")
    assert _refused(src, tmp_path / "out") == (f"{src}: general.architecture: 'gpt2' is not supported (llama)")


def test_a_tensor_type_gguf_cannot_dequantise_is_named(tmp_path: Path):
    src = _tiny(tmp_path / "m.gguf", norm_dtype=np.int32)
    assert _refused(src, tmp_path / "out") == (f"{src}: tensor output_norm.weight: type I32 cannot be dequantised")


def test_metadata_sizes_beyond_the_model_limits_are_refused_before_any_tensor(tmp_path: Path):
    src = _tiny(tmp_path / "m.gguf", layers=5000)
    assert _refused(src, tmp_path / "out") == (f"{src}: llama.block_count: 5000 is outside 1..1024, llmpipe's bound "
                                               "on model.n_layers")


def test_a_tensor_shape_that_disagrees_with_the_metadata_is_named(tmp_path: Path):
    src = _tiny(tmp_path / "m.gguf", embd_shape=(32, 9))
    assert _refused(src, tmp_path / "out") == (f"{src}: tensor token_embd.weight: shape (32, 9) disagrees with the "
                                               "metadata's (32, 8)")


def test_an_existing_folder_is_not_overwritten(tmp_path: Path):
    (tmp_path / "out").mkdir()
    with pytest.raises(GGUFError, match="already exists"):
        import_gguf(_tiny(tmp_path / "m.gguf"), tmp_path / "out")


def test_llmpipe_import_gguf_prints_one_error_line_and_exits_non_zero(tmp_path: Path, capsys):
    from llmpipe.cli import main

    src = _tiny(tmp_path / "m.gguf", arch="qwen9")
    assert main(["import-gguf", str(src), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {src}: general.architecture: 'qwen9' is not supported (llama)"]
    assert not (tmp_path / "out").exists()
