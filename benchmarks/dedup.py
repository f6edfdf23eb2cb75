"""prepare_data's deduplication measured on generated corpora with planted duplicates (llmpipe.data.dedup).

    python benchmarks/dedup.py [--docs 50000] [--dup-rate 0.2] [--near 300] [--seed 0]

1. exact: --docs distinct documents of random words (20-200 words from a 20k-word vocabulary), then
   copies of them added until copies are --dup-rate of the final corpus: verbatim, UPPER/Title case,
   whitespace changed (tabs, newlines, doubled and edge spaces), fullwidth letters (NFKC folds them).
   Shuffled, keyed with exact_key and walked with Deduper("exact"): the removed fraction must equal the
   planted rate (to 0.1%), and every removed document must be a planted copy.
2. minhash at the default threshold (0.8, 128 permutations, word 5-grams): --near copies of distinct
   200-word documents with k% of their words replaced by random words, for each k, mixed with as many
   unrelated documents, after the 2000 originals. Recall: copies removed; precision: removed documents
   that are copies; each k with llmpipe's LSH weights and with datasketch's default (0.5, 0.5), so the
   LSH's own misses show (a copy at true Jaccard 0.9 that is not a candidate stays). True Jaccard is of
   the 5-gram shingle sets, estimated is from the signatures.
3. speed (one core) of exact_key and MinHasher.signature over the corpus of part 1, against a bare
   blake2b of the raw bytes measured in the same run; of Deduper.is_duplicate; and memory per kept
   document of each Deduper (tracemalloc).
"""

from __future__ import annotations

import argparse
import hashlib
import string
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

# NOTE: lets `python benchmarks/dedup.py` run from a checkout without installing llmpipe.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmpipe.data.dedup import (  # noqa: E402
    LSH_WEIGHTS,
    Deduper,
    MinHasher,
    estimated_jaccard,
    exact_key,
    normalize,
    shingles,
)

FULLWIDTH = str.maketrans({c: chr(ord(c) + 0xFEE0) for c in string.ascii_letters})


def vocabulary(rng: np.random.Generator, n: int = 20_000) -> np.ndarray:
    letters = np.array(list(string.ascii_lowercase))
    words = {"".join(rng.choice(letters, rng.integers(3, 11))) for _ in range(n * 2)}
    return np.array(sorted(words)[:n])


def document(rng: np.random.Generator, vocab: np.ndarray, n_words: int) -> list[str]:
    return list(rng.choice(vocab, n_words))


def variant(words: list[str], how: int, rng: np.random.Generator) -> str:
    """A copy that normalises to " ".join(words)."""
    text = " ".join(words)
    if how == 1:
        return text.upper()
    if how == 2:
        return text.title()
    if how == 3:
        seps = rng.choice([" ", "  ", "\t", "\n", " \n\n "], len(words) - 1)
        return "  " + "".join(w + s for w, s in zip(words, seps)) + words[-1] + "\n"
    if how == 4:
        return text.translate(FULLWIDTH)
    return text


def exact_corpus(rng, vocab, n_docs: int, dup_rate: float) -> tuple[list[str], np.ndarray]:
    """The shuffled corpus and, per document, whether it is a planted copy (not its group's first)."""
    base, seen = [], set()
    while len(base) < n_docs:
        words = document(rng, vocab, int(rng.integers(20, 201)))
        text = " ".join(words)
        if text not in seen:  # distinct after normalisation (all lowercase, single spaces)
            seen.add(text)
            base.append(words)
    n_copies = round(n_docs * dup_rate / (1 - dup_rate))
    sources = rng.integers(0, n_docs, n_copies)
    docs = [(" ".join(w), i) for i, w in enumerate(base)]
    docs += [(variant(base[s], int(rng.integers(0, 5)), rng), int(s)) for s in sources]
    order = rng.permutation(len(docs))
    first: set[int] = set()
    texts, planted = [], np.zeros(len(docs), dtype=bool)
    for j, i in enumerate(order):
        text, group = docs[i]
        texts.append(text)
        planted[j] = group in first
        first.add(group)
    return texts, planted


def part_exact(texts: list[str], planted: np.ndarray) -> dict:
    deduper = Deduper("exact")
    removed = np.array([deduper.is_duplicate(exact_key(t)) for t in texts])
    frac, target = removed.mean(), planted.mean()
    print("\n1. exact dedup, planted duplicates")
    print(f"{'documents':>10}{'planted':>9}{'planted %':>11}{'removed':>9}{'removed %':>11}{'error %':>9}"
          f"{'removed, not planted':>22}{'planted, kept':>15}")
    print(f"{len(texts):>10}{int(planted.sum()):>9}{100 * target:>11.3f}{int(removed.sum()):>9}{100 * frac:>11.3f}"
          f"{100 * (frac - target):>9.3f}{int((removed & ~planted).sum()):>22}{int((planted & ~removed).sum()):>15}")
    ok = abs(frac - target) <= 0.001
    print(f"removed fraction within 0.1% of the planted {100 * target:.1f}%: {'yes' if ok else 'NO'}")
    return {"ok": ok}


def replaced(rng, vocab, words: list[str], k: int) -> list[str]:
    out = list(words)
    for i in rng.choice(len(out), round(len(out) * k / 100), replace=False):
        out[i] = str(rng.choice(vocab))
    return out


def true_jaccard(a: str, b: str, ngram: int = 5) -> float:
    sa, sb = set(shingles(a, ngram)), set(shingles(b, ngram))
    return len(sa & sb) / len(sa | sb)


def part_minhash(rng, vocab, n_near: int) -> None:
    """Each k twice: llmpipe's LSH weights and datasketch's default (0.5, 0.5), on the same documents."""
    hasher = MinHasher(num_perm=128, ngram=5)
    originals = [document(rng, vocab, 200) for _ in range(2000)]
    orig_sigs = [hasher.signature(" ".join(w)) for w in originals]
    print("\n2. minhash dedup (threshold 0.8, 128 permutations, 5-grams), copies with k% of words replaced")
    print(f"{'k %':>5}{'lsh weights':>13}{'true J':>8}{'est. J':>8}{'|est-true|':>11}{'J>=0.8':>8}{'recall':>8}"
          f"{'recall J>=0.8':>15}{'false pos.':>11}{'precision':>11}")
    for k in (1, 2, 5, 10, 20, 40):
        picks = rng.choice(len(originals), n_near, replace=False)
        copies = [" ".join(replaced(rng, vocab, originals[i], k)) for i in picks]
        unrelated = [" ".join(document(rng, vocab, 200)) for _ in range(n_near)]
        true_j = np.array([true_jaccard(" ".join(originals[i]), c) for i, c in zip(picks, copies)])
        copy_sigs = [hasher.signature(c) for c in copies]
        est_j = np.array([estimated_jaccard(orig_sigs[i], s) for i, s in zip(picks, copy_sigs)])
        mixed = [(s, True) for s in copy_sigs] + [(hasher.signature(u), False) for u in unrelated]
        order = rng.permutation(len(mixed))
        for weights in (LSH_WEIGHTS, (0.5, 0.5)):
            deduper = Deduper("minhash", threshold=0.8, num_perm=128, lsh_weights=weights)
            assert not any(deduper.is_duplicate(s) for s in orig_sigs)
            hit = {True: np.zeros(n_near, bool), False: np.zeros(n_near, bool)}
            for j in order:
                sig, is_copy = mixed[j]
                hit[is_copy][j if is_copy else j - n_near] = deduper.is_duplicate(sig)
            tp, fp = int(hit[True].sum()), int(hit[False].sum())
            high = true_j >= 0.8
            recall_high = f"{hit[True][high].mean():.3f}" if high.any() else "-"
            print(f"{k:>5}{str(weights):>13}{true_j.mean():>8.3f}{est_j.mean():>8.3f}"
                  f"{np.abs(est_j - true_j).mean():>11.3f}{int(high.sum()):>8}{tp / n_near:>8.3f}{recall_high:>15}"
                  f"{fp:>11}{(tp / (tp + fp) if tp + fp else float('nan')):>11.3f}")


def rate(fn, items) -> float:
    t0 = time.perf_counter()
    for x in items:
        fn(x)
    return len(items) / (time.perf_counter() - t0)


def bytes_per_doc(mode: str, keys) -> float:
    tracemalloc.start()
    deduper = Deduper(mode)
    before = tracemalloc.get_traced_memory()[0]
    for key in keys:
        deduper.is_duplicate(key)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / deduper.kept


def part_speed(rng, texts: list[str]) -> None:
    sample = texts[:20_000]
    words = np.mean([len(t.split()) for t in sample])
    raw = rate(lambda t: hashlib.blake2b(t.encode(), digest_size=8).digest(), sample)
    hasher = MinHasher(num_perm=128, ngram=5)
    rows = [("blake2b of raw bytes (baseline)", raw), ("normalize", rate(normalize, sample)),
            ("exact_key", rate(exact_key, sample)), ("MinHasher.signature", rate(hasher.signature, sample[:5000]))]
    print(f"\n3. speed, one core, {len(sample)} documents of {words:.0f} words on average")
    print(f"{'':<34}{'documents/s':>12}{'x baseline':>12}")
    for name, r in rows:
        print(f"{name:<34}{r:>12,.0f}{r / raw:>12.3f}")
    keys = [exact_key(t) for t in sample]
    sigs = [hasher.signature(t) for t in sample[:5000]]
    ex, mh = Deduper("exact"), Deduper("minhash")
    print(f"{'Deduper exact .is_duplicate':<34}{rate(ex.is_duplicate, keys):>12,.0f}")
    print(f"{'Deduper minhash .is_duplicate':<34}{rate(mh.is_duplicate, sigs):>12,.0f}")
    n = 1_000_000
    exact_bytes = bytes_per_doc("exact", (int(k) for k in rng.integers(0, 2**63, n, dtype=np.uint64) * 2 + 1))
    # random signatures: no candidates, so every document is kept and indexed (the worst case for memory)
    sig_keys = rng.integers(0, 2**32, (20_000, 128), dtype=np.uint64).astype(np.uint32)
    minhash_bytes = bytes_per_doc("minhash", sig_keys)
    print(f"\nmemory per kept document: exact {exact_bytes:.0f} B ({n:,} keys; {exact_bytes * 1e8 / 1e9:.1f} GB at "
          f"100M), minhash {minhash_bytes:,.0f} B ({len(sig_keys):,} signatures; {minhash_bytes * 1e8 / 1e9:,.0f} GB "
          "at 100M)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--dup-rate", type=float, default=0.2)
    ap.add_argument("--near", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    vocab = vocabulary(rng)
    texts, planted = exact_corpus(rng, vocab, a.docs, a.dup_rate)
    result = part_exact(texts, planted)
    part_minhash(rng, vocab, a.near)
    part_speed(rng, texts)
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
