"""Dedup keys, the sequential duplicate decision and the quality filters (llmpipe.data.dedup)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmpipe.config import FilterSection
from llmpipe.data.dedup import (
    Deduper,
    Filters,
    MinHasher,
    estimated_jaccard,
    exact_key,
    normalize,
    shingles,
)

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n_words)) + f" {seed}"


def _changed(text: str, n: int, seed: int) -> str:
    """The text with n of its words replaced by words not in WORDS."""
    words = text.split()
    for i in np.random.default_rng(seed).choice(len(words), n, replace=False):
        words[i] = f"changed{i}"
    return " ".join(words)


def _in_subprocess(code: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.mark.parametrize("raw, expected", [
    ("  Hello,\t\n  World  ", "hello, world"),
    ("ＦＵＬＬ　ｗｉｄｔｈ", "full width"),  # fullwidth letters and ideographic space (NFKC)
    ("ﬁne\u00a0print", "fine print"),  # ligature and no-break space
    ("Straße", "straße"),  # lowercased, not case-folded
    ("\n \t", ""),
])
def test_normalize_folds_nfkc_case_and_whitespace(raw, expected):
    assert normalize(raw) == expected


def test_exact_key_is_equal_for_case_whitespace_and_nfkc_variants_and_different_otherwise():
    base = exact_key("The quick brown fox.")
    assert base == exact_key("  the QUICK\tbrown\n\nfox. ") == exact_key("Ｔｈｅ quick brown fox．")
    assert base != exact_key("The quick brown fox!")
    assert base != exact_key("The quick brownfox.")
    assert 0 <= base < 2**64 and np.uint64(base) == base


def test_exact_key_is_the_same_in_another_process_with_another_hash_seed():
    texts = ["The quick brown fox.", "", "naïve café", "\ud800 lone surrogate"]
    mine = [exact_key(t) for t in texts]
    theirs = _in_subprocess("import json; from llmpipe.data.dedup import exact_key; "
                            f"print(json.dumps([exact_key(t) for t in {texts!r}]))")
    assert json.loads(theirs) == mine
    assert mine[0] == 0xB08F2600188627E5  # blake2b-64 of b"the quick brown fox.", big-endian


def test_exact_deduper_keeps_first_occurrences_in_order():
    docs = ["a b", "c", "A  B", "d", "c", "a b", "e"]
    deduper = Deduper("exact")
    kept = [d for d in docs if not deduper.is_duplicate(np.uint64(exact_key(d)))]
    assert kept == ["a b", "c", "d", "e"]
    assert (deduper.kept, deduper.removed) == (4, 3)


def test_deduper_none_keeps_everything():
    deduper = Deduper("none")
    assert [deduper.is_duplicate(1) for _ in range(3)] == [False, False, False]
    assert (deduper.kept, deduper.removed) == (3, 0)


def test_an_unknown_dedup_mode_is_refused():
    with pytest.raises(ValueError, match="dedup mode 'fuzzy' is not one of none, exact, minhash"):
        Deduper("fuzzy")


def test_shingles_are_word_ngrams_and_a_short_text_is_one_shingle():
    assert shingles("A b  C d", 3) == [b"a b c", b"b c d"]
    assert shingles("A b", 3) == [b"a b"]
    assert shingles("", 5) == [b""]


def test_minhash_catches_a_copy_with_a_few_words_changed_and_not_an_unrelated_text():
    hasher = MinHasher(num_perm=128, ngram=5)
    original = _text(400, seed=1)
    near = _changed(original, 2, seed=2)  # 2 of 401 words: true 5-gram Jaccard 0.95
    a, b = set(shingles(original, 5)), set(shingles(near, 5))
    assert len(a & b) / len(a | b) == pytest.approx(0.951, abs=0.005)
    assert estimated_jaccard(hasher.signature(original), hasher.signature(near)) > 0.85
    deduper = Deduper("minhash", threshold=0.8, num_perm=128)
    keys = [hasher.signature(t) for t in (original, _text(400, seed=3), near)]
    assert [deduper.is_duplicate(k) for k in keys] == [False, False, True]
    assert (deduper.kept, deduper.removed) == (2, 1)


def test_minhash_deduper_takes_signatures_stored_as_uint64():
    sig = MinHasher(num_perm=32, ngram=2).signature("one two three four")
    deduper = Deduper("minhash", num_perm=32)
    assert [deduper.is_duplicate(sig.astype(np.uint64)), deduper.is_duplicate(sig)] == [False, True]
    with pytest.raises(ValueError, match=r"a minhash key has shape \(16,\), expected \(32,\)"):
        deduper.is_duplicate(sig[:16])


def test_signatures_are_identical_across_instances_and_processes():
    text = _text(50, seed=7)
    first = MinHasher(num_perm=64, ngram=5).signature(text)
    assert first.dtype == np.uint32 and first.shape == (64,)
    np.testing.assert_array_equal(first, MinHasher(num_perm=64, ngram=5).signature(text))
    assert not np.array_equal(first, MinHasher(num_perm=64, ngram=5, seed=2).signature(text))
    theirs = _in_subprocess("from llmpipe.data.dedup import MinHasher; "
                            f"print(MinHasher(num_perm=64, ngram=5).signature({text!r}).tolist())")
    assert json.loads(theirs) == first.tolist()


@pytest.mark.parametrize("text, kind, reason", [
    ("  abc  ", "too_short", "shorter than min_chars (3 < 4 characters)"),
    ("abcdefghijk", "too_long", "longer than max_chars (11 > 10 characters)"),
    ("a = {$};", "non_alnum", "non-alphanumeric fraction 0.62 > 0.5"),  # 5 of 8: = { $ } ;
    ("snake_case", "non_alnum", "non-alphanumeric fraction 0.10 > 0.05"),  # "_" is not a letter
])
def test_filters_give_a_kind_and_a_reason_with_the_numbers(text, kind, reason):
    limit = 0.05 if "_" in text else 0.5
    filters = Filters(min_chars=4, max_chars=10, max_non_alnum_fraction=limit)
    assert filters.kind(text) == kind
    assert filters.reason(text) == reason


def test_filters_keep_letters_of_any_script_and_whitespace():
    filters = Filters(min_chars=1, max_chars=None, max_non_alnum_fraction=0.1)
    assert filters.check("Привет мир\n日本語 テキスト 123") is None


def test_default_filters_drop_only_empty_and_whitespace_only_documents():
    filters = Filters.from_config(FilterSection())
    assert filters == Filters(min_chars=1, max_chars=None, max_non_alnum_fraction=None)
    assert [filters.kind(t) for t in ("", " \n\t ")] == ["too_short", "too_short"]
    for text in ("x", "{}();" * 1000, "a" * 10_000_000):
        assert filters.check(text) is None
