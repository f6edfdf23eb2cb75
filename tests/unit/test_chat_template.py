"""The chat template: rendered as transformers renders it, sandboxed, and found where the issue says
(model.init_from's tokenizer_config.json first, then data.chat_template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpipe.chat import template as tmod
from llmpipe.chat.template import (
    BUILTIN_TEMPLATES,
    TemplateError,
    builtin_template,
    load_template,
    resolve_template,
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 + 25?"}, {"role": "assistant", "content": "42."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": " Hi there \n"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "x"}, {"role": "user", "content": "only a question, with unicode: é 中"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<s>",
                                                eos_token="</s>")


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_each_builtin_template_renders_exactly_what_transformers_apply_chat_template_renders(name, hf_tokenizer):
    tpl = builtin_template(name)
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            ours = tpl.render(messages, add_generation_prompt=prompt, bos_token="<s>", eos_token="</s>")
            theirs = hf_tokenizer.apply_chat_template(messages, chat_template=tpl.source, tokenize=False,
                                                      add_generation_prompt=prompt)
            assert ours == theirs, (messages, prompt)


def test_builtin_templates_know_their_end_of_turn_and_digest():
    assert builtin_template("chatml").end_of_turn == ["<|im_end|>"]
    assert builtin_template("llama3").end_of_turn == ["<|eot_id|>"]
    tpl = builtin_template("chatml")
    import hashlib

    assert tpl.sha256 == hashlib.sha256(BUILTIN_TEMPLATES["chatml"].encode()).hexdigest()
    assert tpl.origin == "built-in 'chatml'"


def test_a_template_whose_turn_ends_with_nothing_but_eos_has_no_end_of_turn_string():
    tpl = load_template("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}"
                        "{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}",
                        "plain.jinja")
    assert tpl.end_of_turn == []
    assert tpl.render(CONVERSATIONS[0], eos_token="</s>") == "user: What is 17 + 25?\nassistant: 42.</s>\n"


@pytest.mark.parametrize("source,message", [
    ("{{ ''.__class__.__mro__ }}",
     "chat template evil.jinja: failed to render (SecurityError: access to attribute '__class__' of 'str' "
     "object is unsafe.)"),
    ("{{ messages.append(1) }}",
     "chat template evil.jinja: failed to render (SecurityError: access to attribute 'append' of 'list' "
     "object is unsafe.)"),
    ("{{ 'x' * 100000000 }}", "chat template evil.jinja: failed to render (SecurityError: repetition too large)"),
    ("{{ 'a'.ljust(1000000000) }}",
     "chat template evil.jinja: failed to render (SecurityError: argument 1000000000 is too large)"),
    ("{{ raise_exception('roles must alternate') }}",
     "chat template evil.jinja: failed to render (TemplateError: roles must alternate)"),
    ("{% if %}", "chat template evil.jinja: syntax error on line 1 (Expected an expression, got 'end of "
                 "statement block')"),
    ("{{ x" + " " * (64 << 10) + "}}", "chat template evil.jinja: larger than 64 KiB"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}",
     "chat template evil.jinja: does not support add_generation_prompt (renders nothing for the assistant's turn "
     "to begin)"),
])
def test_a_template_that_escapes_fails_or_is_too_big_is_refused_in_one_line(source, message):
    with pytest.raises(TemplateError) as err:
        load_template(source, "evil.jinja")
    assert str(err.value) == message


_MAX = "(at most 67108864))"
SINGLE_CALLS = [  # issue 36: each would allocate a gigabyte or more in one call; refused before the call
    ("percent width", "{{ '%01500000000d' % 1 }}", "SecurityError: '%' formatting would make 1500000014 characters"),
    ("percent precision", "{{ '%.1500000000f' % 1.0 }}",
     "SecurityError: '%' formatting would make 1500000016 characters"),
    ("percent star width", "{{ '%*d' % (1500000000, 1) }}",
     "SecurityError: '%' formatting would make 1500000014 characters"),
    ("str.format width", "{{ '{:>1500000000}'.format(1) }}", "SecurityError: str.format would make 1500000015 "
     "characters"),
    ("str.replace", "{{ ('x' * 60000000).replace('x', 'yy') }}",
     "SecurityError: str.replace would make 120000000 characters"),
    ("str.center", "{{ ('x' * 60000000).center(16000000) ~ ('x' * 60000000).replace('x', 'yy') }}",
     "SecurityError: str.replace would make 120000000 characters"),
    ("str.ljust", "{{ 'x'.ljust(16000000).ljust(16000000) ~ '' }}{% set a = 'x'.ljust(16000000) %}"
     "{{ ''.join([a, a, a, a, a]) }}", "SecurityError: str.join would make 80000000 characters"),
    ("tilde concatenation", "{% set a = 'x'.zfill(16000000) %}{{ a ~ a ~ a ~ a ~ a }}",
     "SecurityError: '~' would make 80000000 characters"),
    ("str.expandtabs", "{{ ('\t' * 10000000).expandtabs(100) }}",
     "SecurityError: str.expandtabs would make 1000000000 characters"),
    ("str concatenation", "{% set a = 'x' * 60000000 %}{{ a + a }}", "SecurityError: '+' would make 120000000 "
     "characters"),
    ("join filter", "{% set a = 'x'.ljust(16000000) %}{{ [a, a, a, a, a]|join }}",
     "SecurityError: |join would make 80000000 characters"),
    ("indent filter", "{{ ('x\n' * 30000000)|indent(10) }}", "SecurityError: |indent would make 360000010 "
     "characters"),
    ("sum of lists", "{{ ([range(100000)|list] * 100000)|sum(start=[]) }}",
     "SecurityError: |sum would make 10000000000 characters"),
]


@pytest.mark.parametrize("source,error", [c[1:] for c in SINGLE_CALLS], ids=[c[0] for c in SINGLE_CALLS])
def test_a_single_call_that_would_make_too_much_text_is_refused_before_it_runs(source, error):
    with pytest.raises(TemplateError) as err:
        load_template(source, "evil.jinja")
    assert str(err.value) == f"chat template evil.jinja: failed to render ({error} {_MAX}"


def test_the_time_limit_sees_the_work_of_filters_not_only_the_templates_lines(monkeypatch):
    """`|map|sum` over a range runs in jinja's filters (no line of the template's own) for minutes."""
    monkeypatch.setattr(tmod, "RENDER_SECONDS", 0.05)
    with pytest.raises(TemplateError) as err:
        load_template("{{ range(100000)|map('string')|map('center', 1000000)|map('length')|sum }}", "slow.jinja")
    assert str(err.value) == ("chat template slow.jinja: rendering took longer than 0.05 s (a loop that does not "
                              "end?)")


def test_a_template_that_renders_too_long_is_stopped_at_the_time_limit(monkeypatch):
    monkeypatch.setattr(tmod, "RENDER_SECONDS", 0.05)
    with pytest.raises(TemplateError, match=r"^chat template slow.jinja: rendering took longer than 0.05 s"):
        load_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "slow.jinja")


def test_the_init_from_folders_template_wins_over_the_setting_and_the_list_form_takes_default(tmp_path: Path):
    folder = tmp_path / "hf"
    folder.mkdir()
    assert resolve_template(str(folder), "llama3").sha256 == builtin_template("llama3").sha256
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "{{ 1 }}"},
                           {"name": "default", "template": BUILTIN_TEMPLATES["chatml"]}]}))
    found = resolve_template(str(folder), "llama3")
    assert found.sha256 == builtin_template("chatml").sha256
    assert found.origin == str(folder / "tokenizer_config.json")
    assert resolve_template(None, None) is None
    path = tmp_path / "mine.jinja"
    path.write_text(BUILTIN_TEMPLATES["llama3"])
    assert resolve_template(None, str(path)).origin == str(path)
    with pytest.raises(TemplateError, match=r"^chat template .*missing.jinja: cannot be read \(No such file"):
        resolve_template(None, str(tmp_path / "missing.jinja"))
