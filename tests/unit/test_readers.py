"""llmpipe.data.readers: every corpus format streamed, split into work units that read the same
documents in the same order as the whole file, and read problems counted, never fatal."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from llmpipe.data.corpus import find_inputs
from llmpipe.data.readers import MAX_EXAMPLES, ErrorLog, Unit, detect_format, plan_units, read_unit


def _read(units: list[Unit], text_field: str = "text", max_file_bytes: int = 1 << 30,
          max_record_bytes: int = 1 << 30) -> tuple[list[str], ErrorLog]:
    """Every unit's documents in order, and the unit logs merged in order (as prepare_data does)."""
    log, docs = ErrorLog(), []
    for unit in units:
        unit = Unit.from_dict(json.loads(json.dumps(unit.to_dict())))  # as it travels to a worker
        one = ErrorLog()
        docs.extend(read_unit(unit, text_field, max_file_bytes, one, max_record_bytes=max_record_bytes))
        log.merge(json.loads(json.dumps(one.to_dict())))
    return docs, log


def _jsonl(texts: list[str], end: str = "\n") -> bytes:
    return end.join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)).encode() + end.encode()


DOCS = [f"document {i} " + "word " * (i % 7) for i in range(300)]


def test_a_parquet_file_read_whole_and_as_two_units_gives_the_same_documents_in_order(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": list(range(300)), "text": DOCS}), path, row_group_size=150)
    whole = plan_units([path], 1 << 30)
    split = plan_units([path], 1)
    assert [(u.start, u.stop) for u in whole] == [(0, None)]
    assert [(u.start, u.stop) for u in split] == [(0, 1), (1, None)]
    assert _read(whole)[0] == _read(split)[0] == DOCS


def test_parquet_nulls_are_bad_records_and_a_missing_column_is_one_entry_per_file(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c", "d"]}), path, row_group_size=2)
    docs, log = _read(plan_units([path], 1))
    assert docs == ["a", "c", "d"]
    assert log.to_dict()["examples"] == [{"kind": "bad_record", "path": str(path), "where": "row 1",
                                          "reason": "field 'text' is null"}]
    docs, log = _read(plan_units([path], 1), text_field="body")
    assert docs == [] and log.counts == {"missing_field": 1}
    assert log.examples[0]["reason"] == "no column 'body' (columns: text)"


def test_a_corrupt_parquet_row_group_is_skipped_and_the_next_ones_are_read(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": DOCS[:30]}), path, row_group_size=10, compression="none")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    start = col.dictionary_page_offset or col.data_page_offset
    data[start: start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    docs, log = _read(plan_units([path], 1 << 30))
    assert docs == DOCS[:10] + DOCS[20:30]
    assert log.counts == {"bad_row_group": 1} and log.examples[0]["where"] == "row group 1"


@pytest.mark.parametrize("end", ["\n", "\r\n"])
@pytest.mark.parametrize("final_newline", [True, False])
def test_a_jsonl_split_into_tiny_byte_ranges_gives_every_line_once_in_order(tmp_path: Path, end: str,
                                                                              final_newline: bool) -> None:
    data = _jsonl(DOCS, end)
    path = tmp_path / "a.jsonl"
    path.write_bytes(data if final_newline else data[: -len(end)])
    units = plan_units([path], 1 << 16)  # tiny next to real units, still > the file: one unit
    assert len(units) == 1
    for unit_bytes in (1, 7, 100, 1000):
        units = plan_units([path], unit_bytes)
        assert len(units) > 1 if unit_bytes < 1000 else True
        assert units[0].start == 0 and units[-1].stop is None and sum(u.size for u in units) == len(path.read_bytes())
        assert all(a.stop == b.start for a, b in zip(units, units[1:]))
        assert [u.index for u in units] == list(range(len(units)))
        docs, log = _read(units)
        assert docs == DOCS and log.total == 0


def test_jsonl_zst_and_jsonl_gz_are_streamed(tmp_path: Path) -> None:
    zst = tmp_path / "a.jsonl.zst"
    half = len(DOCS) // 2  # two zstd frames: a file made by concatenation
    zst.write_bytes(zstandard.ZstdCompressor().compress(_jsonl(DOCS[:half]))
                    + zstandard.ZstdCompressor().compress(_jsonl(DOCS[half:])))
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(_jsonl(DOCS)))
    units = plan_units([zst, gz], 1)  # a compressed stream cannot seek: one unit each
    assert [(u.fmt, u.start, u.stop) for u in units] == [("jsonl.zst", 0, None), ("jsonl.gz", 0, None)]
    docs, log = _read(units)
    assert docs == DOCS + DOCS and log.total == 0


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_truncated_stream_keeps_the_documents_before_the_cut_and_is_logged(tmp_path: Path, suffix: str) -> None:
    data = _jsonl(DOCS * 200)  # many zstd blocks (128 KB each): the cut falls after some
    packed = gzip.compress(data) if suffix.endswith("gz") else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"a{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    docs, log = _read(plan_units([path], 1))
    assert 0 < len(docs) < len(DOCS) * 200 and docs == (DOCS * 200)[: len(docs)]
    assert log.counts == {"truncated_stream": 1}
    assert log.examples[0]["where"].startswith("line ") and "truncated" in log.examples[0]["reason"]


def test_bad_records_are_counted_with_where_and_why(tmp_path: Path) -> None:
    lines = [b'{"text": "ok 1"}', b"{not json", b'{"body": "no text"}', b'{"text": 5}', b'["a list"]',
             b'{"text": null}', b"", b'\xff{"text": "x"}', b'{"text": "ok 2"}']
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    docs, log = _read(plan_units([path, gz], 1))
    assert docs == ["ok 1", "ok 2"] * 2
    assert log.counts == {"bad_record": 12}
    starts = [sum(len(line) + 1 for line in lines[:i]) for i in range(len(lines))]
    reasons = ["not valid JSON", "field 'text' is missing", "field 'text' is a int, not a string",
               "a JSON list, not an object", "field 'text' is null, not a string",
               "not UTF-8 (invalid byte at offset 0 of the line)"]
    assert log.examples[:6] == [{"kind": "bad_record", "path": str(path), "where": f"byte {starts[i]}", "reason": r}
                                for i, r in zip((1, 2, 3, 4, 5, 7), reasons)]
    assert [e["where"] for e in log.examples[6:]] == ["line 2", "line 3", "line 4", "line 5", "line 6", "line 8"]


def _save_dataset(path: Path, texts: list, max_shard_size: int | None = None) -> None:
    from datasets import Dataset

    ds = Dataset.from_dict({"id": list(range(len(texts))), "text": texts})
    ds.save_to_disk(str(path), max_shard_size=max_shard_size)


def test_a_datasets_folder_is_read_without_datasets_and_split_into_units(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    texts = DOCS[:250] + [None] + DOCS[250:]
    _save_dataset(folder, texts, max_shard_size=2000)
    assert len(list(folder.glob("data-*.arrow"))) > 1
    assert detect_format(folder) == "datasets"
    code = ("import sys, json; from pathlib import Path; from llmpipe.data.readers import ErrorLog, plan_units, "
            "read_unit\nunits = plan_units([Path(sys.argv[1])], 1)\nlog = ErrorLog()\n"
            "docs = [d for u in units for d in read_unit(u, 'text', 1 << 30, log, max_record_bytes=1 << 30)]\n"
            "print(json.dumps({'units': len(units), 'docs': docs, 'log': log.to_dict(), "
            "'datasets': 'datasets' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    assert out["datasets"] is False and out["units"] > 1
    assert out["docs"] == DOCS and out["log"]["counts"] == {"bad_record": 1}
    name, _, row = out["log"]["examples"][0]["where"].partition(" row ")
    files = sorted(folder.glob("data-*.arrow"))
    before = sum(pa.ipc.open_stream(pa.memory_map(str(f))).read_all().num_rows for f in files if f.name < name)
    assert before + int(row) == 250  # the null's row in its arrow file
    assert _read(plan_units([folder], 1 << 30))[0] == DOCS


def test_find_inputs_takes_a_datasets_folder_as_one_input(tmp_path: Path) -> None:
    _save_dataset(tmp_path / "corpus" / "ds", DOCS[:5])
    (tmp_path / "corpus" / "other").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a text")
    for pattern in ("corpus/*", "corpus/**", "corpus/ds/**", "corpus/**/*"):
        files = find_inputs([str(tmp_path / pattern)]).files
        want = [tmp_path / "corpus" / "ds"] if pattern == "corpus/ds/**" else \
            [tmp_path / "corpus" / "a.txt", tmp_path / "corpus" / "ds"]
        assert files == want, pattern


def test_a_json_array_and_a_json_of_lines(tmp_path: Path) -> None:
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"text": t} for t in DOCS[:100]] + [{"text": 7}, 12, {"text": "last"}], indent=1))
    lines = tmp_path / "b.json"
    lines.write_bytes(_jsonl(DOCS))
    units = plan_units([array, lines], 200)
    assert [u.fmt for u in units] == ["json"] * len(units) and len(units) > 2
    assert [u.path for u in units].count(str(array)) == 1  # an array is never split
    docs, log = _read(units)
    assert docs == DOCS[:100] + ["last"] + DOCS
    assert [(e["where"], e["reason"]) for e in log.examples] == [
        ("record 100", "field 'text' is a int, not a string"), ("record 101", "a JSON int, not an object")]


def test_a_json_array_is_streamed_across_blocks_and_a_broken_one_keeps_the_records_before(
        tmp_path: Path, monkeypatch) -> None:
    from llmpipe.data import readers

    monkeypatch.setattr(readers, "READ_BYTES", 16)  # every record and number spans block ends
    path = tmp_path / "a.json"
    records = [{"text": t, "n": 123456789} for t in DOCS[:50]] + [{"text": "x" * 1000}]
    path.write_text("\ufeff" + json.dumps(records))  # a BOM, dropped
    assert _read(plan_units([path], 1))[0] == DOCS[:50] + ["x" * 1000]
    path.write_text(json.dumps(records)[:-300])
    docs, log = _read(plan_units([path], 1))
    assert docs == DOCS[:50] and log.counts == {"bad_record": 1}
    assert log.examples[0]["where"] == "record 50"
    path.write_bytes(json.dumps(records[:3]).encode()[:-40] + b"\xff" + json.dumps(records[:3]).encode()[-40:])
    docs, log = _read(plan_units([path], 1))
    assert len(docs) < 3 and docs == DOCS[: len(docs)]  # the records before the block with the bad byte
    assert log.examples[0]["reason"] == "not UTF-8 (invalid start byte); the rest of the array is not read"


def test_txt_gz_and_txt_zst_are_one_document_each(tmp_path: Path) -> None:
    text = "a whole file\nis one document\n" * 100
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "b.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    units = plan_units([tmp_path / "a.txt.gz", tmp_path / "b.txt.zst"], 1)
    assert [u.fmt for u in units] == ["txt.gz", "txt.zst"]
    assert _read(units)[0] == [text, text]
    docs, log = _read(units, max_file_bytes=1000)  # checked on the decompressed size
    assert docs == [] and log.counts == {"skipped_file": 2}
    assert log.examples[0]["reason"] == "over data.max_file_bytes (more than 1000 bytes decompressed)"


def test_max_file_bytes_skips_a_big_txt_but_not_a_big_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x" * 5000)
    (tmp_path / "b.jsonl").write_bytes(_jsonl(DOCS))
    (tmp_path / "c.txt").write_bytes(b"nul \x00 byte")
    (tmp_path / "d.txt").write_bytes(b"ok \xe9 not utf-8")
    (tmp_path / "e.txt").write_text("small")
    files = sorted(tmp_path.iterdir())
    docs, log = _read(plan_units(files, 1 << 30), max_file_bytes=1000)
    assert docs == DOCS + ["small"]
    assert [(Path(e["path"]).name, e["reason"]) for e in log.examples] == [
        ("a.txt", "over data.max_file_bytes (5000 > 1000 bytes)"), ("c.txt", "binary (contains NUL bytes)"),
        ("d.txt", "not UTF-8 (invalid byte at offset 3)")]


def test_error_log_keeps_the_first_50_examples_and_every_count_and_merges_deterministically() -> None:
    units = []
    for u in range(7):
        one = ErrorLog()
        for i in range(u * 15):
            one.add("bad_record" if i % 3 else "truncated_stream", f"f{u}", f"line {i}", "why")
        units.append(one.to_dict())
    assert [len(d["examples"]) for d in units] == [0, 15, 30, 45, 50, 50, 50]
    whole = ErrorLog()
    for u in range(7):
        for i in range(u * 15):
            whole.add("bad_record" if i % 3 else "truncated_stream", f"f{u}", f"line {i}", "why")
    merged = ErrorLog()
    for d in units:
        merged.merge(d)
    assert merged.to_dict() == whole.to_dict()
    assert merged.total == sum(range(7)) * 15 and len(merged.examples) == MAX_EXAMPLES
    assert merged.examples[-1] == {"kind": "bad_record", "path": "f3", "where": "line 4", "reason": "why"}


def test_reading_a_50_mb_jsonl_gz_keeps_memory_far_below_the_file_size(tmp_path: Path) -> None:
    line = (json.dumps({"text": "the same few words again and again " * 25}) + "\n").encode()
    block = line * 1000
    path = tmp_path / "big.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        for _ in range(50_000_000 // len(block)):
            f.write(block)
    (unit,) = plan_units([path], 1 << 20)
    log = ErrorLog()
    tracemalloc.start()
    try:
        n = sum(1 for _ in read_unit(unit, "text", 1 << 20, log, max_record_bytes=1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 50_000_000 // len(block) * 1000 and log.total == 0
    assert peak < 10 << 20, f"peak {peak / 2**20:.1f} MB"


def test_detect_format_by_name() -> None:
    names = {"a.txt": "txt", "a.py": "txt", "a.jsonl": "jsonl", "a.JSON": "json", "a.parquet": "parquet",
             "a.jsonl.gz": "jsonl.gz", "a.jsonl.zst": "jsonl.zst", "a.txt.gz": "txt.gz", "a.txt.zst": "txt.zst"}
    assert {n: detect_format(Path("/nowhere") / n) for n in names} == names
