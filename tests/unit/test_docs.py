"""The documentation cannot drift from the code: the site builds offline with --strict, every page is in
the nav, the generated references equal what the code generates now and list every config field, every
`llmpipe ...` command the docs show parses with the real parser (its --set values load against the config
schema), and `llmpipe --help` lists every command in a group with an example."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmpipe import cli, docs_gen
from llmpipe import config as config_mod
from llmpipe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).with_name("mkdocs")
_SHELL_OPS = {"&", "&&", "|", "||", ";", ">", ">>", "<", "2>&1"}


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_the_generated_references_equal_what_the_code_generates_now():
    assert docs_gen.stale(DOCS) == [], "run `make docs` (python -m llmpipe.docs_gen) and commit the pages"


def test_the_config_reference_lists_every_field_of_the_schema_with_its_role():
    page = (DOCS / "reference" / "config.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`"): line for line in page.splitlines() if line.startswith("| `")}
    paths = [dotted for dotted, *_ in docs_gen.fields()]
    assert len(paths) > 250
    assert [p for p in paths if p not in rows] == []
    assert "| operational |" in rows["train.log_every"]
    assert "result of train" in rows["train.optim.lr"]
    assert "result of prepare_data, train" in rows["run.seed"]
    assert "(added later: in the fingerprint only when not its default)" in rows["export.ort_graph"]
    assert "| >= 260, <= 1_000_000 |" in rows["data.tokenizer.vocab_size"]


def test_every_page_under_docs_is_in_the_nav_and_every_nav_entry_is_a_page():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == on_disk
    assert len(nav) == len(set(nav))


def test_the_site_builds_offline_with_strict_and_fetches_no_fonts(tmp_path):
    out = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    html = (tmp_path / "site" / "reference" / "config.html").read_text(encoding="utf-8")
    assert "train.optim.lr" in html
    assert not [p for p in (tmp_path / "site").rglob("*.html") if "fonts.googleapis.com" in p.read_text()]


def _code_blocks(text: str):
    """(first line number, lines) of each fenced code block."""
    block, start = None, 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if block is None:
                block, start = [], n + 1
            else:
                yield start, block
                block = None
        elif block is not None:
            block.append(line)


def _commands(text: str):
    """(line number, argv after `llmpipe`) of every llmpipe command line in the fenced code blocks."""
    for start, lines in _code_blocks(text):
        joined, first = "", None
        for n, line in enumerate(lines, start):
            first = first or n
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined, whole, first_n, first = "", joined + line, first, None
            lex = shlex.shlex(whole.strip().removeprefix("$ "), posix=True, punctuation_chars=True)
            lex.whitespace_split, lex.commenters = True, "#"
            try:
                tokens = list(lex)
            except ValueError:
                continue
            while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):  # VAR=value before a command
                tokens.pop(0)
            if not tokens or not (tokens[0] == "llmpipe" or tokens[0].endswith("/llmpipe")):
                continue
            argv = tokens[1:]
            cut = next((i for i, t in enumerate(argv) if t in _SHELL_OPS), len(argv))
            yield first_n, argv[:cut]


def _doc_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def test_every_llmpipe_command_in_the_docs_parses_and_its_set_values_load():
    parser, seen, bad = cli._parser(), 0, []
    for path in _doc_files():
        for line, argv in _commands(path.read_text(encoding="utf-8")):
            seen += 1
            where = f"{path.relative_to(ROOT)}:{line}: llmpipe {' '.join(argv)}"
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    args = parser.parse_args(argv)
            except SystemExit:
                bad.append(f"{where}: {err.getvalue().strip().splitlines()[-1]}")
                continue
            overrides = list(getattr(args, "overrides", []) or [])
            if overrides:
                config = ROOT / getattr(args, "config", "")
                config = config if getattr(args, "config", None) and config.is_file() else ROOT / "configs/tiny.yaml"
                try:
                    config_mod.load(config, overrides, check="fields")
                except ConfigError as e:
                    bad.append(f"{where}: {e}")
    assert seen > 40
    assert bad == []


def test_the_command_extractor_finds_continued_prefixed_and_piped_commands():
    text = "```bash\nX=1 .venv/bin/llmpipe run c.yaml \\\n  --force & # bg\nmake demo\nllmpipe status t | head\n```\n"
    assert list(_commands(text)) == [(2, ["run", "c.yaml", "--force"]), (5, ["status", "t"])]


def test_every_command_is_in_one_help_group_with_an_example_that_parses():
    parser = cli._parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(name for name, _, _ in cli.COMMANDS) == sorted(commands)
    top = parser.format_help()
    for name, group, example in cli.COMMANDS:
        assert f"{group}:" in top and f"\n  {name} " in top
        assert example.split()[:2] == ["llmpipe", name]
        parser.parse_args(shlex.split(example)[1:])  # SystemExit fails the test
        assert f"example:\n  {example}" in commands[name].format_help()


def test_the_readme_is_short_starts_with_the_two_commands_and_links_only_to_pages_that_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) < 150
    head = "\n".join(lines[:25])
    assert "make demo" in head and "make test" in head
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []
    assert sum(link.startswith("docs/") for link in links) >= 10


@pytest.mark.parametrize("argv,usage", [(["--help"], "usage: llmpipe [-h] COMMAND ...\n"),
                                        (["bench", "serve", "--help"], "usage: llmpipe bench serve [-h] ")])
def test_help_of_the_program_and_of_a_command_exits_zero_with_its_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli._parser().parse_args(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(usage)
