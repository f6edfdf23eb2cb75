"""Byte-level BPE tokenizer (GPT-2 style) with Hugging Face `tokenizers`: train, load, look up EOS.

Byte-level means every byte has a token, so any UTF-8 text encodes without <unk>. Training is
deterministic for the same documents in the same order (the trainer breaks count ties by token
ids, which follow the fixed 256-byte initial alphabet).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmpipe.data.errors import DataError

# Longest piece of text handed to the tokenizer at once. Its cost is about 100 bytes per character
# while encoding (tokens, offsets, pre-token splits) and the trainer buffers up to 256 items from the
# iterator, so 128k characters keeps either under a few tens of MB, whatever a document's length.
PIECE_CHARS = 1 << 17
# The trainer's pieces are shorter: a run of 512+ characters without whitespace (a base64 blob, minified
# code) is cut there, since BPE training time grows with the square of a word's length (a 2 MB run of
# letters: 111 s in 128k pieces, 12 s in 1k pieces). Cuts at whitespace give the trainer the same words.
TRAIN_PIECE_CHARS = 1 << 10
# A whitespace character followed by a non-space one; the last match before the budget is the cut.
# (\S is str.isspace()'s complement, a superset of the Unicode White_Space the pre-tokenizer's \s knows,
# so a character it calls non-space is non-space there too.)
_LAST_CUT = re.compile(r"(?s).*[ \t\n](?=\S)")


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer: no normalizer, GPT-2 pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: " def" and "def" stay different tokens, and decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(documents: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    eos_token: str = "<|endoftext|>", extra_special: Iterable[str] = ()) -> Tokenizer:
    """Train a byte-level BPE on `documents`. The vocabulary may come out smaller on a tiny corpus.
    `extra_special`: more special tokens after EOS (a chat template's markers, ids 1, 2, ...)."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token, *[t for t in extra_special if t != eos_token]],  # EOS: id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer.json; DataError with the path when it is missing or not a tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{path}: not a valid tokenizer.json ({first})") from None


def eos_id(tok: Tokenizer, eos_token: str) -> int:
    """The id of `eos_token`; DataError when the tokenizer does not have it as one token."""
    tid = tok.token_to_id(eos_token)
    if tid is None:
        raise DataError(f"tokenizer has no token {eos_token!r} (data.tokenizer.eos_token); "
                         "use a tokenizer that has it or set eos_token to one of its special tokens")
    return tid


def cut_point(text: str, start: int = 0, budget: int = PIECE_CHARS) -> int:
    """Where to end the piece of `text` that begins at `start` (more than `budget` characters remain):
    before a whitespace character followed by a non-space one, as late as possible in
    [start + budget/2, start + budget); at start + budget when there is none.

    NOTE: with the GPT-2 byte-level pre-tokenizer (no normalizer, no prefix space) this cut is exact:
    its regex always starts a pre-token at the last whitespace character of a run that a non-space
    follows (that character joins the next word: " word", or stands alone as "\\n"), none of its
    patterns looks behind, and the only lookahead, (?!\\S), sees whitespace there in the whole text and
    the end of string in the piece. BPE then merges inside pre-tokens only, so the pieces' ids are the
    whole document's ids. The hard cut (no such whitespace in half a budget, e.g. minified code or
    unspaced CJK text) splits one pre-token in two: ids near that cut differ from a whole-text encode.
    A loaded tokenizer.json with another pre-tokenizer (e.g. SentencePiece's Metaspace, which marks the
    start of every input) may also differ at whitespace cuts.
    """
    m = _LAST_CUT.match(text, start + budget // 2, start + budget + 1)
    return m.end() - 1 if m else start + budget


def training_text(text: str, max_chars: int) -> str:
    """What the BPE trainer sees of a document: its first `max_chars` characters, cut by `cut_point`."""
    return text if len(text) <= max_chars else text[:cut_point(text, 0, max_chars)]


def split_text(text: str, budget: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of at most `budget` characters, cut by `cut_point` (the text itself when short)."""
    start = 0
    while len(text) - start > budget:
        cut = cut_point(text, start, budget)
        yield text[start:cut]
        start = cut
    yield text[start:] if start else text
