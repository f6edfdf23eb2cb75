"""Issue 24 item 6: consolidate's hf/ folder is complete. transformers' AutoTokenizer finds the run's
special tokens in tokenizer_config.json (eos, and pad = eos when the tokenizer has no pad token),
GenerationConfig loads generation_config.json (eos ids as a list), and a model.init_from folder's own
tokenizer_config.json / generation_config.json values are carried over, each checked first: a bad one
is one line naming the file and the field, at config load (exit 2) or, for a token the run's
tokenizer lacks, when consolidate writes the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from llmpipe import cli
from llmpipe.data.tokenizer import train_tokenizer
from llmpipe.models.llama.hf import HFFolderError
from llmpipe.models.llama.hf_files import hf_files, read_carried, write_hf_files
from tests.unit.test_hf_bounds import _hf_folder, _tree

transformers = pytest.importorskip("transformers")
TEXT = ["def main(argv):\n    return len(argv)\n", "the quick brown fox jumps over the lazy dog\n"] * 8


def _llama_style_tokenizer() -> Tokenizer:
    """A byte-level BPE with LLaMA-2's special tokens: <unk> (the model's unknown token), <s> put first by the
    post-processor, </s>, <pad>, and a chat end-of-turn token <|eot|>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<|eot|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _folder(tmp_path: Path, tok: Tokenizer, eos: str, **kw) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    write_hf_files(folder, hf_files(tok, eos, 64, **kw))
    return folder


def test_the_demo_tokenizer_loads_with_eos_as_eos_and_pad_and_no_bos_or_unk(tmp_path):
    tok = train_tokenizer(TEXT, 300)
    folder = _folder(tmp_path, tok, "<|endoftext|>")
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert (loaded.eos_token, loaded.eos_token_id, loaded.pad_token, loaded.pad_token_id) == \
           ("<|endoftext|>", 0, "<|endoftext|>", 0)
    assert (loaded.bos_token, loaded.unk_token, loaded.model_max_length) == (None, None, 64)
    assert loaded("def main(").input_ids == tok.encode("def main(").ids  # nothing added around the text
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert (generation.eos_token_id, generation.pad_token_id, generation.bos_token_id) == ([0], 0, None)
    assert (generation.do_sample, generation.temperature, generation.top_p) == (True, 0.6, 0.9)
    assert json.loads((folder / "special_tokens_map.json").read_text()) == \
           {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())


def test_a_llama_style_tokenizer_s_bos_unk_and_pad_are_found(tmp_path):
    tok = _llama_style_tokenizer()
    loaded = transformers.AutoTokenizer.from_pretrained(_folder(tmp_path, tok, "</s>"))
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token, loaded.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 3)
    assert loaded("hello").input_ids[0] == 1  # the tokenizer.json's post-processor puts <s> first, as it said
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, [2], 3)


def test_a_chat_template_s_end_of_turn_token_joins_eos_and_the_template_is_the_tokenizer_s(tmp_path):
    tok = _llama_style_tokenizer()
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot|>\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    folder = _folder(tmp_path, tok, "</s>", chat_template=template, end_of_turn=["<|eot|>", "\n\n"])
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True) == "user: hi<|eot|>\nassistant: "
    # "\n\n" is two tokens here: a stop string for llmpipe generate, not an eos id
    assert transformers.GenerationConfig.from_pretrained(folder).eos_token_id == [2, 4]


def test_init_from_s_own_tokenizer_and_generation_config_values_are_carried_over(tmp_path):
    source = tmp_path / "init"
    source.mkdir()
    (source / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "eos_token": {"content": "<|eot|>", "special": True},
        "pad_token": None, "model_max_length": 10**30}))
    (source / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [4, 2], "temperature": 0.7, "top_k": 40, "do_sample": True,
        "transformers_version": "4.44.0", "unknown_key": {"x": 1}}))
    out = tmp_path / "out"
    out.mkdir()
    tok = _llama_style_tokenizer()
    folder = _folder(out, tok, "</s>", carried=read_carried(source, 300))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["tokenizer_class"], config["eos_token"], config["pad_token"], config["model_max_length"]) == \
           ("PreTrainedTokenizerFast", "<|eot|>", "<pad>", 64)  # the folder's tokenizer.json; llmpipe's context
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert (generation.eos_token_id, generation.temperature, generation.top_k, generation.top_p) == \
           ([4, 2], 0.7, 40, 0.9)  # init_from's eos then training's; its sampling over the defaults
    assert transformers.AutoTokenizer.from_pretrained(folder).eos_token == "<|eot|>"


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer_config.json", "[1, 2]", "expected a JSON object"),
    ("tokenizer_config.json", '{"eos_token": 5}', "eos_token: expected a token (a string of 1..256 characters), got 5"),
    ("tokenizer_config.json", '{"bos_token": "' + "x" * 300 + '"}',
     "bos_token: expected a token (a string of 1..256 characters), got '" + "x" * 59),
    ("tokenizer_config.json", "[" * 100 + "]" * 100, "nested more than 64 levels deep"),
    ("generation_config.json", '{"eos_token_id": 400}',
     "eos_token_id: token id 400 is outside the vocabulary (0..299)"),
    ("generation_config.json", '{"eos_token_id": [true]}',
     "eos_token_id: expected a token id or a list of at most 64, got [True]"),
    ("generation_config.json", '{"pad_token_id": [1, 2]}', "pad_token_id: expected one token id, got [1, 2]"),
    ("generation_config.json", '{"temperature": NaN}', "temperature: expected a number in (0, 100], got nan"),
    ("generation_config.json", '{"temperature": 0}', "temperature: expected a number in (0, 100], got 0"),
    ("generation_config.json", '{"top_p": 1.5}', "top_p: expected a number in (0, 1], got 1.5"),
    ("generation_config.json", '{"top_k": 2.5}', "top_k: expected a whole number in [0, 1048576], got 2.5"),
    ("generation_config.json", '{"do_sample": "yes"}', "do_sample: expected true or false, got 'yes'"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 24 else "")
def test_a_bad_value_in_init_from_s_files_is_one_line_naming_the_file_and_the_field(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(HFFolderError) as err:
        read_carried(tmp_path, 300)
    assert str(err.value) == f"{tmp_path / name}: {message}"


def test_a_carried_token_the_run_s_tokenizer_lacks_is_refused_naming_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    with pytest.raises(HFFolderError, match=r"^(.+): bos_token: '<\|begin_of_text\|>' is not a token of the run's "
                                            r"tokenizer$") as err:
        hf_files(train_tokenizer(TEXT, 300), "<|endoftext|>", 64, carried=read_carried(tmp_path, 300))
    assert err.match(str(tmp_path / "tokenizer_config.json").replace("\\", "\\\\"))


def test_a_bad_init_from_generation_config_fails_llmpipe_run_at_load_in_one_line(tmp_path, capsys):
    folder = _hf_folder(tmp_path / "hf")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 300]}))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_tree(tmp_path, folder)))
    assert cli.main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {config}: model.init_from: {folder / 'generation_config.json'}: eos_token_id: token id 300 "
                   "is outside the vocabulary (0..299)")
    assert not (tmp_path / "artifacts").exists()
