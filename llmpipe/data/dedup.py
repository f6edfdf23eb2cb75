"""Deduplication keys, the sequential duplicate decision, and quality filters for prepare_data.

The work is split the way prepare_data's work units are (llmpipe.data.units):

- per document, in a unit's own process (any machine): `Filters.check(text)` drops a document, and a
  kept one gets a key: `exact_key(text)` (an int that fits uint64) or `MinHasher.signature(text)` (a
  (num_perm,) uint32 array). Keys depend on the text only: no process state, no built-in hash().
- in the merge pass, one process: `Deduper.is_duplicate(key)` once per document in canonical corpus
  order; the first occurrence stays. The decisions depend on the order only, so the kept set is the
  same whatever the number of workers.

Both dedup modes compare `normalize(text)`: NFKC, lowercase, whitespace runs as one space.

Language identification is left out: no offline language-id library (fasttext with a bundled model,
langdetect, lingua, cld3) is installed in this environment, and adding one (plus its model file) is a
dependency decision, not a filter.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

import numpy as np

MODES = ("none", "exact", "minhash")
# NOTE: pinned rather than datasketch's default, so a change of default in a later datasketch cannot
# silently change stored signatures. affine32 (datasketch >= 2.0) stores uint32 hash values.
SCHEME = "affine32"
SIGNATURE_DTYPE = np.uint32
# NOTE: datasketch's default weights (0.5, 0.5) pick 9 bands of 13 rows for threshold 0.8 and 128
# permutations: a pair at Jaccard 0.8 becomes a candidate with probability 0.40, at 0.9 with 0.93
# (benchmarks/dedup.py measured recall 0.93 on copies at true Jaccard 0.9). Every candidate is checked
# against the full signature, so a false candidate costs one comparison while a missed one keeps a
# duplicate: weigh misses 0.95. That gives 16 bands of 8 rows: 0.95 at 0.8, 0.99 at 0.85.
LSH_WEIGHTS = (0.05, 0.95)  # (false positive, false negative)
_NOT_ALNUM = re.compile(r"[^\w\s]|_")  # \w is str.isalnum() plus "_"
SHINGLE_BATCH = 1 << 13  # shingles hashed at a time (MinHasher.signature)


def normalize(text: str) -> str:
    """The text dedup compares: NFKC (compatibility forms folded: fullwidth "Ａ" -> "A", "ﬁ" -> "fi",
    no-break space -> space), lowercased, every run of whitespace one space, no leading or trailing
    whitespace. "  Hello,\\t\\nＷorld " -> "hello, world"."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def _utf8(text: str) -> bytes:
    # NOTE: surrogatepass: a reader may hand over lone surrogates (bad escapes in JSON); they still hash.
    return text.encode("utf-8", "surrogatepass")


def exact_key(text: str) -> int:
    """64-bit key of the normalised text: blake2b (digest_size=8) of its UTF-8 bytes, read big-endian as
    an unsigned int (0 <= key < 2**64, so it fits np.uint64). The same in every process and Python run."""
    return int.from_bytes(hashlib.blake2b(_utf8(normalize(text)), digest_size=8).digest(), "big")


def shingles(text: str, ngram: int) -> list[bytes]:
    """Word n-grams of the normalised text, UTF-8; a text of fewer than `ngram` words is one shingle of
    all its words (an empty text: one empty shingle). Repeats are kept (MinHash ignores them)."""
    words = normalize(text).split(" ")
    if len(words) <= ngram:
        return [_utf8(" ".join(words))]
    return [_utf8(" ".join(words[i:i + ngram])) for i in range(len(words) - ngram + 1)]


class MinHasher:
    """MinHash signatures of word n-gram shingles (datasketch.MinHash, scheme affine32, SHA-1 of each
    shingle). The permutations come from `seed` only, so signatures agree across processes and machines
    for the same (num_perm, ngram, seed) and datasketch version."""

    def __init__(self, num_perm: int = 128, ngram: int = 5, seed: int = 1):
        from datasketch import MinHash

        self.num_perm, self.ngram, self.seed = num_perm, ngram, seed
        self._minhash = MinHash
        # NOTE: generating the permutations costs more than hashing a short document; made once here.
        self._perms = MinHash(num_perm=num_perm, seed=seed, scheme=SCHEME).permutations

    def signature(self, text: str) -> np.ndarray:
        """(num_perm,) uint32: the minimum of each permuted shingle hash."""
        m = self._minhash(num_perm=self.num_perm, seed=self.seed, permutations=self._perms, scheme=SCHEME)
        found = shingles(text, self.ngram)
        # NOTE: in batches: update_batch builds an (n, num_perm) uint64 array, 1.7 GB for one 16 MB record
        for i in range(0, len(found), SHINGLE_BATCH):
            m.update_batch(found[i:i + SHINGLE_BATCH])  # the minimum over batches is the minimum over all
        return m.hashvalues


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity estimated from two signatures: the fraction of equal hash values."""
    return float(np.count_nonzero(a == b)) / len(a)


class Deduper:
    """Decides, one document at a time in canonical corpus order, whether a document repeats an earlier
    kept one; counts `kept` and `removed`.

    - "none": nothing is a duplicate.
    - "exact": the key is `exact_key(text)` (int or np.uint64). A duplicate if seen before.
    - "minhash": the key is `MinHasher.signature(text)` (uint32, or the same values as uint64). The LSH
      index (datasketch.MinHashLSH(threshold, num_perm, weights=lsh_weights)) proposes kept documents sharing a band; a
      duplicate if any candidate's estimated Jaccard >= threshold, otherwise the document is kept and
      indexed. A near-duplicate is compared with kept documents only, so a chain A ~ B ~ C with A !~ C
      keeps A and C.

    Memory (measured by benchmarks/dedup.py): exact holds a set of Python ints, about 70 bytes per kept
    document: ~7 GB at 100M documents, in the one merge process. Beyond that, shard it: a key's top bits pick
    one of P mergers, each walking only its keys in corpus order (the first occurrence of a key is
    decided within one shard, so the result does not change), or replace the set by a sort of
    (key, position) uint64 pairs (16 bytes a document, out of core if need be) and keep each key's lowest
    position. minhash holds each kept signature plus the LSH's 16 band tables, about 6 KB per kept
    document (600 GB at 100M): past a few million documents it wants an out-of-core or sharded index
    (e.g. band tables partitioned by band hash), or a dedicated tool.
    """

    def __init__(self, mode: Literal["none", "exact", "minhash"] = "exact", threshold: float = 0.8,
                 num_perm: int = 128, *, lsh_weights: tuple[float, float] = LSH_WEIGHTS):
        if mode not in MODES:
            raise ValueError(f"dedup mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode, self.threshold, self.num_perm = mode, threshold, num_perm
        self.kept = self.removed = 0
        self._seen: set[int] = set()
        self._signatures: list[np.ndarray] = []  # kept documents', by LSH key
        self._lsh = None
        if mode == "minhash":
            from datasketch import MinHashLSH

            self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=lsh_weights)

    def is_duplicate(self, key) -> bool:
        """True if the document with this key repeats an earlier kept one (it is then not remembered)."""
        if self.mode == "exact":
            dup = self._exact(int(key))
        elif self.mode == "minhash":
            dup = self._near(key)
        else:
            dup = False
        if dup:
            self.removed += 1
        else:
            self.kept += 1
        return dup

    def _exact(self, key: int) -> bool:
        if key in self._seen:
            return True
        self._seen.add(key)
        return False

    def _near(self, key) -> bool:
        from datasketch import LeanMinHash

        sig = np.asarray(key)
        if sig.shape != (self.num_perm,):
            raise ValueError(f"a minhash key has shape {sig.shape}, expected ({self.num_perm},) (num_perm)")
        if sig.dtype != SIGNATURE_DTYPE:
            if sig.size and int(sig.max()) > np.iinfo(SIGNATURE_DTYPE).max:
                raise ValueError(f"a minhash key holds {int(sig.max())}, more than 32 bits: not a signature "
                                 "of MinHasher")
            sig = sig.astype(SIGNATURE_DTYPE)
        m = LeanMinHash(seed=1, hashvalues=sig, scheme=SCHEME)  # the seed plays no part in the LSH
        for cand in self._lsh.query(m):
            if estimated_jaccard(self._signatures[cand], sig) >= self.threshold:
                return True
        self._lsh.insert(len(self._signatures), m, check_duplication=False)
        self._signatures.append(m.hashvalues)
        return False


@dataclass(frozen=True)
class Rejection:
    """Why a document is dropped: `kind` is a stable key for counting, `reason` says it with the numbers."""

    kind: Literal["too_short", "too_long", "non_alnum"]
    reason: str


@dataclass(frozen=True)
class Filters:
    """Quality filters (config: data.filters). Lengths count the characters of the stripped text; the
    non-alphanumeric fraction is the share of the stripped text's characters that are neither letters,
    digits nor whitespace (str.isalnum, str.isspace: every script counts as letters)."""

    min_chars: int = 1
    max_chars: int | None = None
    max_non_alnum_fraction: float | None = None

    @classmethod
    def from_config(cls, section) -> Filters:
        """From a config.FilterSection."""
        return cls(section.min_chars, section.max_chars, section.max_non_alnum_fraction)

    def check(self, text: str) -> Rejection | None:
        """The first filter that rejects the text (length, then characters), or None: keep it."""
        body = text.strip()
        n = len(body)
        if n < self.min_chars:
            return Rejection("too_short", f"shorter than min_chars ({n} < {self.min_chars} characters)")
        if self.max_chars is not None and n > self.max_chars:
            return Rejection("too_long", f"longer than max_chars ({n} > {self.max_chars} characters)")
        if self.max_non_alnum_fraction is not None and n:
            fraction = len(_NOT_ALNUM.findall(body)) / n
            if fraction > self.max_non_alnum_fraction:
                return Rejection("non_alnum", f"non-alphanumeric fraction {fraction:.2f} > "
                                              f"{self.max_non_alnum_fraction}")
        return None

    def kind(self, text: str) -> str | None:
        """The rejection's kind ("too_short", "too_long", "non_alnum"), or None: keep it."""
        rejection = self.check(text)
        return rejection.kind if rejection else None

    def reason(self, text: str) -> str | None:
        """The rejection's reason, e.g. "non-alphanumeric fraction 0.62 > 0.5", or None: keep it."""
        rejection = self.check(text)
        return rejection.reason if rejection else None
