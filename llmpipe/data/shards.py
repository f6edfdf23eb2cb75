"""Token shards: `<name>.bin` (the concatenated token stream) plus `<name>.idx` (document starts).

    <name>.bin   raw little-endian uint16 (vocab <= 65535) or uint32 token ids, no header
    <name>.idx   b"LLMPIDX1" | uint8 dtype code | uint64 n_tokens | uint64 n_docs | int64 start[n_docs]

The dtype code is the token's size in bytes (2 or 4). Both files are memory-mapped when read,
so a training rank touches only the pages its samples live in. A sample is a packed window of
seq_len+1 tokens over the stream: documents run across window edges, separated by EOS.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from llmpipe.data.errors import DataError

MAGIC = b"LLMPIDX1"
_HEADER = struct.Struct("<8sBQQ")  # magic, dtype code, n_tokens, n_docs: 25 bytes, no padding
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # code = bytes per token


class ShardError(DataError):
    """A .bin/.idx pair is missing, truncated or not in this format."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits (<= 65535), else uint32."""
    return DTYPES[2] if vocab_size <= 65535 else DTYPES[4]


def idx_path(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".idx")


class ShardWriter:
    """Append documents to `<name>.bin` as they come; `close()` writes `<name>.idx`.

    Only the document offsets (8 bytes per document) stay in memory, never the tokens. Used as
    a context manager, the .idx is written only when the block succeeds, so a crash leaves no
    shard that looks complete.
    """

    def __init__(self, bin_path: str | Path, dtype: np.dtype | str):
        self.bin_path = Path(bin_path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype.itemsize not in DTYPES or self.dtype.kind != "u":
            raise ValueError(f"token dtype must be uint16 or uint32, got {self.dtype}")
        self._max_id = np.iinfo(self.dtype).max
        self._file = open(self.bin_path, "wb")  # closed in close() / __exit__
        self._starts: list[np.ndarray] = []  # int64 arrays, one per add_documents call: 8 bytes a document
        self.n_tokens = 0
        self.n_docs = 0

    def add_documents(self, docs: Sequence[Sequence[int] | np.ndarray], continues: bool = False) -> None:
        """Append several documents (each a sequence of token ids) in one write. With `continues`, the
        first sequence is more of the document added last (a long document arrives in pieces)."""
        if not docs:
            return
        if continues and not self.n_docs:
            raise ValueError("continues=True, but no document was added before")
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        starts = self.n_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        if continues:
            starts = starts[1:]
        flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
        if flat.size and (flat.min() < 0 or flat.max() > self._max_id):
            raise ValueError(f"token id out of range for {self.dtype} (min {flat.min()}, max {flat.max()})")
        self._file.write(flat.astype(self.dtype).tobytes())
        self._starts.append(starts.astype("<i8"))
        self.n_tokens += int(lengths.sum())
        self.n_docs += len(starts)

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document's token ids."""
        self.add_documents([ids])

    def close(self) -> None:
        """Flush the .bin and write the .idx."""
        self._file.close()
        header = _HEADER.pack(MAGIC, self.dtype.itemsize, self.n_tokens, self.n_docs)
        with open(idx_path(self.bin_path), "wb") as f:
            f.write(header)
            for starts in self._starts:
                f.write(starts.tobytes())

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def write_shard(bin_path: str | Path, docs: Iterable[Sequence[int]], dtype: np.dtype | str) -> Path:
    """Write documents (token id sequences) as one shard; returns the .bin path."""
    with ShardWriter(bin_path, dtype) as w:
        for d in docs:
            w.add_document(d)
    return Path(bin_path)


def _read_header(path: Path) -> tuple[np.dtype, int, int]:
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError as err:
        raise ShardError(f"{path}: cannot read shard index ({err.strerror or err})") from None
    if len(head) < _HEADER.size or not head.startswith(MAGIC):
        raise ShardError(f"{path}: not a token shard index (expected magic {MAGIC!r} and a "
                         f"{_HEADER.size}-byte header)")
    _, code, n_tokens, n_docs = _HEADER.unpack(head)
    if code not in DTYPES:
        raise ShardError(f"{path}: unknown token dtype code {code} (known: {sorted(DTYPES)})")
    return DTYPES[code], n_tokens, n_docs


def _expect_size(path: Path, expected: int, what: str) -> None:
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        found = "missing" if size is None else f"{size} bytes"
        raise ShardError(f"{path}: {found}, but the index says {what} = {expected} bytes")


class TokenShard:
    """A memory-mapped shard. `tokens` is the token stream, `doc_offsets` each document's start."""

    def __init__(self, bin_path: str | Path):
        self.bin_path = Path(bin_path)
        self.idx_path = idx_path(self.bin_path)
        self.dtype, self.n_tokens, self.n_docs = _read_header(self.idx_path)
        _expect_size(self.idx_path, _HEADER.size + 8 * self.n_docs, f"header + 8 x {self.n_docs} documents")
        _expect_size(self.bin_path, self.dtype.itemsize * self.n_tokens,
                     f"{self.n_tokens} tokens x {self.dtype.itemsize}")
        # NOTE: np.memmap refuses empty files, so an empty shard gets empty arrays instead.
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
                       if self.n_tokens else np.zeros(0, self.dtype))
        self.doc_offsets = (np.memmap(self.idx_path, dtype="<i8", mode="r", offset=_HEADER.size,
                                      shape=(self.n_docs,)) if self.n_docs else np.zeros(0, "<i8"))

    def __len__(self) -> int:
        return self.n_tokens

    def num_samples(self, seq_len: int) -> int:
        """Whole windows of seq_len+1 tokens; consecutive windows share one token (input/target shift)."""
        return max(0, (self.n_tokens - 1) // seq_len)

    def sample(self, i: int, seq_len: int) -> np.ndarray:
        """Window i: seq_len+1 tokens from i*seq_len, as int64 (inputs = [:-1], targets = [1:])."""
        n = self.num_samples(seq_len)
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range: {self.bin_path.name} has {n} samples "
                             f"of seq_len {seq_len}")
        start = i * seq_len
        return np.asarray(self.tokens[start:start + seq_len + 1], dtype=np.int64)

    def document(self, j: int) -> np.ndarray:
        """Tokens of document j (its trailing EOS included), as int64."""
        start = int(self.doc_offsets[j])
        end = int(self.doc_offsets[j + 1]) if j + 1 < self.n_docs else self.n_tokens
        return np.asarray(self.tokens[start:end], dtype=np.int64)
