"""prepare_data against hostile inputs (issue 22, items 1, 2 and 8): a compressed one-line bomb, records
that do not encode, a datasets state.json that is nested, malformed or names files outside its folder,
and symlinks out of a corpus folder. Each is counted or refused with one line; the rest is prepared."""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from llmpipe import stages
from llmpipe.config import ConfigError, from_dict
from llmpipe.data import prepare
from llmpipe.data.corpus import find_inputs
from llmpipe.data.errors import DataError
from llmpipe.data.readers import ErrorLog, plan_units, read_unit
from llmpipe.data.tokenizer import train_tokenizer, training_text
from llmpipe.stages import StageContext

WORDS = "alpha beta gamma delta epsilon zeta theta iota kappa lambda def return class self print".split()
LIMIT = 1000


def _text(seed: int, n_words: int = 60) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


DOCS = [_text(i) for i in range(12)]


def _lines(docs: list[str]) -> bytes:
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)


def _write(path: Path, data: bytes) -> Path:
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=1)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor(level=1).compress(data)
    path.write_bytes(data)
    return path


def _read(paths: list[Path], limit: int = LIMIT, unit_bytes: int = 1 << 30) -> tuple[list[str], ErrorLog]:
    log, docs = ErrorLog(), []
    for unit in plan_units(paths, unit_bytes):
        docs.extend(read_unit(unit, "text", 1 << 30, log, max_record_bytes=limit))
    return docs, log


def _prepare(tmp_path: Path, inputs: list[str], **data):
    cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(tmp_path / "art"), "seed": 1},
                     "data": {"inputs": inputs, "seq_len": 8, "val_fraction": 0.2, "workers": 1,
                              "tokenizer": {"vocab_size": 300}, **data}}, check="fields")
    work = tmp_path / "work"
    work.mkdir()
    result = prepare.run(StageContext(cfg, "prepare_data", tmp_path, work, {}, "test"))
    return result, json.loads((work / "data_meta.json").read_text())


# ---------------------------------------------------------------- item 1: records against a limit

@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_an_over_long_line_is_a_bad_record_and_the_lines_after_it_are_read(tmp_path: Path, suffix: str) -> None:
    big = json.dumps({"text": "x" * 1_000_000}).encode() + b"\n"
    path = _write(tmp_path / f"a{suffix}", _lines(DOCS[:3]) + big + _lines(DOCS[3:]))
    docs, log = _read([path])
    assert docs == DOCS and log.counts == {"bad_record": 1}
    where = f"byte {len(_lines(DOCS[:3]))}" if suffix == ".jsonl" else "line 4"
    assert log.examples == [{"kind": "bad_record", "path": str(path), "where": where,
                             "reason": f"over data.max_record_bytes ({len(big) - 1} > {LIMIT} bytes)"}]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_a_last_line_without_a_newline_over_the_limit_is_a_bad_record(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"a{suffix}", _lines(DOCS) + b'{"text": "' + b"y" * 1_000_000)
    docs, log = _read([path])
    assert docs == DOCS and log.counts == {"bad_record": 1}
    assert log.examples[0]["reason"] == f"over data.max_record_bytes ({1_000_010} > {LIMIT} bytes)"


def test_a_line_of_exactly_the_limit_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    record = json.dumps({"text": "z" * (LIMIT - 12)}).encode()
    assert len(record) == LIMIT
    path = _write(tmp_path / "a.jsonl", record + b"\n" + record[:-1] + b' }\n' + _lines(DOCS[:1]))
    docs, log = _read([path])
    assert docs == ["z" * (LIMIT - 12), DOCS[0]]
    assert log.examples[0]["reason"] == f"over data.max_record_bytes ({LIMIT + 1} > {LIMIT} bytes)"


def test_an_over_long_line_across_work_units_is_counted_once(tmp_path: Path) -> None:
    big = json.dumps({"text": "x" * 300_000}).encode() + b"\n"
    path = _write(tmp_path / "a.jsonl", _lines(DOCS[:6]) + big + _lines(DOCS[6:]))
    assert len(plan_units([path], 1 << 16)) == 2  # the first cut falls inside the long line
    (docs, log), (whole_docs, whole_log) = _read([path], unit_bytes=1 << 16), _read([path])
    assert docs == whole_docs == DOCS and log.to_dict() == whole_log.to_dict()
    assert log.counts == {"bad_record": 1} and log.examples[0]["where"] == f"byte {len(_lines(DOCS[:6]))}"


def test_an_over_long_line_is_read_past_without_being_held(tmp_path: Path) -> None:
    path = tmp_path / "bomb.jsonl.zst"
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=1).stream_writer(raw) as f:
        f.write(b'{"text": "')
        for _ in range(50):
            f.write(b"a" * (1 << 20))  # 50 MB, no newline
    tracemalloc.start()
    try:
        docs, log = _read([path])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert docs == [] and log.counts == {"bad_record": 1}
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MB of Python allocations for a 50 MB line"


def test_a_json_array_record_over_the_limit_is_a_bad_record_and_ends_the_array(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"text": DOCS[0]}, {"text": "x" * 5000}, {"text": DOCS[1]}]))
    docs, log = _read([path])
    assert docs == [DOCS[0]]
    assert log.examples[0]["where"] == "record 1"
    assert log.examples[0]["reason"] == (f"over data.max_record_bytes (more than {LIMIT} characters); "
                                         "the rest of the array is not read")


def test_a_parquet_value_over_the_limit_is_a_bad_record_and_the_others_are_read(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [DOCS[0], "é" * 600, None, DOCS[1]]}), path)
    docs, log = _read([path])
    assert docs == DOCS[:2]
    assert [(e["where"], e["reason"]) for e in log.examples] == [
        ("row 1", f"over data.max_record_bytes (1200 > {LIMIT} bytes)"), ("row 2", "field 'text' is null")]


def test_max_record_bytes_is_bounded_and_in_prepare_datas_fingerprint(tmp_path: Path) -> None:
    tree = {"run": {"name": "t", "artifacts_dir": str(tmp_path / "art")},
            "data": {"inputs": [str(tmp_path / "*.txt")]}}
    with pytest.raises(ConfigError, match="data.max_record_bytes: Input should be greater than or equal to 1"):
        from_dict({**tree, "data": {**tree["data"], "max_record_bytes": 0}}, check="fields")
    base = stages.fingerprints(from_dict(tree, check="fields"))["prepare_data"]
    for field, value in (("max_record_bytes", 1000), ("external_symlinks", "follow")):
        other = from_dict({**tree, "data": {**tree["data"], field: value}}, check="fields")
        assert stages.fingerprints(other)["prepare_data"] != base, field
    other = from_dict({**tree, "data": {**tree["data"], "tokenizer": {"doc_chars": 4096}}}, check="fields")
    assert stages.fingerprints(other)["prepare_data"] != base


def test_prepare_data_counts_a_one_line_bomb_bad_and_prepares_the_rest(tmp_path: Path) -> None:
    _write(tmp_path / "bomb.jsonl.zst", b'{"text": "' + b"b" * 1_000_000)
    _write(tmp_path / "good.jsonl", _lines(DOCS))
    result, meta = _prepare(tmp_path, [str(tmp_path / "*.jsonl*")], max_record_bytes=LIMIT)
    assert meta["documents"] == len(DOCS) and result.metrics["read_errors"] == 1
    assert meta["read_errors"]["examples"] == [
        {"kind": "bad_record", "path": str(tmp_path / "bomb.jsonl.zst"), "where": "line 1",
         "reason": f"over data.max_record_bytes (1000010 > {LIMIT} bytes)"}]


def test_the_tokenizer_trains_on_the_start_of_each_document_only(tmp_path: Path) -> None:
    doc = " ".join(f"w{i}" for i in range(3000))  # ~17k characters of distinct words
    head = training_text(doc, 1024)
    assert len(head) <= 1024 and doc.startswith(head) and doc[len(head)] == " "
    assert training_text(DOCS[0], 1024) is DOCS[0]
    (tmp_path / "a.jsonl").write_bytes(_lines([doc, *DOCS]))
    result, meta = _prepare(tmp_path, [str(tmp_path / "a.jsonl")], tokenizer={"vocab_size": 300, "doc_chars": 1024})
    want = train_tokenizer([head, *DOCS], 300)
    assert json.loads((tmp_path / "work" / "tokenizer.json").read_text())["model"] == \
        json.loads(want.to_str())["model"]
    assert meta["documents"] == len(DOCS) + 1  # the whole document is still tokenized


def test_a_minhash_signature_of_a_long_record_is_computed_in_bounded_memory() -> None:
    from llmpipe.data.dedup import MinHasher

    text = " ".join(f"w{i}" for i in range(200_000))  # 1.3 MB: 200k shingles, a (200k, 128) uint64 array at once
    hasher = MinHasher()
    tracemalloc.start()
    try:
        signature = hasher.signature(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert signature.shape == (128,) and signature.dtype == "uint32"
    assert peak < 80 << 20, f"peak {peak / 2**20:.0f} MB of allocations for a 1.3 MB record"


_BOMB_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from llmpipe.config import from_dict
    from llmpipe.data import prepare
    from llmpipe.stages import StageContext

    out = Path(sys.argv[1]) / "out"
    out.mkdir()
    cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(out / "art"), "seed": 1},
                     "data": {"inputs": [sys.argv[1] + "/in/*"], "seq_len": 8, "workers": 1,
                              "tokenizer": {"vocab_size": 300}}}, check="fields")
    result = prepare.run(StageContext(cfg, "prepare_data", out, out, {}, "test"))
    # NOTE: VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of a big pytest starts high
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak": int(hwm.split()[1]) * 1024,
                      "documents": result.metrics["documents"], "read_errors": result.metrics["read_errors"]}))
""")


def test_a_200_mb_one_line_bomb_leaves_prepare_data_far_below_its_size(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "bomb.jsonl.zst", "wb") as raw, \
            zstandard.ZstdCompressor(level=3).stream_writer(raw) as f:
        f.write(b'{"text": "')
        for _ in range(200):
            f.write(b"ab" * (1 << 19))  # 200 MB decompressed, no newline; the file is ~10 KB
    _write(tmp_path / "in" / "good.jsonl", _lines(DOCS))
    proc = subprocess.run([sys.executable, "-c", _BOMB_CHILD, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "LLMPIPE_PROGRESS": "0"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["documents"] == len(DOCS) and report["read_errors"] == 1
    # the interpreter, numpy, pyarrow and tokenizers take ~150 MB; holding the line would add 200-600 MB
    assert report["peak"] < 300 << 20, f"peak RSS {report['peak'] / 2**20:.0f} MB"


# ---------------------------------------------------------------- item 2: a bad record never kills the stage

def test_a_lone_surrogate_record_is_counted_bad_and_the_corpus_prepared(tmp_path: Path) -> None:
    lines = _lines(DOCS[:4]) + b'{"text": "scraped \\ud800 text"}\n' + _lines(DOCS[4:])
    (tmp_path / "a.jsonl").write_bytes(lines)
    result, meta = _prepare(tmp_path, [str(tmp_path / "a.jsonl")])
    assert meta["documents"] == len(DOCS)
    assert meta["read_errors"]["examples"] == [
        {"kind": "bad_record", "path": str(tmp_path / "a.jsonl"), "where": f"byte {len(_lines(DOCS[:4]))}",
         "reason": "field 'text' does not encode as UTF-8 (a lone surrogate U+D800 at character 8)"}]


def test_a_lone_surrogate_in_a_json_array_record_is_a_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('[{"text": "ok"}, {"text": "\\udfff"}, {"text": "also ok"}]')
    docs, log = _read([path])
    assert docs == ["ok", "also ok"]
    assert log.examples[0]["reason"] == "field 'text' does not encode as UTF-8 (a lone surrogate U+DFFF at character 0)"


def test_a_deeply_nested_record_is_a_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(_lines(DOCS[:1]) + b"[" * 100_000 + b"]" * 100_000 + b"\n" + _lines(DOCS[1:2]))
    docs, log = _read([path], limit=1 << 20)
    assert docs == DOCS[:2]
    assert log.examples[0]["reason"] == "not valid JSON (nested too deeply)"


def _datasets_folder(folder: Path, files: dict[str, list[str]], state: object | None = None) -> Path:
    """A folder as datasets' save_to_disk writes it: arrow stream files, state.json, dataset_info.json."""
    folder.mkdir(parents=True)
    for name, texts in files.items():
        table = pa.table({"text": texts})
        with pa.ipc.new_stream(str(folder / name), table.schema) as w:
            w.write_table(table)
    if state is None:
        state = {"_data_files": [{"filename": n} for n in files]}
    (folder / "state.json").write_text(state if isinstance(state, str) else json.dumps(state))
    (folder / "dataset_info.json").write_text("{}")
    return folder


@pytest.mark.parametrize(("state", "reason"), [
    ("[" * 100_000 + "]" * 100_000, "state.json is not valid JSON (nested too deeply)"),
    ({"_data_files": [{"filename": 5}]}, "state.json: _data_files[0].filename is a int, not a string"),
    ({"_data_files": [{"filename": ["a"]}]}, "state.json: _data_files[0].filename is a list, not a string"),
], ids=["nested", "int-filename", "list-filename"])
def test_an_unusable_state_json_makes_the_folder_one_skipped_input(tmp_path: Path, state, reason: str) -> None:
    folder = _datasets_folder(tmp_path / "ds", {"data-00000-of-00001.arrow": DOCS}, state)
    docs, log = _read([folder])
    assert docs == [] and log.examples == [{"kind": "skipped_file", "path": str(folder), "where": "state.json",
                                            "reason": reason}]
    (tmp_path / "good.jsonl").write_bytes(_lines(DOCS))
    _, meta = _prepare(tmp_path, [str(folder), str(tmp_path / "good.jsonl")])
    assert meta["documents"] == len(DOCS) and meta["read_errors"]["counts"] == {"skipped_file": 1}


# ---------------------------------------------------------------- item 8: inputs are confined

def test_state_json_naming_files_outside_its_folder_is_refused(tmp_path: Path) -> None:
    _datasets_folder(tmp_path / "other", {"data-00000-of-00001.arrow": ["secret one"]})
    outside = str(tmp_path / "other" / "data-00000-of-00001.arrow")
    folder = _datasets_folder(tmp_path / "ds", {"data-00000-of-00001.arrow": DOCS[:2]}, {"_data_files": [
        {"filename": "data-00000-of-00001.arrow"}, {"filename": "../other/data-00000-of-00001.arrow"},
        {"filename": outside}, {"filename": ".."}]})
    (folder / "link.arrow").symlink_to(outside)
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({"_data_files": [*state["_data_files"], {"filename": "link.arrow"}]}))
    docs, log = _read([folder])
    assert docs == DOCS[:2] and log.counts == {"skipped_file": 4}
    assert [e["reason"] for e in log.examples] == [
        "state.json names '../other/data-00000-of-00001.arrow', not a file in the folder",
        f"state.json names {outside!r}, not a file in the folder",
        "state.json names '..', not a file in the folder",
        f"state.json names 'link.arrow', a symlink to {outside}, outside the folder"]


def test_state_json_naming_a_fifo_is_refused_not_opened(tmp_path: Path) -> None:
    folder = _datasets_folder(tmp_path / "ds", {"data-00000-of-00001.arrow": DOCS[:2]}, {"_data_files": [
        {"filename": "data-00000-of-00001.arrow"}, {"filename": "pipe.arrow"}]})
    os.mkfifo(folder / "pipe.arrow")
    # NOTE: held open read-write so that a reader that does open the FIFO fails instead of waiting forever
    fd = os.open(folder / "pipe.arrow", os.O_RDWR | os.O_NONBLOCK)
    try:
        docs, log = _read([folder])
    finally:
        os.close(fd)
    assert docs == DOCS[:2]
    assert log.examples == [{"kind": "skipped_file", "path": str(folder), "where": "pipe.arrow",
                             "reason": "state.json names 'pipe.arrow', not a regular file"}]


def test_a_fifo_matched_by_the_glob_is_not_an_input(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(DOCS[0])
    os.mkfifo(tmp_path / "b.txt")
    assert find_inputs([str(tmp_path / "*.txt")]).files == [tmp_path / "a.txt"]


def _linked_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """corpus/ with documents, an inside alias, a link to a file outside and a link to a folder outside."""
    secret = tmp_path / "private" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("the secret " * 20)
    (tmp_path / "private" / "sub").mkdir()
    (tmp_path / "private" / "sub" / "more.txt").write_text("more secret " * 20)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(DOCS):
        (corpus / f"d{i:02d}.txt").write_text(doc)
    (corpus / "alias.txt").symlink_to(corpus / "d00.txt")
    (corpus / "shadow.txt").symlink_to(secret)
    (corpus / "dir").symlink_to(tmp_path / "private" / "sub")
    return corpus, secret


def test_symlinks_out_of_the_corpus_folder_are_refused_by_default_and_listed(tmp_path: Path, caplog) -> None:
    corpus, secret = _linked_corpus(tmp_path)
    with caplog.at_level(logging.WARNING, logger="llmpipe.data"):
        _, meta = _prepare(tmp_path, [str(corpus / "**" / "*.txt")])
    assert meta["documents"] == len(DOCS) and meta["external_symlinks"] == 2
    assert meta["read_errors"]["examples"] == [
        {"kind": "skipped_file", "path": str(corpus / "dir" / "more.txt"), "where": "file",
         "reason": f"a symlink to {tmp_path / 'private' / 'sub' / 'more.txt'}, outside {corpus} "
                   "(data.external_symlinks: refuse)"},
        {"kind": "skipped_file", "path": str(corpus / "shadow.txt"), "where": "file",
         "reason": f"a symlink to {secret}, outside {corpus} (data.external_symlinks: refuse)"}]
    assert (f"data.inputs: 2 symlink(s) to files outside the folder their pattern starts from not read "
            f"(data.external_symlinks: refuse), e.g. {corpus / 'dir' / 'more.txt'} -> "
            f"{tmp_path / 'private' / 'sub' / 'more.txt'}") in caplog.messages


def test_external_symlinks_follow_reads_them_and_logs_it(tmp_path: Path, caplog) -> None:
    corpus, secret = _linked_corpus(tmp_path)
    inputs = find_inputs([str(corpus / "*.txt")], external_symlinks="follow")
    assert corpus / "shadow.txt" in inputs.files
    assert inputs.external == [(str(corpus / "shadow.txt"), str(secret), str(corpus))]
    with caplog.at_level(logging.WARNING, logger="llmpipe.data"):
        _, meta = _prepare(tmp_path, [str(corpus / "*.txt")], external_symlinks="follow")
    assert meta["documents"] == len(DOCS) + 1 and meta["external_symlinks"] == 1
    assert any("1 symlink(s) read from outside the folder their pattern starts from" in m for m in caplog.messages)


def test_a_path_named_without_a_wildcard_is_read_wherever_it_points(tmp_path: Path) -> None:
    corpus, secret = _linked_corpus(tmp_path)
    inputs = find_inputs([str(corpus / "shadow.txt")])
    assert inputs.files == [corpus / "shadow.txt"] and inputs.external == []


def test_only_refused_symlinks_is_one_error_line(tmp_path: Path) -> None:
    corpus, secret = _linked_corpus(tmp_path)
    with pytest.raises(DataError) as err:
        _prepare(tmp_path, [str(corpus / "shadow*")])
    assert str(err.value) == (f"data.inputs: every match is a symlink out of the folder its pattern starts from, "
                              f"e.g. {corpus / 'shadow.txt'} -> {secret}, outside {corpus}; set "
                              "data.external_symlinks: follow to read them")
