"""prepare_data over work units: a corpus in every format, dedup and filters counted, and shards that
are byte-identical whatever the number of workers, the unit size, or an interruption in between."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from llmpipe import stages
from llmpipe.config import from_dict
from llmpipe.data import prepare
from llmpipe.data.shards import TokenShard

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega river stone cloud forest engine signal vector matrix kernel tensor").split()


def _doc(rng: random.Random, n: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def make_corpus(root: Path) -> dict:
    """Every format once: parquet with two row groups, jsonl.zst, a datasets folder, a truncated
    .gz, plain jsonl with a bad line and a record without the field, a .txt; plus exact duplicates
    across files. Returns what the test expects."""
    from datasets import Dataset

    rng = random.Random(0)
    root.mkdir(parents=True)
    docs = [_doc(rng) for _ in range(60)]
    dup = docs[3]
    pq.write_table(pa.table({"text": docs[:20], "id": list(range(20))}), root / "a.parquet", row_group_size=10)
    with open(root / "b.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": t}) + "\n" for t in [*docs[20:30], dup]).encode()))
    Dataset.from_dict({"text": [*docs[30:40], dup.upper()]}).save_to_disk(str(root / "c_dataset"))
    gz = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in docs[40:50]).encode())
    (root / "d.jsonl.gz").write_bytes(gz[: len(gz) * 2 // 3])  # truncated mid-stream
    lines = [json.dumps({"text": t}) for t in docs[50:58]] + ["{not json", json.dumps({"body": "no text field"})]
    (root / "e.jsonl").write_text("\n".join(lines) + "\n")
    (root / "f.txt").write_text(docs[58] + "\n" + docs[59])
    (root / "g.txt").write_text("   \n")  # blank: skipped as "empty"
    return {"dup_exact": 1, "dup_case": 1}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "in"
    make_corpus(root)
    return root


def _cfg(tmp_path: Path, corpus: Path, name: str = "t", **data):
    return from_dict({"run": {"name": name, "artifacts_dir": str(tmp_path / "artifacts"), "seed": 5},
                      "data": {"inputs": [str(corpus / "*")], "seq_len": 16, "val_fraction": 0.1,
                               "tokenizer": {"vocab_size": 300}, "workers": 1, **data}})


def _digests(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
            for n in ("tokenizer.json", "train.bin", "train.idx", "val.bin", "val.idx")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("ref")
    cfg = _cfg(tmp, corpus)
    manifest, _ = stages.run_stage("prepare_data", cfg)
    folder = stages.stage_dir(cfg.run_dir(), "prepare_data")
    return cfg, manifest, folder, _digests(folder)


def test_every_format_prepares_with_the_expected_counts(reference):
    cfg, manifest, folder, _ = reference
    meta = json.loads((folder / "data_meta.json").read_text())
    # 20 parquet + 11 zst + 11 datasets + some of the truncated gz + 8 jsonl + 2 txt (g.txt is blank: skipped)
    gz_read = meta["documents_read"] - (20 + 11 + 11 + 8 + 2)
    assert 1 <= gz_read < 10  # the documents before the cut are kept
    errors = meta["read_errors"]
    assert errors["counts"].get("truncated_stream") == 1 and errors["counts"].get("bad_record") == 2
    assert errors["counts"].get("skipped_file") == 1  # the blank g.txt: "empty"
    kinds = {e["kind"] for e in errors["examples"]}
    assert {"truncated_stream", "bad_record"} <= kinds
    assert meta["filtered"] == {}
    # the exact copy (jsonl.zst) and the upper-case copy (datasets folder) of docs[3] go
    assert meta["duplicates_removed"] == 2
    assert meta["documents"] == meta["documents_read"] - 2
    assert meta["train_documents"] + meta["val_documents"] == meta["documents"]
    assert meta["units"] >= 7 and meta["inputs"] == 7
    train = TokenShard(folder / "train.bin")
    val = TokenShard(folder / "val.bin")
    assert train.n_docs + val.n_docs == meta["documents"]
    assert manifest.metrics["duplicates_removed"] == 2 and manifest.metrics["read_errors"] == 4
    assert not (cfg.run_dir() / ".01_prepare_data.units").exists()  # merged, then removed


def test_two_workers_and_tiny_units_give_byte_identical_shards(tmp_path, corpus, reference):
    cfg = _cfg(tmp_path, corpus, workers=2, unit_bytes=1 << 16)
    stages.run_stage("prepare_data", cfg)
    assert _digests(stages.stage_dir(cfg.run_dir(), "prepare_data")) == reference[3]


def test_an_interrupted_stage_resumes_with_the_units_done_and_gives_the_same_bytes(tmp_path, corpus, reference,
                                                                                     monkeypatch, caplog):
    cfg = _cfg(tmp_path, corpus)
    monkeypatch.setenv("LLMPIPE_FAIL_AFTER_UNITS", "3")
    with pytest.raises(InterruptedError, match="interrupted after 3 work units"):
        stages.run_stage("prepare_data", cfg)
    cache = cfg.run_dir() / ".01_prepare_data.units"
    done = sorted(p.name for p in cache.iterdir() if (p / "meta.json").is_file())
    assert len(done) == 3
    monkeypatch.delenv("LLMPIPE_FAIL_AFTER_UNITS")
    caplog.set_level("INFO", logger="llmpipe.data")
    stages.run_stage("prepare_data", cfg)
    assert "resuming, 3 of" in caplog.text
    assert _digests(stages.stage_dir(cfg.run_dir(), "prepare_data")) == reference[3]


def test_dedup_none_keeps_the_copies_and_minhash_catches_the_near_copy(tmp_path, corpus):
    none = _cfg(tmp_path, corpus, name="none", dedup="none")
    stages.run_stage("prepare_data", none)
    meta = json.loads((stages.stage_dir(none.run_dir(), "prepare_data") / "data_meta.json").read_text())
    assert meta["duplicates_removed"] == 0
    near = _cfg(tmp_path, corpus, name="minhash", dedup="minhash")
    stages.run_stage("prepare_data", near)
    meta = json.loads((stages.stage_dir(near.run_dir(), "prepare_data") / "data_meta.json").read_text())
    assert meta["duplicates_removed"] >= 2  # the exact and the case-changed copy at least


def test_the_tokenizer_trains_on_a_seeded_sample(tmp_path, corpus, reference):
    cfg = _cfg(tmp_path, corpus, name="s1", tokenizer={"vocab_size": 300, "sample_docs": 10})
    manifest, _ = stages.run_stage("prepare_data", cfg)
    meta = json.loads((stages.stage_dir(cfg.run_dir(), "prepare_data") / "data_meta.json").read_text())
    assert meta["tokenizer"]["sample_documents"] == 10
    again = _cfg(tmp_path, corpus, name="s2", tokenizer={"vocab_size": 300, "sample_docs": 10})
    stages.run_stage("prepare_data", again)
    first, second = (stages.stage_dir(c.run_dir(), "prepare_data") / "tokenizer.json" for c in (cfg, again))
    assert first.read_bytes() == second.read_bytes()  # seeded: the same sample
    assert first.read_bytes() != (reference[2] / "tokenizer.json").read_bytes()


def test_sample_documents_is_uniform_bounded_and_in_corpus_order():
    docs = [f"doc {i:03d}" for i in range(200)]
    sample = prepare.sample_documents(iter(docs), 20, None, seed=1)
    assert len(sample) == 20 and sample == sorted(sample)  # corpus order kept
    assert sample == prepare.sample_documents(iter(docs), 20, None, seed=1)
    assert sample != prepare.sample_documents(iter(docs), 20, None, seed=2)
    by_bytes = prepare.sample_documents(iter(docs), None, 70, seed=1)
    assert sum(len(d) for d in by_bytes) <= 70 and len(by_bytes) == 10  # 7 bytes each
    picks = np.concatenate([[int(d[4:]) for d in prepare.sample_documents(iter(docs), 20, None, seed=s)]
                            for s in range(50)])
    assert 0.35 < (picks < 100).mean() < 0.65  # both halves of the corpus are drawn


def test_nothing_usable_is_one_clear_error(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "x.jsonl").write_text('{"body": 1}\n{nope\n')
    cfg = _cfg(tmp_path, folder)
    with pytest.raises(stages.StageError, match=r"data.inputs: no usable documents in 1 input\(s\)"):
        stages.run_stage("prepare_data", cfg)
