"""Chat settings at config load and bad conversation data: one line naming the field or file (and the
record), exit 2 for the config and 1 for the data, no artifact; text runs' fingerprints untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmpipe import cli, stages
from llmpipe.chat.template import builtin_template
from tests.unit.test_stages import _cfg


def _chat_tree(tmp_path: Path, records: list | None = None, **data) -> dict:
    path = tmp_path / "conv.jsonl"
    if records is None:
        records = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                 {"role": "assistant", "content": f"{2 * i}."}]} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"run": {"name": "chat", "artifacts_dir": str(tmp_path / "artifacts")},
            "data": {"inputs": [str(path)], "seq_len": 64, "val_fraction": 0.2, "format": "chat",
                     "chat_template": "chatml", "tokenizer": {"vocab_size": 300}, "workers": 1, **data},
            "model": {"flavor": "debug"}}


def _run(tmp_path: Path, tree: dict, capsys) -> tuple[int, str]:
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(tree))
    code = cli.main(["stage", "prepare_data", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _template(tmp_path: Path, source: str) -> str:
    (tmp_path / "t.jinja").write_text(source)
    return str(tmp_path / "t.jinja")


CONFIG_CASES = [
    ({"chat_template": "chatmi"},
     "error: {cfg}: data.chat_template: no built-in chat template 'chatmi' (built-in: chatml, llama3) and no such "
     "file"),
    ({"chat_template": "missing/t.jinja"},
     "error: {cfg}: data.chat_template: chat template missing/t.jinja: cannot be read (No such file or directory)"),
    ({"chat_template": None}, "error: {cfg}: data.chat_template: data.format is chat but there is no chat template "
                              "(model.init_from has none; set a built-in name, chatml or llama3, or a .jinja file)"),
    ({"chat_template": "{{ ''.__class__.__mro__ }}"},
     "error: {cfg}: data.chat_template: chat template {tmp}/t.jinja: failed to render (SecurityError: access to "
     "attribute '__class__' of 'str' object is unsafe.)"),
    ({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
     "error: {cfg}: data.chat_template: chat template {tmp}/t.jinja: does not support add_generation_prompt "
     "(renders nothing for the assistant's turn to begin)"),
    ({"chat_template": "{{ messages[0].content | nosuchfilter }}"},
     "error: {cfg}: data.chat_template: chat template {tmp}/t.jinja: syntax error on line 1 (No filter named "
     "'nosuchfilter'.)"),
    ({"train_on": "user"}, "error: {cfg}: data.train_on: Input should be 'assistant' or 'all' (got 'user')"),
]


@pytest.mark.parametrize("data,expected", CONFIG_CASES, ids=range(len(CONFIG_CASES)))
def test_a_chat_template_that_cannot_be_used_is_a_config_error_at_load(tmp_path, capsys, data, expected):
    if "{{" in str(data.get("chat_template")):
        data = {"chat_template": _template(tmp_path, data["chat_template"])}
    code, line = _run(tmp_path, _chat_tree(tmp_path, **data), capsys)
    assert (code, line) == (2, expected.format(tmp=tmp_path, cfg=tmp_path / "chat.yaml"))
    assert not (tmp_path / "artifacts").exists()


def test_packing_through_pipeline_stages_is_refused_at_load(tmp_path, capsys):
    tree = _chat_tree(tmp_path)
    tree["train"] = {"parallel": {"pp": 2, "dp": 1}, "nproc_per_node": 2, "micro_batch_size": 4}
    code, line = _run(tmp_path, tree, capsys)
    assert (code, line) == (2, f"error: {tmp_path / 'chat.yaml'}: data.packing: packed conversations need a "
                               "block-causal mask that pipeline stages do not carry (train.parallel.pp=2); set "
                               "data.packing: false or pp: 1")


U, A = {"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2."}


@pytest.mark.parametrize("records,data,expected", [
    ([{"text": "no conversation here"}] * 3, {},
     "conv.jsonl byte 0: field 'messages' is missing (and no Alpaca 'instruction' and 'output')"),
    ([{"messages": [A, U]}], {}, "conv.jsonl byte 0: messages[0]: role 'assistant' out of order (expected 'user'"),
    ([{"messages": [U, A]}] * 2, {"seq_len": 8},
     "conv.jsonl byte 0: no assistant token left after truncation to data.seq_len=8"),
], ids=["no-messages-field", "role-out-of-order", "nothing-left-after-truncation"])
def test_conversations_with_nothing_usable_fail_in_one_line_naming_the_record(tmp_path, capsys, records, data,
                                                                              expected):
    code, line = _run(tmp_path, _chat_tree(tmp_path, records, **data), capsys)
    assert code == 1 and line.startswith("error: data.inputs: no usable documents in 1 input(s) (e.g. ")
    assert expected in line, line
    assert not (tmp_path / "artifacts" / "chat" / "01_prepare_data").exists()


def test_text_fingerprints_are_unchanged_by_the_chat_fields_and_a_chat_run_hashes_its_template(tmp_path):
    text = stages.fingerprints(_cfg(tmp_path))
    explicit = stages.fingerprints(_cfg(tmp_path, "data.format=text", "data.packing=true",
                                        "data.train_on=assistant", "data.messages_field=messages"))
    assert explicit == text
    chatml = stages.fingerprints(_cfg(tmp_path, "data.format=chat", "data.chat_template=chatml"))
    llama3 = stages.fingerprints(_cfg(tmp_path, "data.format=chat", "data.chat_template=llama3"))
    assert chatml["prepare_data"] != text["prepare_data"] != llama3["prepare_data"] != chatml["prepare_data"]
    unpacked = stages.fingerprints(_cfg(tmp_path, "data.format=chat", "data.chat_template=chatml",
                                        "data.packing=false"))
    assert unpacked["train"] != chatml["train"]  # the shards are the same bytes; training is not
    from llmpipe.data.corpus import fingerprint_extra

    extra = fingerprint_extra(_cfg(tmp_path, "data.format=chat", "data.chat_template=chatml"))
    assert extra["chat_template_sha256"] == builtin_template("chatml").sha256
