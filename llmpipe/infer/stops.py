"""Stop strings in streamed text: how much of the text's end may still become one (held back until the
next token tells), found in one pass per stop string over at most its length of text (Knuth-Morris-Pratt),
not by testing every prefix of every stop string (O(L^2) per token for a stop string of L characters)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=256)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP's failure function: fail[i] is the length of the longest proper prefix of stop[:i+1] that is
    also its suffix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


def _partial(text: str, stop: str) -> int:
    """The longest k < len(stop) such that `text` ends with stop[:k]."""
    if len(stop) < 2:
        return 0
    fail, k = _failure(stop), 0
    for c in text[-(len(stop) - 1):]:  # a held prefix is shorter than the stop string
        while k and (k == len(stop) or c != stop[k]):
            k = fail[k - 1]
        if c == stop[k]:
            k += 1
    return k if k < len(stop) else fail[k - 1]


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` begin a stop string (0 when none)."""
    return max((_partial(text, s) for s in stops if s), default=0)
