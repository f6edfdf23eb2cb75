"""What the chat demo's fine-tuning taught: exact-match accuracy on the held-out questions
(artifacts/chat_demo/val.jsonl, never trained on) of the base model (the demo's text run,
artifacts/tiny) and of the fine-tuned one (artifacts/tiny_chat), asked the same prompts in the same
chat template (the fine-tuned run's, checked against training's digest), greedy, through the same
deployed graphs (export_onnx's, onnxruntime fp32 by default), by question family.

    make demo && .venv/bin/llmpipe run configs/tiny_chat.yaml
    python benchmarks/chat_demo.py [--base artifacts/tiny] [--chat artifacts/tiny_chat]
                                   [--questions artifacts/chat_demo/val.jsonl] [--variant fp32] [--json OUT]

An answer is right when it equals the reference after surrounding whitespace is stripped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout

from llmpipe.chat.synth import family  # noqa: E402
from llmpipe.tools.generate import ask, open_run, run_template  # noqa: E402


def _questions(path: Path) -> list[tuple[str | None, str, str, str]]:
    """(system, question, answer, family) of each held-out conversation."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        msgs = record["messages"]
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        out.append((system, msgs[-2]["content"], msgs[-1]["content"], family(record)))
    return out


def accuracy(run: Path, chat, questions, variant: str, show: int) -> dict:
    loaded = open_run(run, variant)
    right, total = Counter(), Counter()
    t0 = time.perf_counter()
    for i, (system, question, answer, fam) in enumerate(questions):
        got = ask(loaded, chat, question, system, max_new_tokens=16)
        ok = got.strip() == answer.strip()
        right[fam] += ok
        total[fam] += 1
        if i < show:
            print(f"  {run.name}: {question!r} -> {got.strip()!r} ({'right' if ok else 'wrong, ' + repr(answer)})")
    out = {fam: {"right": right[fam], "asked": total[fam], "accuracy": right[fam] / total[fam]}
           for fam in sorted(total)}
    out["all"] = {"right": sum(right.values()), "asked": sum(total.values()),
                  "accuracy": sum(right.values()) / sum(total.values())}
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="artifacts/tiny", type=Path)
    p.add_argument("--chat", default="artifacts/tiny_chat", type=Path)
    p.add_argument("--questions", default="artifacts/chat_demo/val.jsonl", type=Path)
    p.add_argument("--variant", default="fp32", help="torch, fp32, int8, ... (generate --variant)")
    p.add_argument("--show", type=int, default=3, help="print this many answers of each model")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    questions = _questions(a.questions)
    chat = run_template(a.chat, a.variant)
    if chat is None:
        print(f"error: {a.chat} is not a chat run (no chat template)", file=sys.stderr)
        return 2
    results = {"before": accuracy(a.base, chat, questions, a.variant, a.show),
               "after": accuracy(a.chat, chat, questions, a.variant, a.show)}
    fams = [k for k in results["after"] if k not in ("seconds",)]
    print(f"\nexact match on {len(questions)} held-out questions ({a.questions}), {a.variant}, greedy")
    print(f"{'family':<12}{'asked':>7}{'before (' + a.base.name + ')':>22}{'after (' + a.chat.name + ')':>26}")
    for fam in fams:
        b, f = results["before"][fam], results["after"][fam]
        print(f"{fam:<12}{f['asked']:>7}{b['right']:>12} = {b['accuracy']:6.1%}{f['right']:>14} = {f['accuracy']:6.1%}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
