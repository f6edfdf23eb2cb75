"""Byte-level BPE tokenizer (GPT-2 style) with Hugging Face `tokenizers`: train, load, look up EOS.

Byte-level means every byte has a token, so any UTF-8 text encodes without <unk>. Training is
deterministic for the same documents in the same order (the trainer breaks count ties by token
ids, which follow the fixed 256-byte initial alphabet).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmpipe.stages import StageError


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer: no normalizer, GPT-2 pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: " def" and "def" stay different tokens, and decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(documents: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    eos_token: str = "<|endoftext|>") -> Tokenizer:
    """Train a byte-level BPE on `documents`. The vocabulary may come out smaller on a tiny corpus."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer.json; StageError with the path when it is missing or not a tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise StageError(f"{path}: tokenizer file not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise StageError(f"{path}: not a valid tokenizer.json ({first})") from None


def eos_id(tok: Tokenizer, eos_token: str) -> int:
    """The id of `eos_token`; StageError when the tokenizer does not have it as one token."""
    tid = tok.token_to_id(eos_token)
    if tid is None:
        raise StageError(f"tokenizer has no token {eos_token!r} (data.tokenizer.eos_token); "
                         "use a tokenizer that has it or set eos_token to one of its special tokens")
    return tid
