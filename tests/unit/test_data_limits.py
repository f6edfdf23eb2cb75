"""prepare_data at the edges: documents far longer than the tokenizer's piece budget, symlink loops."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from llmpipe.config import from_dict
from llmpipe.data import prepare
from llmpipe.data.corpus import Corpus, find_inputs
from llmpipe.data.tokenizer import split_text, train_tokenizer
from llmpipe.stages import StageContext

WORDS = "alpha beta gamma delta def return import class self print while for in if else 42 7.5 café".split()
SPACES = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "\u3000", "\xa0", " \t "]


def _varied_text(rng: random.Random, n_words: int) -> str:
    """Words and punctuation separated by every kind of whitespace run the pre-tokenizer treats apart."""
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS) + rng.choice(["", "", ",", ".", "'s", "()", "!!"]))
        out.append(rng.choice(SPACES))
    return "".join(out)


def _prepare(tmp_path: Path, inputs: list[str], **data) -> tuple[Path, object]:
    cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(tmp_path / "art"), "seed": 1},
                     "data": {"inputs": inputs, "seq_len": 8, "val_fraction": 0.1,
                              "tokenizer": {"vocab_size": 300}, **data}})
    work = tmp_path / "work"
    work.mkdir()
    return work, prepare.run(StageContext(cfg, "prepare_data", tmp_path, work, {}, "test"))


# ---------------------------------------------------------------- long documents

def test_pieces_cut_at_whitespace_encode_to_the_whole_documents_ids() -> None:
    rng = random.Random(0)
    docs = [_varied_text(rng, 3000) for _ in range(4)]
    tok = train_tokenizer(docs, 400)
    for doc in docs:
        pieces = list(split_text(doc, budget=200))
        assert len(pieces) > 50 and "".join(pieces) == doc and max(map(len, pieces)) <= 200
        assert all(p[0].isspace() for p in pieces[1:])  # every cut is a whitespace cut here
        joined = [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]
        assert joined == tok.encode(doc, add_special_tokens=False).ids


def test_text_without_whitespace_is_cut_at_the_budget() -> None:
    text = "x" * 1000 + " tail"
    pieces = list(split_text(text, budget=300))
    assert [len(p) for p in pieces] == [300, 300, 300, 105] and "".join(pieces) == text
    assert list(split_text("short text", budget=300)) == ["short text"]


def test_a_long_line_is_streamed_in_pieces_not_read_whole(tmp_path: Path) -> None:
    line = (" ".join(random.Random(1).choice(WORDS) for _ in range(100_000)) + " ") * 12  # ~6 MB, one line
    path = tmp_path / "one_line.txt"
    path.write_text(line, encoding="utf-8")
    corpus = Corpus([path], max_file_bytes=1 << 30, piece_chars=1 << 16)
    tracemalloc.start()
    try:
        lengths, firsts, lasts, head = [], 0, 0, ""
        for piece in corpus.pieces():
            lengths.append(len(piece.text))
            firsts, lasts = firsts + piece.first, lasts + piece.last
            head = head or piece.text
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(lengths) == len(line) and max(lengths) <= 1 << 16 and (firsts, lasts) == (1, 1)
    assert line.startswith(head) and corpus.stats.documents == 1 and corpus.stats.bytes == len(line)
    # A 256 KiB block of the content check, a few 64k pieces: far below the 6 MB line, let alone a copy.
    assert peak < 3 << 20, f"peak {peak / 2**20:.1f} MiB of Python allocations while streaming a 6 MB line"


_CHILD = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from llmpipe.config import from_dict
    from llmpipe.data import prepare
    from llmpipe.stages import StageContext

    peaks = []
    for name in ("small", "big"):  # ru_maxrss is a high-water mark: the small corpus first
        out = Path(sys.argv[1]) / ("out-" + name)
        out.mkdir()
        cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(out / "art"), "seed": 1},
                         "data": {"inputs": [sys.argv[1] + "/" + name + "/*.txt"], "seq_len": 16,
                                  "max_file_bytes": 300_000_000, "tokenizer": {"vocab_size": 300},
                                  "dedup": "none", "workers": 1}})
        result = prepare.run(StageContext(cfg, "prepare_data", out, out, {}, "test"))
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps({"peaks": peaks, "documents": result.metrics["documents"],
                      "tokens": result.metrics["tokens"]}))
""")


def test_a_50_mb_single_line_document_prepares_in_bounded_memory(tmp_path: Path) -> None:
    rng = random.Random(2)
    block = " ".join(rng.choice(WORDS) for _ in range(100_000)) + " "  # ~0.5 MB of varied words
    for name, size in (("small", 0), ("big", 50_000_000)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "b.txt").write_text(block, encoding="utf-8")  # a second document (one goes to val)
        with open(folder / "a.txt", "w", encoding="utf-8") as f:
            f.write(block)
            for _ in range(size // len(block)):
                f.write(block)  # no newline anywhere: one 50 MB line
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "LLMPIPE_PROGRESS": "0"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    small, big = report["peaks"]
    assert report["documents"] == 2 and report["tokens"] > 5_000_000
    # Bound: a whole-file document is one str (capped by data.max_file_bytes) and a few transient
    # copies (decoding, the filters' strip, the tokenizer pass), plus one encode call of at most
    # units.ENCODE_CHARS (4M characters) and the trainer's buffer: measured +570 MB on 50 MB. Encoding
    # the line whole costs ~200 B a character: 2.3 GB for 10 MB, ~10 GB here.
    assert big - small < 700 << 20, f"peak RSS {big / 2**20:.0f} MB vs {small / 2**20:.0f} MB for small files"


# ---------------------------------------------------------------- symlink loops

def _loop_tree(root: Path) -> Path:
    """loop/{a.txt, sub/b.txt, sub/deep/c.txt, alias.txt -> a.txt}, with links back up: sub/back -> ..
    and sub/deep/up -> ../.. (two loops: plain glob walks them until the path is too long)."""
    top = root / "loop"
    (top / "sub" / "deep").mkdir(parents=True)
    rng = random.Random(3)
    for rel in ("a.txt", "sub/b.txt", "sub/deep/c.txt"):
        (top / rel).write_text(_varied_text(rng, 300), encoding="utf-8")
    os.symlink("..", top / "sub" / "back")
    os.symlink("../..", top / "sub" / "deep" / "up")
    os.symlink("a.txt", top / "alias.txt")
    return top


def test_symlink_loops_are_reported_and_each_file_is_read_once(tmp_path: Path, caplog) -> None:
    top = _loop_tree(tmp_path)
    found = find_inputs([str(top / "**" / "*.txt"), str(top / "*.txt")])
    assert [p.relative_to(top).as_posix() for p in found.files] == ["a.txt", "sub/b.txt", "sub/deep/c.txt"]
    assert found.symlink_loops == [str(top / "sub" / "back"), str(top / "sub" / "deep" / "up")]

    with caplog.at_level(logging.WARNING, logger="llmpipe.data"):
        work, result = _prepare(tmp_path, [str(top / "**" / "*.txt")])
    assert (result.metrics["files_read"], result.metrics["documents"]) == (3, 3)
    assert json.loads((work / "data_meta.json").read_text())["symlink_loops"] == 2
    assert result.metrics["symlink_loops"] == 2
    assert any("2 symlink loop(s) not followed" in r.getMessage() and "sub/back" in r.getMessage()
               for r in caplog.records)


def test_a_link_that_points_at_itself_is_a_loop_too(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("text", encoding="utf-8")
    os.symlink("self", tmp_path / "d" / "self")
    found = find_inputs([str(tmp_path / "d" / "**")])
    assert found.files == [tmp_path / "d" / "x.txt"] and found.symlink_loops == [str(tmp_path / "d" / "self")]


@pytest.mark.parametrize("pattern", ["**/*.txt", "*/*.txt", "sub/**", "**"])
def test_the_search_matches_glob_where_there_is_no_loop(tmp_path: Path, pattern: str) -> None:
    import glob

    for rel in ("a.txt", "sub/b.txt", "sub/c.md", "sub/x/d.txt", ".hidden/e.txt", "sub/.f.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("t", encoding="utf-8")
    expected = sorted(os.path.abspath(p) for p in glob.glob(str(tmp_path / pattern), recursive=True)
                      if os.path.isfile(p))
    assert [str(p) for p in find_inputs([str(tmp_path / pattern)]).files] == expected


def test_jsonl_records_are_read_line_by_line_and_long_ones_come_in_pieces(tmp_path: Path) -> None:
    long_text = _varied_text(random.Random(4), 5000)
    lines = [json.dumps({"text": "has a raw \u2028 line separator"}, ensure_ascii=False),
             json.dumps({"text": long_text}), "{broken"]
    (tmp_path / "d.jsonl").write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    corpus = Corpus([tmp_path / "d.jsonl"], piece_chars=500)
    pieces = list(corpus.pieces())
    assert pieces[0] == ("has a raw \u2028 line separator", True, True)  # str.splitlines would cut it
    assert "".join(p.text for p in pieces[1:]) == long_text and len(pieces) > 20
    assert [p.first for p in pieces[1:]].count(True) == 1 and pieces[-1].last
    assert (corpus.stats.documents, corpus.stats.bad_lines) == (2, 1)
    assert corpus.stats.bad_line_examples == [f"{tmp_path / 'd.jsonl'}:3: not valid JSON"]
