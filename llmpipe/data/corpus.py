"""Corpus readers: expand `data.inputs` globs into files, and files into documents.

A plain file (any suffix but .jsonl) is one document, read as UTF-8. A .jsonl file holds one
JSON object per line; each record's `text_field` is one document. Files that cannot be used
(empty, binary, not UTF-8, too big, a .jsonl without one usable record) are skipped with a
recorded reason instead of failing the stage: a web-scale crawl always holds a few of them.
Files are checked and read as streams, and documents come out in pieces of bounded length
(`Corpus.pieces`), so neither a huge file nor a huge single-line document fills memory.
"""

from __future__ import annotations

import codecs
import errno
import fnmatch
import glob
import json
import logging
import os
import stat
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from llmpipe.data.errors import DataError
from llmpipe.data.readers import is_datasets_folder
from llmpipe.data.tokenizer import PIECE_CHARS, cut_point, split_text

log = logging.getLogger("llmpipe.data")

MAX_LISTED = 50  # skipped files / bad lines kept by name; all are counted
JSONL_SUFFIXES = (".jsonl",)
READ_BYTES = 1 << 18  # block size of the streamed content check


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


@dataclass
class Inputs:
    """The files `data.inputs` matched, once each, and the symlink loops the search did not follow."""

    files: list[Path]
    symlink_loops: list[str]  # links (as matched) back to a folder on their own path, or ELOOP links
    # matched paths that resolve outside the folder their pattern starts from: (path, target, folder),
    # read or refused as data.external_symlinks says (a file also matched inside its tree is not listed)
    external: list[tuple[str, str, str]] = field(default_factory=list)
    refused: bool = False  # the external ones are not in `files`


def _search_root(pattern: str) -> str | None:
    """The folder a pattern's search starts from: its parts before the first wildcard; None for a
    pattern without one (a path named outright, read wherever it points)."""
    parts = pattern.split(os.sep)
    for i, part in enumerate(parts):
        if glob.has_magic(part):
            return os.sep.join(parts[:i]) or (os.sep if pattern.startswith(os.sep) else os.curdir)
    return None


def _outside(real: str, root: str) -> bool:
    top = os.path.realpath(root)
    return real != top and not real.startswith(top.rstrip(os.sep) + os.sep)


_LOOP = ("loop",)  # _dir_id of a link that cannot be resolved because it points at itself (ELOOP)


def _dir_id(path: str) -> tuple | None:
    """(device, inode) of the folder `path` resolves to; None when it is not one; _LOOP on ELOOP."""
    try:
        st = os.stat(path)
    except OSError as err:
        return _LOOP if err.errno == errno.ELOOP else None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _listdir(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder or os.curdir))
    except OSError:  # unreadable or vanished: glob skips those silently too
        return []


class _Glob:
    """glob.glob(pattern, recursive=True), but each folder is entered once per pattern position, and a
    symlink to a folder on its own path is recorded in `loops` instead of followed.

    NOTE: glob follows directory links under ** without memory: `ln -s .. a/b/back` makes a/**
    revisit `a` until the path is too long for the OS (4 files were read 164 times), and two such
    links grow that exponentially. Entering a folder once per (inode, position) keeps every match
    up to the spelling of its path, and matches are de-duplicated by real path afterwards.
    Hidden names match only a part that starts with '.', as in glob.
    """

    def __init__(self) -> None:
        self.loops: set[str] = set()
        self._seen: set[tuple] = set()

    def __call__(self, pattern: str) -> Iterator[str]:
        self._seen = set()
        root = os.sep if pattern.startswith(os.sep) else ""
        parts = [p for p in pattern.split(os.sep) if p]
        top = _dir_id(root or os.curdir)
        if parts and top not in (None, _LOOP):
            yield from self._match(root, parts, 0, (top,))

    def _match(self, folder: str, parts: list[str], i: int, stack: tuple) -> Iterator[str]:
        """Paths under `folder` matching parts[i:]; stack: ids of the folders on the path, `folder` last."""
        if i == len(parts):
            yield folder
            return
        part = parts[i]
        if part == "**":
            yield from self._recurse(folder, parts, i, stack)
            return
        if glob.has_magic(part):
            names = _listdir(folder)
            names = fnmatch.filter(names if part.startswith(".") else [n for n in names if n[0] != "."], part)
        else:
            names = [part]
        for name in names:
            path = os.path.join(folder, name)
            if i + 1 == len(parts):
                yield path
            elif (child := _dir_id(path)) not in (None, _LOOP):
                yield from self._match(path, parts, i + 1, stack + (child,))

    def _recurse(self, folder: str, parts: list[str], i: int, stack: tuple) -> Iterator[str]:
        """'**' at parts[i]: `folder` and every folder below it, then parts[i+1:] from each."""
        if (key := (stack[-1], i)) in self._seen:
            return
        self._seen.add(key)
        yield from self._match(folder, parts, i + 1, stack)
        last = i + 1 == len(parts)  # a final '**' matches the files too
        for name in _listdir(folder):
            if name[0] == ".":
                continue
            path = os.path.join(folder, name)
            child = _dir_id(path)
            if child is None:
                if last:
                    yield path
            elif child is _LOOP or child in stack:
                self.loops.add(os.path.abspath(path))
            elif is_datasets_folder(path):  # one input, matched by a final '**'; its files are not inputs
                if last:
                    yield path
            else:
                yield from self._recurse(path, parts, i, stack + (child,))


def find_inputs(patterns: Sequence[str], max_files: int | None = None, external_symlinks: str = "refuse") -> Inputs:
    """Files matched by `patterns` (recursive ** allowed), absolute, sorted, each file once. A folder
    saved by datasets' save_to_disk (state.json + dataset_info.json) that a pattern matches is one
    input, and '**' does not descend into it; other folders are not inputs.

    A file reached by several paths (symlinks, overlapping patterns) is kept once, under the first
    of its paths in sorted order. Raises DataError naming `data.inputs[i]` when a pattern matches
    no file. `max_files` keeps the first N in sorted order, so a capped run reads the same files.

    A match that resolves outside the folder its pattern starts from (a symlink to /etc/shadow in a
    corpus folder) is listed in `external`, and left out with `external_symlinks="refuse"`. Only
    regular files and datasets folders are inputs: a FIFO or a device the pattern matches is never opened.
    """
    walk = _Glob()
    by_real: dict[str, str] = {}  # real path -> the path it is read (and shown) under
    outside: dict[str, tuple[str, str]] = {}  # real path -> (path, root) of matches leaving their tree
    inside: set[str] = set()  # real paths matched inside their tree
    for i, pattern in enumerate(patterns):
        expanded = expand_pattern(pattern)
        root = _search_root(expanded)
        matched = False
        for p in walk(expanded):
            if os.path.isfile(p) or is_datasets_folder(p):
                matched = True
                path, real = os.path.abspath(p), os.path.realpath(p)
                if root is not None and _outside(real, root):
                    if real not in outside or path < outside[real][0]:
                        outside[real] = (path, os.path.abspath(root))
                    if external_symlinks == "refuse":
                        continue
                else:
                    inside.add(real)
                by_real[real] = min(path, by_real.get(real, path))
        if not matched:
            shown = repr(pattern) if expanded == pattern else f"{pattern!r} (-> {expanded!r})"
            raise DataError(f"data.inputs[{i}]: {shown} matched no files")
    # a file also matched inside its own tree is read from there, whatever the setting
    external = sorted((p, real, root) for real, (p, root) in outside.items() if real not in inside)
    folders = [real + os.sep for real in by_real if os.path.isdir(real)]
    if folders:  # e.g. 'ds/**' matched the datasets folder ds and its own files: the folder is the input
        by_real = {r: p for r, p in by_real.items() if not any(r.startswith(f) for f in folders)}
    files = [Path(p) for p in sorted(by_real.values())]
    if max_files is not None and len(files) > max_files:
        log.info("data.max_files=%d: reading %d of %d matched files", max_files, max_files, len(files))
        files = files[:max_files]
    return Inputs(files, sorted(walk.loops), external, external_symlinks == "refuse")


def expand_inputs(patterns: Sequence[str], max_files: int | None = None,
                  external_symlinks: str = "refuse") -> list[Path]:
    """find_inputs(...).files."""
    return find_inputs(patterns, max_files, external_symlinks).files


class Piece(NamedTuple):
    """A part of one document, at most tokenizer.PIECE_CHARS characters: `first` and `last` mark the
    document's start and end (a short document is one piece, both)."""

    text: str
    first: bool
    last: bool


def _check_file(path: Path) -> str | None:
    """None when the file is usable text, else why not: empty, binary or not UTF-8.

    Streams the file in blocks, so a file of any size costs one block of memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, blank = 0, True
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            if b"\x00" in block:
                return "binary (contains NUL bytes)"
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:  # err.object = the bytes held back from the last block + this one
                return f"not UTF-8 (invalid byte at offset {offset + len(block) - len(err.object) + err.start})"
            blank = blank and not block.strip()
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:  # the file ends inside a multi-byte character
        return f"not UTF-8 (invalid byte at offset {offset - len(err.object) + err.start})"
    return "empty" if blank else None


def _text_pieces(path: Path, budget: int) -> Iterator[str]:
    """A plain file's text in pieces (tokenizer.cut_point), read as a stream: the whole text never
    sits in memory. newline="" keeps line ends as written; utf-8-sig drops a leading BOM (an
    encoding marker, not text)."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        buf = ""
        while chunk := f.read(budget):
            buf += chunk
            while len(buf) > budget:  # cut_point needs the character after the cut
                cut = cut_point(buf, 0, budget)
                yield buf[:cut]
                buf = buf[cut:]
        if buf:
            yield buf


def _jsonl_documents(path: Path, text_field: str, stats: CorpusStats) -> Iterator[str]:
    """The usable `text_field` strings of a .jsonl file, line by line; other non-blank lines are bad lines.

    Lines are split at b"\\n" only: a JSON string may hold U+2028 or U+0085, which str.splitlines cuts."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.decode("utf-8").removeprefix("\ufeff") if lineno == 1 else raw.decode("utf-8")
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
                yield value


def _marked(parts: Iterable[str]) -> Iterator[Piece]:
    """Pieces of one document from its parts, the first and last marked."""
    it = iter(parts)
    prev = next(it, None)
    first = True
    for part in it:
        yield Piece(prev, first, False)
        prev, first = part, False
    if prev is not None:
        yield Piece(prev, first, True)


class Corpus:
    """The documents of `files`, re-iterable; each pass starts a fresh `stats`.

    `pieces()` is the pass to use on real data: a long document comes in pieces of at most
    `piece_chars` characters, so memory does not grow with a document's length. Iterating the
    corpus itself gives whole documents (small corpora, tests). Every pass reads the files again:
    that keeps memory flat on a big corpus (one pass trains the tokenizer, the next tokenizes),
    at the price of reading small text twice.
    """

    def __init__(self, files: Sequence[Path], text_field: str = "text", max_file_bytes: int = 64 << 20,
                 piece_chars: int = PIECE_CHARS):
        self.files = list(files)
        self.text_field = text_field
        self.max_file_bytes = max_file_bytes
        self.piece_chars = piece_chars
        self.stats = CorpusStats()
        self._checked: dict[Path, tuple[int, int, str | None]] = {}  # path -> (size, mtime_ns, why unusable)

    def pieces(self) -> Iterator[Piece]:
        """Every document as Pieces, in file order."""
        self.stats = stats = CorpusStats()
        for path in self.files:
            yield from self._read(path, stats)

    def texts(self) -> Iterator[str]:
        """The pieces' texts (what the tokenizer trainer reads)."""
        return (p.text for p in self.pieces())

    def __iter__(self) -> Iterator[str]:
        parts: list[str] = []
        for piece in self.pieces():
            parts.append(piece.text)
            if piece.last:
                yield "".join(parts)
                parts = []

    def _unusable(self, path: Path) -> str | None:
        """Why `path` cannot be read as text, or None; the content check is cached by size and mtime,
        so the second pass does not read a file three times. Raises OSError."""
        st = path.stat()
        if st.st_size > self.max_file_bytes:
            return f"over data.max_file_bytes ({st.st_size} > {self.max_file_bytes} bytes)"
        cached = self._checked.get(path)
        if cached is None or cached[:2] != (st.st_size, st.st_mtime_ns):
            cached = self._checked[path] = (st.st_size, st.st_mtime_ns, _check_file(path))
        return cached[2]

    def _read(self, path: Path, stats: CorpusStats) -> Iterator[Piece]:
        try:
            why = self._unusable(path)
        except OSError as err:
            why = f"unreadable ({err.strerror or err})"
        if why:
            stats.skip(path, why)
            return
        docs = 0
        try:
            if path.suffix.lower() in JSONL_SUFFIXES:
                for doc in _jsonl_documents(path, self.text_field, stats):
                    docs += 1
                    stats.documents += 1
                    yield from _marked(split_text(doc, self.piece_chars))
            else:
                docs = 1
                stats.documents += 1
                yield from _marked(_text_pieces(path, self.piece_chars))
        except (OSError, UnicodeDecodeError) as err:  # it passed the check: it changed, or the disk failed
            raise DataError(f"data.inputs: {path}: read failed after it was checked, changed while being "
                             f"read? ({getattr(err, 'strerror', None) or err})") from None
        if not docs:
            stats.skip(path, f"no usable records with a {self.text_field!r} string")
            return
        stats.files_read += 1
        stats.bytes += self._checked[path][0]


def fingerprint_extra(cfg) -> dict[str, Any]:
    """What the prepare_data fingerprint adds to its config: the matched files' names, sizes and
    modification times (and the given tokenizer's), so editing the corpus re-runs the stage.
    Never raises: a pattern matching nothing is reported when the stage runs."""
    import hashlib

    h = hashlib.sha256()
    try:
        files = expand_inputs(cfg.data.inputs, cfg.data.max_files, cfg.data.external_symlinks)
    except DataError as err:
        return {"inputs_error": str(err)}
    if cfg.data.tokenizer.path:
        files.append(Path(cfg.data.tokenizer.path))
    for p in files:
        for q in sorted(p.iterdir()) if p.is_dir() else [p]:  # a datasets folder: its files
            try:
                st = q.stat()
                h.update(f"{q}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{q}\0missing\n".encode())
    out: dict[str, Any] = {"files": len(files), "stat_digest": h.hexdigest()}
    if cfg.data.format == "chat":  # the template is part of the data: its digest (text runs: nothing added)
        from llmpipe.chat.template import TemplateError, resolve_template

        try:
            tpl = resolve_template(cfg.model.init_from, cfg.data.chat_template)
            out["chat_template_sha256"] = tpl.sha256 if tpl is not None else None
        except TemplateError as err:
            out["chat_template_error"] = str(err)
    return out
