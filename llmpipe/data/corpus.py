"""Corpus readers: expand `data.inputs` globs into files, and files into documents.

A plain file (any suffix but .jsonl) is one document, read as UTF-8. A .jsonl file holds one
JSON object per line; each record's `text_field` is one document. Files that cannot be used
(empty, binary, not UTF-8, too big, a .jsonl without one usable record) are skipped with a
recorded reason instead of failing the stage: a web-scale crawl always holds a few of them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.stages import StageError

log = logging.getLogger("llmpipe.data")

MAX_LISTED = 50  # skipped files / bad lines kept by name; all are counted
JSONL_SUFFIXES = (".jsonl",)


@dataclass
class CorpusStats:
    """What one pass over the corpus read and what it skipped."""

    files_read: int = 0
    documents: int = 0
    bytes: int = 0  # raw bytes of the files read
    files_skipped: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)  # first MAX_LISTED {path, reason}
    bad_lines: int = 0  # .jsonl lines that held no usable record
    bad_line_examples: list[str] = field(default_factory=list)  # first MAX_LISTED "path:line: why"

    def skip(self, path: Path, reason: str) -> None:
        self.files_skipped += 1
        if len(self.skipped) < MAX_LISTED:
            self.skipped.append({"path": str(path), "reason": reason})

    def bad_line(self, path: Path, lineno: int, reason: str) -> None:
        self.bad_lines += 1
        if len(self.bad_line_examples) < MAX_LISTED:
            self.bad_line_examples.append(f"{path}:{lineno}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "files_read": self.files_read, "documents": self.documents, "bytes": self.bytes,
            "files_skipped": self.files_skipped, "skipped_files": self.skipped,
            "bad_jsonl_lines": self.bad_lines, "bad_jsonl_line_examples": self.bad_line_examples,
        }


def expand_pattern(pattern: str) -> str:
    """'{stdlib}' -> this Python's standard library folder; '~' -> home. Relative stays relative (cwd)."""
    return os.path.expanduser(pattern.replace("{stdlib}", sysconfig.get_paths()["stdlib"]))


def expand_inputs(patterns: Sequence[str], max_files: int | None = None) -> list[Path]:
    """Files matched by `patterns` (recursive ** allowed), absolute, sorted, de-duplicated.

    Raises StageError naming `data.inputs[i]` when a pattern matches no file. `max_files` keeps
    the first N in sorted order, so a capped run reads the same files every time.
    """
    found: set[str] = set()
    for i, pattern in enumerate(patterns):
        expanded = expand_pattern(pattern)
        matches = {os.path.abspath(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p)}
        if not matches:
            shown = repr(pattern) if expanded == pattern else f"{pattern!r} (-> {expanded!r})"
            raise StageError(f"data.inputs[{i}]: {shown} matched no files")
        found |= matches
    files = [Path(p) for p in sorted(found)]
    if max_files is not None and len(files) > max_files:
        log.info("data.max_files=%d: reading %d of %d matched files", max_files, max_files, len(files))
        files = files[:max_files]
    return files


def _decode(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None) or (None, why the bytes are not usable text)."""
    if not raw.strip():
        return None, "empty"
    if b"\x00" in raw:
        return None, "binary (contains NUL bytes)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 (invalid byte at offset {err.start})"
    return text.removeprefix("\ufeff"), None  # a BOM is an encoding marker, not text


def _jsonl_documents(text: str, path: Path, text_field: str, stats: CorpusStats) -> list[str]:
    """The usable `text_field` strings of a .jsonl file; every other non-blank line is a bad line."""
    docs: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            stats.bad_line(path, lineno, "not valid JSON")
            continue
        if not isinstance(record, dict):
            stats.bad_line(path, lineno, f"a JSON {type(record).__name__}, not an object")
            continue
        value = record.get(text_field)
        if not isinstance(value, str):
            why = "missing" if value is None else f"a {type(value).__name__}, not a string"
            stats.bad_line(path, lineno, f"field {text_field!r} is {why}")
        elif not value.strip():
            stats.bad_line(path, lineno, f"field {text_field!r} is empty")
        else:
            docs.append(value)
    return docs


class Corpus:
    """The documents of `files`, re-iterable; each pass starts a fresh `stats`.

    Iterating twice reads the files twice: that keeps memory flat on a big corpus (one pass
    trains the tokenizer, the next tokenizes), at the price of reading small text twice.
    """

    def __init__(self, files: Sequence[Path], text_field: str = "text", max_file_bytes: int = 64 << 20):
        self.files = list(files)
        self.text_field = text_field
        self.max_file_bytes = max_file_bytes
        self.stats = CorpusStats()

    def __iter__(self) -> Iterator[str]:
        self.stats = stats = CorpusStats()
        for path in self.files:
            yield from self._read(path, stats)

    def _read(self, path: Path, stats: CorpusStats) -> list[str]:
        try:
            size = path.stat().st_size
            if size > self.max_file_bytes:
                stats.skip(path, f"over data.max_file_bytes ({size} > {self.max_file_bytes} bytes)")
                return []
            raw = path.read_bytes()
        except OSError as err:
            stats.skip(path, f"unreadable ({err.strerror or err})")
            return []
        text, why = _decode(raw)
        if text is None:
            stats.skip(path, why or "unusable")
            return []
        if path.suffix.lower() in JSONL_SUFFIXES:
            docs = _jsonl_documents(text, path, self.text_field, stats)
            if not docs:
                stats.skip(path, f"no usable records with a {self.text_field!r} string")
                return []
        else:
            docs = [text]
        stats.files_read += 1
        stats.bytes += len(raw)
        stats.documents += len(docs)
        return docs


def fingerprint_extra(cfg) -> dict[str, Any]:
    """What the prepare_data fingerprint adds to its config: the matched files' names, sizes and
    modification times (and the given tokenizer's), so editing the corpus re-runs the stage.
    Never raises: a pattern matching nothing is reported when the stage runs."""
    import hashlib

    h = hashlib.sha256()
    try:
        files = expand_inputs(cfg.data.inputs, cfg.data.max_files)
    except StageError as err:
        return {"inputs_error": str(err)}
    if cfg.data.tokenizer.path:
        files.append(Path(cfg.data.tokenizer.path))
    for p in files:
        try:
            st = p.stat()
            h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{p}\0missing\n".encode())
    return {"files": len(files), "stat_digest": h.hexdigest()}
