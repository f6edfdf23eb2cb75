"""prepare_data: corpus reading, tokenizer, .bin/.idx shards, and the stage end to end (small corpora)."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from llmpipe.config import from_dict
from llmpipe.data import prepare
from llmpipe.data.corpus import Corpus, expand_inputs, expand_pattern
from llmpipe.data.errors import DataError
from llmpipe.data.shards import ShardError, ShardWriter, TokenShard, token_dtype, write_shard
from llmpipe.data.tokenizer import eos_id, load_tokenizer, train_tokenizer
from llmpipe.manifest import Manifest
from llmpipe.stages import StageContext, run_stage, stage_dir

WORDS = ("alpha beta gamma delta epsilon zeta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega def return import class self print while for in if else").split()
EOS = "<|endoftext|>"


def _text(rng: random.Random, n_words: int) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12)]
    return "\n".join(lines) + "\n"


def _write_corpus(root: Path, n_docs: int = 20, seed: int = 0) -> Path:
    """n_docs .txt files of ~150 pseudo-words each under root/corpus/ (two levels, for ** globs)."""
    rng = random.Random(seed)
    for i in range(n_docs):
        p = root / "corpus" / f"part{i % 2}" / f"doc{i:03d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(_text(rng, 150), encoding="utf-8")
    return root / "corpus"


def _data(corpus: Path, **over) -> dict:
    data = {"inputs": [str(corpus / "**" / "*.txt")], "seq_len": 16, "val_fraction": 0.1,
            "tokenizer": {"vocab_size": 300}}
    data.update(over)
    return data


def _run(tmp_path: Path, data: dict, seed: int = 1234, work: str = "work"):
    """Call prepare.run with a hand-made StageContext; returns (work_dir, StageResult)."""
    run = {"name": "t", "artifacts_dir": str(tmp_path / "art"), "seed": seed}
    cfg = from_dict({"run": run, "data": data}, check="fields")  # prepare_data alone: no model checks
    work_dir = tmp_path / work
    work_dir.mkdir()
    ctx = StageContext(cfg, "prepare_data", tmp_path, work_dir, {}, "test")
    return work_dir, prepare.run(ctx)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return _write_corpus(tmp_path)


# ---------------------------------------------------------------- shards

def test_shard_round_trip_uint16(tmp_path: Path) -> None:
    docs = [[1, 2, 3, 0], [4, 5, 0], [65535, 0]]
    write_shard(tmp_path / "a.bin", docs, token_dtype(300))
    shard = TokenShard(tmp_path / "a.bin")
    assert shard.dtype == np.uint16 and (tmp_path / "a.bin").stat().st_size == 2 * 9
    assert shard.n_tokens == 9 and shard.n_docs == 3 and len(shard) == 9
    assert shard.tokens.tolist() == [t for d in docs for t in d]
    assert shard.doc_offsets.tolist() == [0, 4, 7]
    assert [shard.document(j).tolist() for j in range(3)] == docs


def test_shard_dtype_follows_vocab(tmp_path: Path) -> None:
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    docs = [[70000, 1, 0], [123456, 0]]
    write_shard(tmp_path / "b.bin", docs, token_dtype(200_000))
    shard = TokenShard(tmp_path / "b.bin")
    assert shard.dtype == np.uint32 and (tmp_path / "b.bin").stat().st_size == 4 * 5
    assert shard.tokens.tolist() == [70000, 1, 0, 123456, 0]
    with pytest.raises(ValueError, match="out of range"):
        write_shard(tmp_path / "c.bin", [[70000]], np.uint16)


def test_shard_writer_streams_chunks(tmp_path: Path) -> None:
    with ShardWriter(tmp_path / "s.bin", np.uint16) as w:
        w.add_documents([[1, 2], [3]])
        w.add_documents([])
        w.add_document(np.array([4, 5, 6]))
    shard = TokenShard(tmp_path / "s.bin")
    assert shard.tokens.tolist() == [1, 2, 3, 4, 5, 6] and shard.doc_offsets.tolist() == [0, 2, 3]


def test_shard_writer_failure_leaves_no_index(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "f.bin", np.uint16) as w:
        w.add_document([1, 2])
        raise RuntimeError("boom")
    assert not (tmp_path / "f.idx").exists()


def test_sample_windows(tmp_path: Path) -> None:
    write_shard(tmp_path / "w.bin", [list(range(10)), list(range(10, 23))], np.uint16)  # 23 tokens
    shard = TokenShard(tmp_path / "w.bin")
    assert shard.num_samples(4) == 5  # (23 - 1) // 4
    for i in range(5):
        s = shard.sample(i, 4)
        assert s.dtype == np.int64 and s.tolist() == list(range(4 * i, 4 * i + 5))
    assert shard.num_samples(22) == 1 and shard.num_samples(23) == 0
    with pytest.raises(IndexError):
        shard.sample(5, 4)


def test_empty_shard(tmp_path: Path) -> None:
    write_shard(tmp_path / "e.bin", [], np.uint16)
    shard = TokenShard(tmp_path / "e.bin")
    assert shard.n_tokens == 0 and shard.n_docs == 0 and shard.num_samples(8) == 0


def test_shard_header_validation(tmp_path: Path) -> None:
    write_shard(tmp_path / "v.bin", [[1, 2, 3]], np.uint16)
    (tmp_path / "v.bin").write_bytes(b"\x01\x00")  # truncated stream
    with pytest.raises(ShardError, match="index says"):
        TokenShard(tmp_path / "v.bin")
    (tmp_path / "v.idx").write_bytes(b"NOTANIDX" + bytes(17))
    with pytest.raises(ShardError, match="not a token shard index"):
        TokenShard(tmp_path / "v.bin")
    with pytest.raises(ShardError, match="cannot read"):
        TokenShard(tmp_path / "missing.bin")


# ---------------------------------------------------------------- corpus

def test_expand_inputs(tmp_path: Path, corpus: Path) -> None:
    files = expand_inputs([str(corpus / "**" / "*.txt"), str(corpus / "part0" / "*.txt")])
    assert len(files) == 20 and files == sorted(files)  # de-duplicated across patterns
    assert expand_inputs([str(corpus / "**" / "*.txt")], max_files=3) == files[:3]
    assert expand_pattern("{stdlib}/*.py") == sysconfig.get_paths()["stdlib"] + "/*.py"


def test_glob_matching_nothing_names_the_field(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(DataError, match=r"^data\.inputs\[1\]: .*nope.* matched no files$"):
        expand_inputs([str(corpus / "**" / "*.txt"), str(tmp_path / "nope" / "*.txt")])
    with pytest.raises(DataError, match=r"^data\.inputs\[0\]: "):
        _run(tmp_path, _data(corpus, inputs=[str(tmp_path / "*.md")]))


def test_jsonl_text_field_and_bad_lines(tmp_path: Path) -> None:
    lines = [json.dumps({"body": "first doc"}), "{not json", json.dumps([1, 2]), json.dumps({"other": "x"}),
             json.dumps({"body": 7}), "", json.dumps({"body": "  "}), json.dumps({"body": "second doc"})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = Corpus([tmp_path / "d.jsonl"], text_field="body")
    assert list(corpus) == ["first doc", "second doc"]
    s = corpus.stats
    assert (s.files_read, s.documents, s.bad_lines, s.files_skipped) == (1, 2, 5, 0)  # blank line ignored
    assert s.bad_line_examples[0].endswith("d.jsonl:2: not valid JSON")
    assert any("'body' is missing" in e for e in s.bad_line_examples)


def test_skipped_files_have_reasons(tmp_path: Path) -> None:
    files = {"empty.txt": b"  \n", "binary.txt": b"abc\x00def", "latin1.txt": "caf\xe9".encode("latin-1"),
             "big.txt": b"x" * 200, "norecords.jsonl": b'{"title": "no text field"}\n',
             "good.txt": "ok \u00e9\n".encode()}
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    corpus = Corpus(sorted(tmp_path / n for n in files), max_file_bytes=100)
    assert list(corpus) == ["ok \u00e9\n"]
    reasons = {Path(s["path"]).name: s["reason"] for s in corpus.stats.skipped}
    assert corpus.stats.files_skipped == 5 and corpus.stats.files_read == 1
    assert reasons["empty.txt"] == "empty"
    assert reasons["binary.txt"].startswith("binary")
    assert reasons["latin1.txt"].startswith("not UTF-8")
    assert reasons["big.txt"].startswith("over data.max_file_bytes (200 > 100")
    assert reasons["norecords.jsonl"].startswith("no usable records")


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_trains_deterministically() -> None:
    docs = [_text(random.Random(i), 120) for i in range(6)]
    a, b = train_tokenizer(docs, 300), train_tokenizer(iter(docs), 300)
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 300
    assert eos_id(a, EOS) == 0
    assert a.decode(a.encode(docs[0]).ids) == docs[0]  # byte-level: lossless
    with pytest.raises(DataError, match="no token '<eos>'"):
        eos_id(a, "<eos>")


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


# ---------------------------------------------------------------- the stage

def test_run_writes_shards_with_eos_between_documents(tmp_path: Path, corpus: Path) -> None:
    work, result = _run(tmp_path, _data(corpus))
    assert set(result.outputs) == {"tokenizer", "train_bin", "train_idx", "val_bin", "val_idx", "meta"}
    assert all((work / p).is_file() for p in result.outputs.values())
    meta = json.loads((work / "data_meta.json").read_text())
    m = result.metrics
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and meta["eos_token"] == EOS
    assert (m["documents"], m["train_documents"], m["val_documents"], m["files_read"]) == (20, 18, 2, 20)
    assert m["tokenizer_trained"] is True and m["files_skipped"] == 0 and m["tokens_per_sec"] > 0

    tok = load_tokenizer(work / "tokenizer.json")
    texts = {p.read_text(encoding="utf-8") for p in corpus.rglob("*.txt")}
    decoded = []
    for split, n_docs in (("train", 18), ("val", 2)):
        shard = TokenShard(work / f"{split}.bin")
        assert shard.n_docs == n_docs and shard.n_tokens == meta[f"{split}_tokens"]
        assert int((shard.tokens == meta["eos_id"]).sum()) == n_docs  # exactly one EOS per document
        assert shard.num_samples(16) == meta[f"{split}_samples"]
        for j in range(n_docs):
            ids = shard.document(j)
            assert ids[-1] == meta["eos_id"]
            decoded.append(tok.decode(ids[:-1].tolist()))
    assert sorted(decoded) == sorted(texts)
    assert m["tokens"] == meta["train_tokens"] + meta["val_tokens"]


def test_eos_text_inside_a_document_is_not_a_boundary(tmp_path: Path, corpus: Path) -> None:
    (corpus / "part0" / "doc000.txt").write_text(f"before {EOS} after\n" * 20, encoding="utf-8")
    work, result = _run(tmp_path, _data(corpus))
    eos = json.loads((work / "data_meta.json").read_text())["eos_id"]
    total_eos = sum(int((TokenShard(work / f"{s}.bin").tokens == eos).sum()) for s in ("train", "val"))
    assert total_eos == result.metrics["documents"] == 20


def test_same_seed_same_bytes_other_seed_other_split(tmp_path: Path, corpus: Path) -> None:
    a, _ = _run(tmp_path, _data(corpus), seed=7, work="a")
    b, _ = _run(tmp_path, _data(corpus), seed=7, work="b")
    c, _ = _run(tmp_path, _data(corpus), seed=8, work="c")
    for name in ("tokenizer.json", "train.bin", "train.idx", "val.bin", "val.idx", "data_meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()  # split-independent
    assert (a / "val.bin").read_bytes() != (c / "val.bin").read_bytes()


def test_existing_tokenizer_is_loaded(tmp_path: Path, corpus: Path) -> None:
    first, _ = _run(tmp_path, _data(corpus), work="first")
    saved = tmp_path / "my_tokenizer.json"
    saved.write_bytes((first / "tokenizer.json").read_bytes())
    data = _data(corpus, tokenizer={"path": str(saved), "vocab_size": 5000})  # vocab_size ignored
    second, result = _run(tmp_path, data, work="second")
    assert result.metrics["tokenizer_trained"] is False and result.metrics["vocab_size"] == 300
    assert (second / "tokenizer.json").read_bytes() == saved.read_bytes()
    assert (second / "train.bin").read_bytes() == (first / "train.bin").read_bytes()


def test_tokenizer_path_errors(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(DataError, match=r"^data\.tokenizer\.path: .*missing\.json: tokenizer file not"):
        _run(tmp_path, _data(corpus, tokenizer={"path": str(tmp_path / "missing.json")}), work="a")
    tok = train_tokenizer([_text(random.Random(0), 60)] * 2, 280, eos_token="<eos>")
    tok.save(str(tmp_path / "other.json"))
    with pytest.raises(DataError, match=r"^data\.tokenizer\.path: .*other\.json: tokenizer has no token"):
        _run(tmp_path, _data(corpus, tokenizer={"path": str(tmp_path / "other.json")}), work="b")


def test_empty_corpus_and_too_few_documents(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_bytes(b"\x00\x01")
    no_docs = r"^data\.inputs: no usable documents in 2 input\(s\) \(e\.g\. .*a\.txt: empty"
    with pytest.raises(DataError, match=no_docs):
        _run(tmp_path, _data(tmp_path, inputs=[str(tmp_path / "*.txt")]), work="a")
    (tmp_path / "a.txt").write_text(_text(random.Random(0), 200))
    with pytest.raises(DataError, match=r"has 1 usable document\(s\) after filters and dedup; need at least 2"):
        _run(tmp_path, _data(tmp_path, inputs=[str(tmp_path / "*.txt")]), work="b")


def test_val_split_too_small(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(DataError, match=r"^data\.seq_len: the val split has \d+ tokens, fewer than one "
                                         r"sample of seq_len\+1 = 4097; raise data\.val_fraction"):
        _run(tmp_path, _data(corpus, seq_len=4096))


def test_split_documents() -> None:
    mask = prepare.split_documents(100, 0.05, seed=3)
    assert mask.sum() == 5 and (mask == prepare.split_documents(100, 0.05, seed=3)).all()
    assert prepare.split_documents(3, 0.01, seed=0).sum() == 1  # at least one validation document


def test_stage_through_the_framework(tmp_path: Path, corpus: Path) -> None:
    cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": _data(corpus)})
    manifest, executed = run_stage("prepare_data", cfg)
    folder = stage_dir(cfg.run_dir(), "prepare_data")
    assert executed and (folder / "manifest.json").is_file()
    assert Manifest.read(folder).verify(folder) is None
    assert set(manifest.outputs) == {"tokenizer", "train_bin", "train_idx", "val_bin", "val_idx", "meta"}
    assert manifest.metrics["documents"] == 20
    assert TokenShard(manifest.path(folder, "train_bin")).n_docs == 18
    _, executed = run_stage("prepare_data", cfg)
    assert not executed
