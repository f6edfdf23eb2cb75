"""A deterministic conversation set for the chat demo: questions with one exact answer each, split
train/held-out by question (a held-out question never appears in training, in any phrasing), so
exact-match accuracy on the held-out set measures what SFT taught.

Families (`family(record)` names a record's):
- arithmetic: `What is 17 + 25?` -> `42.` (sums and differences of 0..50, products of 0..12);
- words: made-up words (`Repeat the word:\ntavoki` -> `tavoki.`, `Which word comes first?\ntavoki\nremu
  \nsabe` -> `tavoki.`, ... last), split by the word asked for, so a held-out word is never an answer in
  training: what generalises is the instruction (copying), not a memorised answer;
- classify: `Is 4817 even or odd?` -> `Odd.`, `Is this a number or a word?\ntavoki` -> `A word.`
  (split by what is shown; the answer is one of two, read off the question);
- facts: short factual questions (`What is the capital of France?` -> `Paris.`): a held-out fact
  cannot be inferred from the others, so these measure memorisation in training and little else.

    make_conversations(seed, n_arithmetic, val_fraction, n_words) -> (train, held_out)
    llmpipe synth-chat OUT [--seed S] [--arithmetic N] [--words N] [--val-fraction F]
        -> OUT/train.jsonl, OUT/val.jsonl (JSON lines of {"messages": [...]})
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEM = "You are a concise assistant. Answer with the result only."
# (question, answer): facts a tiny model can memorise; each is one question of the split
FACTS = [
    ("What is the capital of France?", "Paris."), ("What is the capital of Italy?", "Rome."),
    ("What is the capital of Spain?", "Madrid."), ("What is the capital of Germany?", "Berlin."),
    ("What is the capital of Japan?", "Tokyo."), ("What is the capital of Egypt?", "Cairo."),
    ("What is the capital of Canada?", "Ottawa."), ("What is the capital of Kenya?", "Nairobi."),
    ("What is the capital of Peru?", "Lima."), ("What is the capital of Norway?", "Oslo."),
    ("What is the capital of Greece?", "Athens."), ("What is the capital of Poland?", "Warsaw."),
    ("How many legs does a spider have?", "8."), ("How many legs does an insect have?", "6."),
    ("How many days are in a week?", "7."), ("How many months are in a year?", "12."),
    ("How many hours are in a day?", "24."), ("How many minutes are in an hour?", "60."),
    ("What colour is the sky on a clear day?", "Blue."), ("What colour is grass?", "Green."),
    ("What is the opposite of hot?", "Cold."), ("What is the opposite of up?", "Down."),
    ("What is the boiling point of water in Celsius?", "100."), ("What is the freezing point of water in "
                                                                 "Celsius?", "0."),
]
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_PHRASES = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?")


# How many distinct questions each family can draw: asking for more would loop forever looking for new ones.
ARITHMETIC_SPACE = 51 * 51 + 51 * 52 // 2 + 13 * 13  # a + b, a - b (a >= b) over 0..50; a * b over 0..12: 4096
WORDS_SPACE = 10_000  # as many classify questions as words, their numbers drawn from 0..9999 without repeats


def count_problem(n_arithmetic: int, n_words: int | None) -> str | None:
    """Why these counts cannot be made (one line naming the option and the space), or None."""
    if n_arithmetic > ARITHMETIC_SPACE:
        return (f"synth-chat: --arithmetic {n_arithmetic}: only {ARITHMETIC_SPACE} distinct arithmetic questions "
                "exist (sums and differences of 0..50, products of 0..12)")
    words = n_arithmetic if n_words is None else n_words
    if words > WORDS_SPACE:
        option = "--words" if n_words is not None else "--arithmetic (the default of --words)"
        return (f"synth-chat: {option} {words}: at most {WORDS_SPACE} made-up words (each comes with a classify "
                "question on a distinct number of 0..9999)")
    return None


def _arithmetic(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    """n distinct (key, question, answer); the key (the operation and operands) decides the split, so every
    phrasing of one sum lands on the same side."""
    seen, out = set(), []
    while len(out) < n:
        op = rng.choice(sorted(_OPS))
        a, b = (rng.randint(0, 50), rng.randint(0, 50)) if op != "*" else (rng.randint(0, 12), rng.randint(0, 12))
        if op == "-" and b > a:
            a, b = b, a
        key = f"{a}{op}{b}"
        if key in seen:
            continue
        seen.add(key)
        out.append((key, rng.choice(_PHRASES).format(a=a, op=op, b=b), f"{_OPS[op](a, b)}."))
    return out


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
# each word on a line of its own: a byte-level BPE splits a word after a space differently from the same
# word at the start of a line (the answer's), so the answer is then a copy of the question's tokens
_WORD_PHRASES = {
    "repeat": ("Repeat the word:\n{w}", "Say this word:\n{w}"),
    "first": ("Which word comes first?\n{w}\n{x}\n{y}",),
    "last": ("Which word comes last?\n{x}\n{y}\n{w}",),
}


def _words(rng: random.Random, n: int) -> list[str]:
    """n distinct made-up words of 2 or 3 syllables."""
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen.setdefault("".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))))
    return list(seen)


def _word_questions(rng: random.Random, words: list[str], held: set[str]) -> list[tuple[str, str, str]]:
    """One (key, question, answer) per word, the key being the word answered; the other words of a
    question are drawn from the training side only."""
    pool = [w for w in words if w not in held]
    out = []
    for w in words:
        family = rng.choice(sorted(_WORD_PHRASES))
        x, y = [p for p in rng.sample(pool, min(3, len(pool))) if p != w][:2] if len(pool) > 2 else ("", "")
        out.append((f"word:{w}", rng.choice(_WORD_PHRASES[family]).format(w=w, x=x, y=y), f"{w}."))
    return out


def _classify_questions(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    """n (key, question, answer) that sort what they are shown into two kinds: a number's parity, and
    whether a line is a number or a (made-up) word; the key is what is shown."""
    numbers = rng.sample(range(10_000), n)
    words = _words(rng, n)
    out = []
    for i in range(n):
        k = numbers[i]
        if i % 2 == 0:
            out.append((f"parity:{k}", f"Is {k} even or odd?", "Even." if k % 2 == 0 else "Odd."))
        else:
            x = str(k) if rng.random() < 0.5 else words[i]
            out.append((f"kind:{x}", f"Is this a number or a word?\n{x}",
                        "A number." if x.isdigit() else "A word."))
    return out


def family(record: dict) -> str:
    """arithmetic, words, classify or facts: which family a conversation of this set belongs to."""
    question = record["messages"][-2]["content"]
    if any(question == q for q, _ in FACTS):
        return "facts"
    if question.endswith("even or odd?") or question.startswith("Is this a number or a word?"):
        return "classify"
    return "arithmetic" if any(ch.isdigit() for ch in question) else "words"


def _record(question: str, answer: str, system: bool) -> dict:
    messages = ([{"role": "system", "content": SYSTEM}] if system else []) + \
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def make_conversations(seed: int = 0, n_arithmetic: int = 2000, val_fraction: float = 0.1,
                       n_words: int | None = None) -> tuple[list[dict], list[dict]]:
    """(train, held_out) conversations, the same for the same arguments on any machine. Half carry the
    system message. Held-out questions (by key) are never in train. n_words (made-up words asked for, and
    as many classify questions) defaults to n_arithmetic."""
    rng = random.Random(seed)
    words = _words(rng, n_arithmetic if n_words is None else n_words)
    items = [*_arithmetic(rng, n_arithmetic), *[(q, q, a) for q, a in FACTS],
             *_classify_questions(rng, len(words))]
    keys = sorted({k for k, _, _ in items} | {f"word:{w}" for w in words})
    rng.shuffle(keys)
    held = set(keys[:max(1, round(val_fraction * len(keys)))])
    items += _word_questions(rng, words, {k[5:] for k in held if k.startswith("word:")})
    train, val = [], []
    for i, (key, q, a) in enumerate(items):
        (val if key in held else train).append(_record(q, a, system=i % 2 == 0))
    rng.shuffle(train)
    return train, val


def write(out: str | Path, seed: int = 0, n_arithmetic: int = 2000, val_fraction: float = 0.1,
          n_words: int | None = None) -> dict[str, int]:
    """OUT/train.jsonl and OUT/val.jsonl (JSON lines of {"messages": [...]}); returns their counts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = make_conversations(seed, n_arithmetic, val_fraction, n_words)
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        tmp = out / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(out / name)
    return {"train": len(train), "val": len(val)}
