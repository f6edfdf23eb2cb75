"""What packing conversations costs and saves: the demo conversation set (llmpipe.chat.synth) tokenized
with the chat template, then

  - the share of each sequence that is conversation rather than padding, packed vs one per sequence;
  - forward + backward time of the tiny model on one batch: SDPA with is_causal (text), with the boolean
    block-causal mask packing needs (same tokens), as ratios measured in the same run;
  - conversations per second through training, packed vs padded (the number that matters).

    python benchmarks/chat_packing.py [--seq-len 256] [--batch 8] [--repeats 5] [--flavor tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmpipe.chat.synth import make_conversations  # noqa: E402
from llmpipe.chat.template import builtin_template  # noqa: E402
from llmpipe.config import ModelSection  # noqa: E402
from llmpipe.data import chat  # noqa: E402
from llmpipe.data.tokenizer import train_tokenizer  # noqa: E402
from llmpipe.models.llama import flavors  # noqa: E402
from llmpipe.models.llama.model import Transformer  # noqa: E402


def _conversations(seq_len: int):
    tpl = builtin_template("chatml")
    train, _ = make_conversations(seed=0, n_arithmetic=2000)
    texts = [tpl.render(r["messages"]) for r in train]
    tok = train_tokenizer(texts, 2000, extra_special=chat.special_markers(tpl.source))
    docs = [chat.encode(tok, tpl, r["messages"], seq_len, "assistant")[:2] for r in train]
    return docs, tok.get_vocab_size()


def _times(fns, repeats: int) -> list[float]:
    """The median time of each function, run in turns (a loaded machine slows both alike)."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flavor", default="tiny")
    a = p.parse_args()
    torch.manual_seed(0)
    docs, vocab = _conversations(a.seq_len)
    lengths = np.array([len(ids) for ids, _ in docs])
    groups = chat.pack(lengths, a.seq_len)
    packed_fill = lengths.sum() / ((len(groups) - 1) * a.seq_len)
    padded_fill = lengths.mean() / a.seq_len
    print(f"{len(docs)} conversations, {lengths.mean():.1f} tokens on average (max {lengths.max()}), "
          f"seq_len {a.seq_len}")
    print(f"sequences: packed {len(groups) - 1} ({100 * packed_fill:.1f}% conversation), "
          f"padded {len(docs)} ({100 * padded_fill:.1f}% conversation)")

    args = flavors.model_args(ModelSection(flavor=a.flavor, max_seq_len=max(a.seq_len, 256)), vocab_size=vocab)
    model = Transformer(args)
    model.init_weights(seed=0)
    x = torch.randint(1, vocab, (a.batch, a.seq_len))
    y = torch.randint(1, vocab, (a.batch, a.seq_len))
    # the packed batch's document ids: the first sequences of the real packing
    doc = torch.full((a.batch, a.seq_len), -1, dtype=torch.int64)
    for r in range(a.batch):
        p0 = 0
        for d in range(int(groups[r]), int(groups[r + 1])):
            doc[r, p0:p0 + lengths[d]] = d
            p0 += lengths[d]

    def step(doc_ids=None):
        model.zero_grad(set_to_none=True)
        out = model(x) if doc_ids is None else model(x, doc_ids=doc_ids)
        F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()

    causal, masked = _times([step, lambda: step(doc)], a.repeats)
    print(f"forward+backward of {a.batch} x {a.seq_len} ({a.flavor}, {torch.get_num_threads()} threads): "
          f"is_causal {1000 * causal:.1f} ms, block-causal mask {1000 * masked:.1f} ms ({masked / causal:.2f}x)")
    per_packed = (lengths.sum() / (len(groups) - 1)) / lengths.mean()  # conversations per packed sequence
    print(f"conversations per second of training: packed {a.batch * per_packed / masked:.1f}, "
          f"padded {a.batch / causal:.1f} ({(a.batch * per_packed / masked) / (a.batch / causal):.1f}x)")


if __name__ == "__main__":
    main()
