"""What the chat demo's fine-tuning taught: exact-match accuracy on the held-out questions
(val.jsonl of `llmpipe synth-chat`, never trained on) of the base model and of the fine-tuned one, asked
the same prompts in the same chat template (the fine-tuned run's, checked against training's digest),
greedy, by question family.

The base is a run (`--base artifacts/tiny`, the tiny demo's text model: both through the same deployed
graphs, export_onnx's, onnxruntime fp32 by default) or a Hugging Face folder (`--base-hf
artifacts/smollm2-135m-instruct`, a pretrained model: then both the base folder and the run's hf/ are asked
through transformers, and the run's deployed graphs as well).

    make chat-demo      (SmolLM2-135M-Instruct: --base-hf, --chat artifacts/smollm2_chat)
    python benchmarks/chat_demo.py [--base artifacts/tiny | --base-hf FOLDER] [--chat artifacts/tiny_chat]
                                   [--questions artifacts/chat_demo/val.jsonl] [--variant fp32] [--limit N]
                                   [--json OUT]

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


class HFAsker:
    """A Hugging Face folder asked through transformers, greedy, in the run's chat template (what the run was
    trained to read), stopping at eos or the template's end of turn."""

    def __init__(self, folder: Path, chat):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.chat, self.name = torch, chat, str(folder)
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ends = [self.tok.convert_tokens_to_ids(t) for t in chat.template.end_of_turn]
        self.stops = [i for i in {self.tok.eos_token_id, *ends} if isinstance(i, int) and i >= 0]

    def __call__(self, question: str, system: str | None) -> str:
        from llmpipe.tools.generate import chat_prompt

        ids = self.tok(chat_prompt(self.chat, question, system), add_special_tokens=False,
                       return_tensors="pt").input_ids
        with self.torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=self.stops,
                                      pad_token_id=self.stops[0])
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def accuracy(run: Path | HFAsker, chat, questions, variant: str, show: int) -> dict:
    if isinstance(run, HFAsker):
        asker, name = run, run.name
    else:
        loaded, name = open_run(run, variant), run.name
        asker = lambda q, s: ask(loaded, chat, q, s, max_new_tokens=16)  # noqa: E731
    right, total = Counter(), Counter()
    t0 = time.perf_counter()
    for i, (system, question, answer, fam) in enumerate(questions):
        got = asker(question, system)
        ok = got.strip() == answer.strip()
        right[fam] += ok
        total[fam] += 1
        if i < show:
            print(f"  {name}: {question!r} -> {got.strip()!r} ({'right' if ok else 'wrong, ' + repr(answer)})")
    out = {fam: {"right": right[fam], "asked": total[fam], "accuracy": right[fam] / total[fam]}
           for fam in sorted(total)}
    out["all"] = {"right": sum(right.values()), "asked": sum(total.values()),
                  "accuracy": sum(right.values()) / sum(total.values())}
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="artifacts/tiny", type=Path, help="the base model as a finished run")
    p.add_argument("--base-hf", type=Path, help="the base model as a Hugging Face folder (a pretrained model)")
    p.add_argument("--limit", type=int, help="ask only the first N held-out questions")
    p.add_argument("--chat", default="artifacts/tiny_chat", type=Path)
    p.add_argument("--questions", default="artifacts/chat_demo/val.jsonl", type=Path)
    p.add_argument("--variant", default="fp32", help="torch, fp32, int8, ... (generate --variant)")
    p.add_argument("--show", type=int, default=3, help="print this many answers of each model")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    questions = _questions(a.questions)[:a.limit]
    chat = run_template(a.chat, a.variant)
    if chat is None:
        print(f"error: {a.chat} is not a chat run (no chat template)", file=sys.stderr)
        return 2
    if a.base_hf:
        hf = a.chat / "03_consolidate" / "hf"
        results = {"before": accuracy(HFAsker(a.base_hf, chat), chat, questions, "torch", a.show),
                   "after": accuracy(HFAsker(hf, chat), chat, questions, "torch", a.show),
                   f"after ({a.variant})": accuracy(a.chat, chat, questions, a.variant, a.show)}
        names = {"before": f"before ({a.base_hf.name}, transformers)", "after": "after (hf/, transformers)",
                 f"after ({a.variant})": f"after (deployed {a.variant})"}
    else:
        results = {"before": accuracy(a.base, chat, questions, a.variant, a.show),
                   "after": accuracy(a.chat, chat, questions, a.variant, a.show)}
        names = {"before": f"before ({a.base.name})", "after": f"after ({a.chat.name})"}
    fams = [k for k in results["after"] if k not in ("seconds",)]
    print(f"\nexact match on {len(questions)} held-out questions ({a.questions}), greedy")
    print(f"{'family':<12}{'asked':>7}" + "".join(f"  {n:>34}" for n in names.values()))
    for fam in fams:
        cells = "".join(f"  {results[k][fam]['right']:>24} = {results[k][fam]['accuracy']:6.1%}" for k in names)
        print(f"{fam:<12}{results['after'][fam]['asked']:>7}{cells}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
