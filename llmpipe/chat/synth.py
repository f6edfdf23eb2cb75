"""A deterministic conversation set for the chat demo: arithmetic and short factual questions with
one exact answer each, split train/held-out by question (a held-out question never appears in training,
in any phrasing), so exact-match accuracy on the held-out set measures what SFT taught.

    make_conversations(seed, n_arithmetic, val_fraction) -> (train, held_out)   lists of {"messages": [...]}
    llmpipe synth-chat OUT [--seed S] [--arithmetic N] [--val-fraction F]      -> OUT/train.jsonl, OUT/val.jsonl
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


def _record(question: str, answer: str, system: bool) -> dict:
    messages = ([{"role": "system", "content": SYSTEM}] if system else []) + \
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def make_conversations(seed: int = 0, n_arithmetic: int = 2000,
                       val_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """(train, held_out) conversations, the same for the same arguments on any machine. Half carry the
    system message. Held-out questions (by key) are never in train."""
    rng = random.Random(seed)
    items = [(k, q, a) for k, q, a in _arithmetic(rng, n_arithmetic)] + [(q, q, a) for q, a in FACTS]
    keys = sorted({k for k, _, _ in items})
    rng.shuffle(keys)
    held = set(keys[:max(1, round(val_fraction * len(keys)))])
    train, val = [], []
    for i, (key, q, a) in enumerate(items):
        (val if key in held else train).append(_record(q, a, system=i % 2 == 0))
    rng.shuffle(train)
    return train, val


def write(out: str | Path, seed: int = 0, n_arithmetic: int = 2000, val_fraction: float = 0.1) -> dict[str, int]:
    """OUT/train.jsonl and OUT/val.jsonl (JSON lines of {"messages": [...]}); returns their counts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = make_conversations(seed, n_arithmetic, val_fraction)
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        tmp = out / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(out / name)
    return {"train": len(train), "val": len(val)}
