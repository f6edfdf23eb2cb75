"""Corpus formats, read as streams and split into work units (no Prefect, no torch, no `datasets`).

A corpus is a list of inputs (corpus.find_inputs: files, and folders saved by datasets'
`save_to_disk`). `plan_units` cuts each input into `Unit`s: a big .jsonl into line-aligned byte
ranges, a parquet file into ranges of row groups, a datasets folder into ranges of record batches;
anything else is one unit. `read_unit` yields a unit's documents as str. The canonical document
order is: inputs in find_inputs order, units in order, documents in file order; units cover each
input exactly once, so reading all units in order gives the same documents whatever `unit_bytes`.

Problems never stop a read: they are counted in an `ErrorLog` by kind (ERROR_KINDS) with the first
examples, and everything readable is kept. A unit's log is a dict (`to_dict`) so it can come back
from another process; merging unit logs in unit order gives the same log for any worker count.
Error positions ("where") do not depend on the unit size either: a byte offset in an uncompressed
JSON-lines file (counting lines would mean reading the file from its start for every unit), a line
number in a compressed stream, a row number in parquet and arrow files.

Inputs are untrusted: a record (a JSON line, an array element, a parquet or arrow value) longer than
`max_record_bytes` is a bad record, and a line is read against that limit in blocks, so a line with
no end (a compressed one-line bomb) is passed over without being held. A record whose text does not
encode as UTF-8 (a lone surrogate from a JSON escape) is a bad record too. A datasets folder's
state.json may name only regular files inside the folder.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc

MAX_EXAMPLES = 50  # examples an ErrorLog keeps; every problem is counted
READ_BYTES = 1 << 18  # block size of streamed reads
BATCH_ROWS = 1024  # parquet rows converted to Python at a time
STATE_BYTES = 1 << 20  # a datasets state.json (a list of file names) larger than this is refused
ERROR_KINDS = {
    "skipped_file": "a whole-file document or an input that cannot be opened: binary, not UTF-8, too big, "
                    "unreadable, not parquet/arrow",
    "bad_record": "a record that is not JSON, not an object, lacks the text field, holds a non-string/null, "
                  "is longer than data.max_record_bytes or does not encode as UTF-8 (a lone surrogate)",
    "truncated_stream": "a compressed or arrow stream that ends early or is corrupt; what came before is kept",
    "missing_field": "a parquet file or datasets folder without a string column named text_field (once per input)",
    "bad_row_group": "a parquet row group that cannot be read; the next ones still are",
}
_COMPRESSED = {".jsonl.gz": "jsonl.gz", ".ndjson.gz": "jsonl.gz", ".json.gz": "jsonl.gz",
               ".jsonl.zst": "jsonl.zst", ".ndjson.zst": "jsonl.zst", ".json.zst": "jsonl.zst",
               ".gz": "txt.gz", ".zst": "txt.zst"}
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
_NOT_SPACE = re.compile(r"\S")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Unit:
    """A piece of work: documents [start, stop) of one input, in units of its format: bytes (jsonl,
    json lines), row groups (parquet), record batches over the folder's arrow files (datasets);
    stop None = to the end. `size`: approximate bytes, for progress."""

    index: int
    path: str
    fmt: str
    start: int = 0
    stop: int | None = None
    size: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Unit:
        return cls(**d)


class ErrorLog:
    """Read problems: a count per kind, and the first MAX_EXAMPLES {kind, path, where, reason}."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.examples: list[dict[str, str]] = []

    def add(self, kind: str, path: str | Path, where: str, reason: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"kind": kind, "path": str(path), "where": where, "reason": reason})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "counts": dict(sorted(self.counts.items())), "examples": list(self.examples)}

    def merge(self, other: dict[str, Any]) -> None:
        """Add another log's `to_dict()` after this one's (merge units in unit order)."""
        for kind, n in other.get("counts", {}).items():
            self.counts[kind] = self.counts.get(kind, 0) + n
        self.examples.extend(other.get("examples", [])[: MAX_EXAMPLES - len(self.examples)])


class ChatRecords:
    """What the readers take of a record with data.format: chat, in place of a text field: its
    conversation (llmpipe.data.chat.conversation: messages_field, or an Alpaca record), passed on as the
    canonical JSON of its messages; a record without a valid one is a bad record (the reason says why)."""

    def __init__(self, messages_field: str, encoder: Callable | None = None):
        self.messages_field = messages_field
        # encoder(messages) -> (ids, labels, why): a conversation that leaves nothing to train is a bad
        # record too, listed where the reader found it; the last record's (messages, ids, labels) is `last`
        self.encoder = encoder
        self.last: tuple = ()

    def __str__(self) -> str:
        return self.messages_field

    def take(self, record: Any) -> tuple[str | None, str]:
        from llmpipe.data.chat import conversation, to_document

        messages, why = conversation(record, self.messages_field)
        if messages is None:
            return None, why
        if self.encoder is not None:
            ids, labels, why = self.encoder(messages)
            if ids is None:
                return None, why
            self.last = (messages, ids, labels)
        else:
            self.last = (messages, None, None)
        return to_document(messages), ""

    def columns(self, schema) -> tuple[list[str] | None, str]:
        """The columns to read of a table, or (None, why there are none)."""
        if self.messages_field in schema.names:
            return [self.messages_field], ""
        if "instruction" in schema.names and "output" in schema.names:
            return [c for c in ("instruction", "input", "output", "system") if c in schema.names], ""
        return None, (f"no column {self.messages_field!r} and no Alpaca 'instruction' and 'output' "
                      f"(columns: {', '.join(schema.names)})")


def _chat_rows(batch, path: str, where: Callable[[int], str], fields: ChatRecords, limit: int,
               log: ErrorLog) -> Iterator[str]:
    """The conversations of a record batch (its chat columns); invalid or over-long ones are bad records."""
    for i, row in enumerate(batch.to_pylist()):
        doc, why = fields.take(row)
        if doc is not None and len(doc) > limit and len(doc.encode("utf-8")) > limit:
            doc, why = None, _too_long(len(doc.encode("utf-8")), limit)
        if doc is None:
            log.add("bad_record", path, where(i), why)
        else:
            yield doc


def _columns(schema, field: str | ChatRecords) -> tuple[list[str] | None, str]:
    if isinstance(field, ChatRecords):
        return field.columns(schema)
    why = _string_column(schema, field)
    return (None, why) if why else ([field], "")


def _values(batch, path: str, where: Callable[[int], str], field: str | ChatRecords, limit: int,
            log: ErrorLog) -> Iterator[str]:
    """The documents of a record batch holding the columns `_columns` chose."""
    if isinstance(field, ChatRecords):
        return _chat_rows(batch, path, where, field, limit, log)
    return _texts(batch.column(0), path, where, field, limit, log)


def _no_conversation(unit: Unit, text_field, log: ErrorLog) -> bool:
    """A whole-file text document read with data.format: chat: skipped, with the reason."""
    if isinstance(text_field, ChatRecords):
        log.add("skipped_file", unit.path, "file", "a text file holds no conversation (data.format: chat reads "
                "records: jsonl, json, parquet, datasets folders)")
        return True
    return False


# --------------------------------------------------------------------------- formats and units


def is_datasets_folder(path: str | Path) -> bool:
    """A folder written by datasets' `save_to_disk` (state.json + dataset_info.json + data-*.arrow)."""
    path = Path(path)
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def detect_format(path: Path) -> str | None:
    """The format `read_unit` reads `path` as, by name (a datasets folder by its contents); None for
    another folder. A .json file is "json" whether it holds an array or JSON lines (read decides)."""
    path = Path(path)
    if path.is_dir():
        return "datasets" if is_datasets_folder(path) else None
    name = path.name.lower()
    for suffix, fmt in _COMPRESSED.items():  # longest first
        if name.endswith(suffix):
            return fmt
    return _SUFFIXES.get(Path(name).suffix, "txt")


def plan_units(files: Sequence[Path], unit_bytes: int) -> list[Unit]:
    """The work units of `files`, in canonical order. Reads only metadata and a few bytes at each cut."""
    units: list[Unit] = []
    for path in files:
        path = Path(path)
        fmt = detect_format(path)
        if fmt is None:
            from llmpipe.data.errors import DataError

            raise DataError(f"data.inputs: {path} is a folder, not a datasets save_to_disk folder "
                            "(state.json + dataset_info.json)")
        for start, stop, size in _ranges(path, fmt, unit_bytes):
            units.append(Unit(len(units), str(path), fmt, start, stop, size))
    return units


def _ranges(path: Path, fmt: str, unit_bytes: int) -> list[tuple[int, int | None, int]]:
    """[(start, stop, size)] covering `path` once; one range when it cannot be split (or cannot be
    opened: read_unit then reports why)."""
    try:
        if fmt == "jsonl" or (fmt == "json" and _first_char(path) != "["):
            return _line_ranges(path, unit_bytes)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            return _group([sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
                           for g in range(meta.num_row_groups)], unit_bytes)
        if fmt == "datasets":
            return _group([b.get_total_buffer_size() for _, b, err in _folder_batches(path, _arrow_files(path))
                           if err is None], unit_bytes)
        return [(0, None, path.stat().st_size)]
    except (OSError, UnicodeDecodeError, pa.ArrowException, _Unusable):
        return [(0, None, 0)]


def _group(sizes: list[int], unit_bytes: int) -> list[tuple[int, int | None, int]]:
    """Consecutive items in ranges of about `unit_bytes` (closed once they reach it); the last open-ended."""
    ranges, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= unit_bytes and i + 1 < len(sizes):
            ranges.append((start, i + 1, acc))
            start, acc = i + 1, 0
    ranges.append((start, None, acc))
    return ranges


def _line_ranges(path: Path, unit_bytes: int) -> list[tuple[int, int | None, int]]:
    """Byte ranges of about `unit_bytes`, each starting at a line start: a range holds whole lines."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        while (cut := _next_line_start(f, cuts[-1] + unit_bytes)) < size:
            cuts.append(cut)
    ends: list[int | None] = [*cuts[1:], None]
    return [(a, b, (size if b is None else b) - a) for a, b in zip(cuts, ends)]


def _next_line_start(f: BinaryIO, pos: int) -> int:
    """The first line start at or after `pos` (the file's size when there is none)."""
    f.seek(pos - 1)
    offset = pos - 1
    while block := f.read(READ_BYTES):
        if (i := block.find(b"\n")) >= 0:
            return offset + i + 1
        offset += len(block)
    return offset


def _first_char(path: Path) -> str:
    """The first character of a file that is not whitespace or a BOM ('' when there is none)."""
    with open(path, "rb") as f:
        while block := f.read(4096):
            text = block.decode("utf-8", "replace").lstrip(" \t\r\n\ufeff")
            if text:
                return text[0]
    return ""


# --------------------------------------------------------------------------- reading


def read_unit(unit: Unit, text_field: str, max_file_bytes: int, log: ErrorLog, *,
              max_record_bytes: int) -> Iterator[str]:
    """The documents of `unit` in file order; problems go to `log` (see ERROR_KINDS). Memory stays
    flat in the file size: records are streamed, each at most `max_record_bytes` (longer ones are bad
    records, never held whole); a whole-file document (txt, txt.gz, txt.zst) is at most
    `max_file_bytes`, larger ones are skipped."""
    return _READERS[unit.fmt](unit, text_field, max_file_bytes, max_record_bytes, log)


def _read_txt(unit: Unit, text_field: str, max_file_bytes: int, limit: int, log: ErrorLog) -> Iterator[str]:
    if _no_conversation(unit, text_field, log):
        return
    try:
        size = Path(unit.path).stat().st_size
        if size > max_file_bytes:
            log.add("skipped_file", unit.path, "file", f"over data.max_file_bytes ({size} > {max_file_bytes} bytes)")
            return
        with open(unit.path, "rb") as f:
            text, why = _whole_text(f, max_file_bytes)
    except OSError as err:
        log.add("skipped_file", unit.path, "file", f"unreadable ({err.strerror or err})")
        return
    if text is None:
        log.add("skipped_file", unit.path, "file", why)
    else:
        yield text


def _read_txt_stream(unit: Unit, text_field: str, max_file_bytes: int, limit: int, log: ErrorLog) -> Iterator[str]:
    """A compressed text file is one document; a truncated one is dropped (it is the only document)."""
    if _no_conversation(unit, text_field, log):
        return
    try:
        with _open_stream(unit) as f:
            text, why = _whole_text(f, max_file_bytes, " decompressed")
    except STREAM_ERRORS as err:
        _stream_failed(unit, err, "file", log)
        return
    if text is None:
        log.add("skipped_file", unit.path, "file", why)
    else:
        yield text


def _whole_text(f: BinaryIO, limit: int, what: str = "") -> tuple[str | None, str]:
    """(text, "") or (None, why not): more than `limit` bytes, binary, not UTF-8. Reasons as in
    corpus._check_file; a leading BOM (an encoding marker, not text) is dropped; a blank file is
    "empty" (a file that holds nothing is an input problem, reported as one)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts, offset = [], 0
    while block := f.read(READ_BYTES):
        if offset + len(block) > limit:
            return None, f"over data.max_file_bytes (more than {limit} bytes{what})"
        if b"\x00" in block:
            return None, "binary (contains NUL bytes)"
        try:
            parts.append(decoder.decode(block))
        except UnicodeDecodeError as err:  # err.object = the bytes held back from the last block + this one
            return None, f"not UTF-8 (invalid byte at offset {offset + len(block) - len(err.object) + err.start})"
        offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:  # the file ends inside a multi-byte character
        return None, f"not UTF-8 (invalid byte at offset {offset - len(err.object) + err.start})"
    text = "".join(parts).removeprefix("\ufeff")
    return (text, "") if text.strip() else (None, "empty")


def _read_jsonl(unit: Unit, text_field: str, max_file_bytes: int, limit: int, log: ErrorLog) -> Iterator[str]:
    try:
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            yield from _records(_range_lines(f, unit.start, unit.stop, limit), unit.path, text_field, limit, log)
    except OSError as err:
        log.add("skipped_file", unit.path, "file", f"unreadable ({err.strerror or err})")


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, size) for each line from where `f` is: the line's bytes with its newline, or None when
    it holds more than `limit` bytes before its newline (then `size` is that count). An over-long line
    is read past in blocks of READ_BYTES, never held: a 3 GB line without a newline costs one block."""
    while raw := f.readline(limit + 1):
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        size = len(raw)
        while chunk := f.readline(READ_BYTES):
            if chunk.endswith(b"\n"):
                yield None, size + len(chunk) - 1
                break
            size += len(chunk)
        else:
            yield None, size


def _range_lines(f: BinaryIO, start: int, stop: int | None, limit: int) -> Iterator[tuple[str, bytes | None, int]]:
    """("byte N", line, size) for the lines starting in [start, stop) (see _lines); `f` is at `start`,
    a line start."""
    pos = start
    for raw, size in _lines(f, limit):
        if stop is not None and pos >= stop:
            return
        yield f"byte {pos}", raw.removeprefix(b"\xef\xbb\xbf") if pos == 0 and raw else raw, size
        pos += len(raw) if raw is not None else size + 1


def _read_jsonl_stream(unit: Unit, text_field: str, max_file_bytes: int, limit: int, log: ErrorLog) -> Iterator[str]:
    lineno = 0
    try:
        with _open_stream(unit) as f:
            for lineno, (raw, size) in enumerate(_lines(f, limit), start=1):
                raw = raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 and raw else raw
                yield from _records([(f"line {lineno}", raw, size)], unit.path, text_field, limit, log)
    except STREAM_ERRORS as err:
        _stream_failed(unit, err, f"line {lineno + 1}", log)


def _stream_failed(unit: Unit, err: BaseException, where: str, log: ErrorLog) -> None:
    if isinstance(err, FileNotFoundError | PermissionError | IsADirectoryError):
        log.add("skipped_file", unit.path, "file", f"unreadable ({err.strerror or err})")
    else:
        log.add("truncated_stream", unit.path, where, f"truncated or corrupt compressed stream ({_first_line(err)})")


def _records(lines: Iterable[tuple[str, bytes | None, int]], path: str, text_field: str, limit: int,
             log: ErrorLog) -> Iterator[str]:
    """The `text_field` strings of JSON-lines records; blank lines are skipped, bad ones counted (an
    over-long line comes as (where, None, its size))."""
    for where, raw, size in lines:
        if raw is None:
            log.add("bad_record", path, where, _too_long(size, limit))
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            log.add("bad_record", path, where, f"not UTF-8 (invalid byte at offset {err.start} of the line)")
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            log.add("bad_record", path, where, "not valid JSON")
            continue
        except RecursionError:
            log.add("bad_record", path, where, "not valid JSON (nested too deeply)")
            continue
        text, why = _field(record, text_field)
        if text is None:
            log.add("bad_record", path, where, why)
        else:
            yield text


def _field(record: Any, text_field: str) -> tuple[str | None, str]:
    """(record[text_field], "") when it is a string, else (None, why not); with data.format: chat (a
    ChatRecords), the record's conversation."""
    if isinstance(text_field, ChatRecords):
        return text_field.take(record)
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    if text_field not in record:
        return None, f"field {text_field!r} is missing"
    value = record[text_field]
    if not isinstance(value, str):
        return None, f"field {text_field!r} is {'null' if value is None else f'a {type(value).__name__}'}, not a string"
    # NOTE: json.loads turns an escaped lone surrogate ("\\ud800", common in scraped text) into a str that
    # no UTF-8 encoder (the tokenizer's included) accepts; only non-ASCII text can hold one.
    if not value.isascii() and (m := _SURROGATE.search(value)):
        return None, (f"field {text_field!r} does not encode as UTF-8 (a lone surrogate U+{ord(m.group()):04X} "
                      f"at character {m.start()})")
    return value, ""


def _too_long(size: int, limit: int) -> str:
    return f"over data.max_record_bytes ({size} > {limit} bytes)"


class _ArrowRaw(io.RawIOBase):
    """A pyarrow input stream as a raw file, so io.BufferedReader can split it into lines."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._stream.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._stream.close()
        super().close()


def _open_stream(unit: Unit) -> BinaryIO:
    """The decompressed bytes of a .gz or .zst file, as a buffered stream.

    NOTE: .zst goes through pyarrow's CompressedInputStream, not zstandard's stream_reader: the
    latter (0.25) ends silently at the end of a truncated frame, so a cut file would pass as whole;
    pyarrow raises OSError("Truncated compressed stream"), reads multi-frame files and keeps its
    output buffer at about 1 MB whatever the compression ratio."""
    if unit.fmt.endswith(".gz"):
        return gzip.open(unit.path, "rb")
    return io.BufferedReader(_ArrowRaw(pa.CompressedInputStream(pa.OSFile(unit.path), "zstd")), READ_BYTES)


# gzip: EOFError (truncated), BadGzipFile (an OSError), zlib.error; pyarrow: OSError, ArrowException
STREAM_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)


def _read_json(unit: Unit, text_field: str, max_file_bytes: int, limit: int, log: ErrorLog) -> Iterator[str]:
    """A .json file: an array of records (one unit, streamed) or JSON lines (possibly split)."""
    try:
        if unit.start > 0 or _first_char(Path(unit.path)) != "[":
            yield from _read_jsonl(unit, text_field, max_file_bytes, limit, log)
            return
        with open(unit.path, "rb") as f:
            yield from _json_array(f, unit.path, text_field, limit, log)
    except UnicodeDecodeError as err:
        log.add("bad_record", unit.path, "file", f"not UTF-8 ({err.reason}); the rest of the array is not read")
    except OSError as err:
        log.add("skipped_file", unit.path, "file", f"unreadable ({err.strerror or err})")


def _json_array(f: BinaryIO, path: str, text_field: str, limit: int, log: ErrorLog) -> Iterator[str]:
    """The records of a JSON array, one at a time (json.JSONDecoder.raw_decode over a growing buffer):
    memory holds one record and one block, whatever the file size. A record of more than `limit`
    characters ends the read (finding its end would mean holding it)."""
    text = _Chars(f)
    decode = json.JSONDecoder().raw_decode
    text.next_char()
    text.pos += 1  # the '['
    i = 0
    if text.next_char() == "]":
        return
    while True:
        while True:
            try:
                record, end = decode(text.buf, text.pos)
            except ValueError:
                record, end = None, -1
            except RecursionError:
                log.add("bad_record", path, f"record {i}", "not valid JSON (nested too deeply); the rest of the "
                        "array is not read")
                return
            # a number or literal may go on in the next block: accept a value only if text follows it
            if end >= 0 and (end < len(text.buf) or text.eof):
                break
            if len(text.buf) - text.pos > limit:
                break
            if not text.more():
                log.add("bad_record", path, f"record {i}", "not valid JSON; the rest of the array is not read")
                return
        if (end if end >= 0 else len(text.buf)) - text.pos > limit:
            log.add("bad_record", path, f"record {i}", f"over data.max_record_bytes (more than {limit} "
                    "characters); the rest of the array is not read")
            return
        value, why = _field(record, text_field)
        if value is None:
            log.add("bad_record", path, f"record {i}", why)
        else:
            yield value
        text.pos, i = end, i + 1
        c = text.next_char()
        if c == "]":
            return
        if c != ",":
            log.add("bad_record", path, f"record {i}", f"expected ',' or ']' after a record, found {c or 'the end'!r}")
            return
        text.pos += 1
        text.next_char()


class _Chars:
    """A UTF-8 file as text read on demand: `buf[pos:]` is what is not consumed yet."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.buf, self.pos, self.eof = f, "", 0, False
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()

    def more(self) -> bool:
        """Read on; each read is at least as long as what is pending, so a big record costs linear time."""
        if self.eof:
            return False
        block = self.f.read(max(READ_BYTES, len(self.buf) - self.pos))
        self.eof = not block
        self.buf = self.buf[self.pos:] + self.decoder.decode(block, final=self.eof)
        self.pos = 0
        return True

    def next_char(self) -> str:
        """The next character that is not whitespace, not consumed ('' at the end)."""
        while not (m := _NOT_SPACE.search(self.buf, self.pos)):
            self.pos = len(self.buf)
            if not self.more():
                return ""
        self.pos = m.start()
        return self.buf[self.pos]


def _string_column(schema, text_field: str) -> str | None:
    """Why `schema` has no usable text column, or None."""
    if text_field not in schema.names:
        return f"no column {text_field!r} (columns: {', '.join(schema.names)})"
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        return f"column {text_field!r} is {kind}, not a string"
    return None


def _texts(column, path: str, where: Callable[[int], str], text_field: str, limit: int,
           log: ErrorLog) -> Iterator[str]:
    """The column's strings; nulls and values of more than `limit` bytes are bad records (measured in
    arrow, so an over-long value never becomes a Python str)."""
    sizes = _byte_lengths(column)
    if (pc.max(sizes).as_py() or 0) <= limit:
        values = column.to_pylist()
    else:
        sizes = sizes.to_pylist()
        values = [None if n is None or n > limit else column[i].as_py() for i, n in enumerate(sizes)]
    for i, value in enumerate(values):
        if value is not None:
            yield value
        elif column[i].is_valid:
            log.add("bad_record", path, where(i), _too_long(sizes[i], limit))
        else:
            log.add("bad_record", path, where(i), f"field {text_field!r} is null")


def _byte_lengths(column):
    try:
        return pc.binary_length(column)
    except pa.ArrowNotImplementedError:  # string_view has no kernel (pyarrow 26)
        return pc.binary_length(column.cast(pa.large_string()))


def _read_parquet(unit: Unit, text_field: str, max_file_bytes: int, limit: int, log: ErrorLog) -> Iterator[str]:
    """The unit's row groups, only the text column, BATCH_ROWS rows at a time."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(unit.path)
    except (OSError, pa.ArrowException) as err:
        if unit.start == 0:
            log.add("skipped_file", unit.path, "file", f"not a readable parquet file ({err})")
        return
    columns, why = _columns(pf.schema_arrow, text_field)
    if columns is None:
        if unit.start == 0:  # once per file, not once per unit
            log.add("missing_field", unit.path, "schema", why)
        return
    meta = pf.metadata
    row = sum(meta.row_group(g).num_rows for g in range(unit.start))
    for g in range(unit.start, meta.num_row_groups if unit.stop is None else unit.stop):
        first = row
        try:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=columns):
                yield from _values(batch, unit.path, lambda i, r=row: f"row {r + i}", text_field, limit, log)
                row += batch.num_rows
        except (OSError, pa.ArrowException) as err:
            log.add("bad_row_group", unit.path, f"row group {g}", _first_line(err))
        row = first + meta.row_group(g).num_rows


class _Unusable(Exception):
    """A datasets folder whose state.json cannot be used, or a file it names that is refused; str: why."""


def _arrow_files(folder: Path) -> list[str]:
    """The names of the folder's arrow files in the dataset's order (state.json's _data_files).
    Raises _Unusable when state.json is not a JSON object with a list of {"filename": str}."""
    try:
        with open(folder / "state.json", "rb") as f:
            raw = f.read(STATE_BYTES + 1)
    except OSError as err:
        raise _Unusable(f"state.json is unreadable ({err.strerror or err})") from None
    if len(raw) > STATE_BYTES:
        raise _Unusable(f"state.json is over {STATE_BYTES} bytes")
    try:
        state = json.loads(raw)
    except RecursionError:
        raise _Unusable("state.json is not valid JSON (nested too deeply)") from None
    except ValueError:
        raise _Unusable("state.json is not valid JSON") from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list):
        raise _Unusable("state.json has no _data_files list")
    names = []
    for i, entry in enumerate(files):
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            kind = "missing" if name is None else f"a {type(name).__name__}, not a string"
            raise _Unusable(f"state.json: _data_files[{i}].filename is {kind}")
        names.append(name)
    return names


def _refused(folder: Path, name: str) -> str | None:
    """Why a file state.json names is not opened: a name that leaves the folder (a path, '..', or a
    symlink whose target is outside it), or not a regular file (opening a FIFO would wait forever)."""
    if name in ("", ".", "..") or os.path.basename(name) != name:
        return f"state.json names {name!r}, not a file in the folder"
    path = folder / name
    real, top = os.path.realpath(path), os.path.realpath(folder)
    if not real.startswith(top.rstrip(os.sep) + os.sep):
        return f"state.json names {name!r}, a symlink to {real}, outside the folder"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # reading it reports why
    return None if stat.S_ISREG(mode) else f"state.json names {name!r}, not a regular file"


def _file_batches(path: Path) -> Iterator:
    """Record batches of one arrow file, zero-copy from a memory map. datasets writes the streaming
    IPC format; the random-access file format is read too."""
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        file_reader = pa.ipc.open_file(source)
        yield from (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        return
    yield from reader


def _folder_batches(folder: Path, names: list[str]) -> Iterator[tuple[Path, Any, BaseException | None]]:
    """(file, batch, None) over the folder's arrow files `names`, then (file, None, error) where a file
    cannot be read further (the next file still is); a refused file gives (file, None, _Unusable)."""
    for name in names:
        path = folder / name
        if why := _refused(folder, name):
            yield path, None, _Unusable(why)
            continue
        try:
            for batch in _file_batches(path):
                yield path, batch, None
        except (OSError, pa.ArrowException) as err:
            yield path, None, err


def _read_datasets(unit: Unit, text_field: str, max_file_bytes: int, limit: int, log: ErrorLog) -> Iterator[str]:
    """Record batches [start, stop) of the folder's arrow files (numbered across files), column text_field.

    Every unit walks the batches before its own (headers only: the memory map is not read); a file
    error is counted by the unit whose range its position falls in, so once."""
    try:
        names = _arrow_files(Path(unit.path))
    except _Unusable as err:
        if unit.start == 0:  # once per folder
            log.add("skipped_file", unit.path, "state.json", str(err))
        return
    g, row, current, columns = 0, 0, None, None
    for path, batch, err in _folder_batches(Path(unit.path), names):
        if unit.stop is not None and g >= unit.stop:
            return
        if err is not None:
            if g >= unit.start:
                kind = "skipped_file" if isinstance(err, _Unusable) else "truncated_stream"
                log.add(kind, unit.path, path.name, _first_line(err))
            continue
        if g == 0:
            columns, why = _columns(batch.schema, text_field)
            if columns is None:
                if unit.start == 0:  # once per folder, not once per unit
                    log.add("missing_field", unit.path, "schema", why)
                return
        if path != current:
            current, row = path, 0
        if g >= unit.start:
            yield from _values(batch.select(columns), unit.path,
                               lambda i, p=path.name, r=row: f"{p} row {r + i}", text_field, limit, log)
        g, row = g + 1, row + batch.num_rows


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


_READERS: dict[str, Callable[[Unit, str, int, int, ErrorLog], Iterator[str]]] = {
    "txt": _read_txt, "txt.gz": _read_txt_stream, "txt.zst": _read_txt_stream,
    "jsonl": _read_jsonl, "jsonl.gz": _read_jsonl_stream, "jsonl.zst": _read_jsonl_stream,
    "json": _read_json, "parquet": _read_parquet, "datasets": _read_datasets,
}
