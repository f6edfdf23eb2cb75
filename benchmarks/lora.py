"""LoRA vs full fine-tuning, side by side (issue 24's numbers).

    python benchmarks/lora.py [--rounds 2] [--steps 30] [--json]

1. Memory and speed: a small model (58M parameters, 32k vocabulary) on 2 gloo ranks under DDP
   (this file as the torchrun worker, through llmpipe's own builder), micro-batch 4 x 64 tokens:
   trainable parameters, the peak RSS per rank above the floor (torch and the process group up)
   after the optimizer state exists, the planner's total for the same config, and tokens/s (the
   median step after 2 warm-ups). Full and LoRA alternate, `--rounds` times; medians across rounds.
2. Quality and merge: a tiny Hugging Face LLaMA folder (model.init_from, random weights, as the
   tests make it) fine-tuned by the train stage on the same corpus for `--steps` steps, full and
   LoRA (rank 8, alpha 16, every linear layer of the blocks); the final val loss of each, then the
   LoRA run consolidated: the merged hf/ model's logits against peft.PeftModel over the base and
   adapter/ (max abs difference, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_per_rank import _rss_now, init_worker  # noqa: E402

VOCAB = 32000
MODEL = {"flavor": "debug", "dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 1376,
         "max_seq_len": 64}
LORA = {"rank": 8, "alpha": 16}
WARMUP, TIMED = 2, 6


def worker(config: str, out: str) -> None:
    import torch.nn.functional as F

    from llmpipe.models.llama import model_args
    from llmpipe.parallel import build_strategy
    from llmpipe.train.main import _exit

    cfg, env = init_worker(config)
    floor = _rss_now()
    strategy = build_strategy(cfg, env, model_args(cfg.model, vocab_size=VOCAB))
    gen = torch.Generator().manual_seed(env.rank)
    times = []
    for i in range(WARMUP + TIMED):
        x = torch.randint(0, VOCAB, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), generator=gen)
        t0 = time.perf_counter()
        with strategy.micro_context(True):
            with strategy.forward_context():
                logits = strategy.module(x[:, :-1])  # (B, T, vocab)
            strategy.backward(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()))
        del logits
        strategy.step(i + 1)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - floor
    trainable = sum(p.numel() for p in strategy.parts[0].parameters() if p.requires_grad)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len * env.world
    Path(out, f"rank{env.rank}.json").write_text(json.dumps({
        "peak": peak, "trainable": trainable, "tokens_per_s": tokens / statistics.median(times[WARMUP:])}))
    strategy.close()
    _exit(0)


def measure(variant: str, root: Path) -> dict:
    """One 2-rank DDP run of `variant` (full | lora): its worst rank's peak beside the planner's."""
    import yaml

    from llmpipe.tools import plan
    from llmpipe.train.launch import run_streaming
    from tests.conftest import make_cfg

    folder = Path(tempfile.mkdtemp(dir=root, prefix=variant))
    cfg = make_cfg(folder, data={"seq_len": 64}, model=MODEL,
                   train={"nproc_per_node": 2, "micro_batch_size": 4, "grad_accum_steps": 1,
                          "lora": LORA if variant == "lora" else None})
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
            __file__, "--worker", str(folder / "config.yaml"), str(folder)]
    lines: list[str] = []
    code, _ = run_streaming(argv, lines.append, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if code != 0:
        raise RuntimeError(f"{variant} failed:\n" + "\n".join(lines[-40:]))
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    cfg.data.tokenizer.vocab_size = VOCAB  # the planner takes the vocabulary from here
    return {"peak": max(r["peak"] for r in ranks), "trainable": ranks[0]["trainable"],
            "tokens_per_s": ranks[0]["tokens_per_s"], "planned": plan.peak_memory(plan.setup_from_config(cfg, 2)).total}


def quality(root: Path, steps: int) -> dict:
    """Full and LoRA fine-tunes of a tiny HF folder: final val loss; merged vs PEFT logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from llmpipe import stages
    from tests.integration.test_init_from import _config, _save_hf

    folder = _save_hf(root / "llama")
    out: dict = {}
    for variant, lr in (("full", 3e-3), ("lora", 1e-2)):
        cfg = _config(root, folder, f"q-{variant}", max_steps=steps, optim={"lr": lr},
                      lora={"rank": 8, "alpha": 16} if variant == "lora" else None,
                      eval={"every_steps": steps, "batches": 4})
        for s in ("prepare_data", "train", "consolidate"):
            manifest, _ = stages.run_stage(s, cfg)
            if s == "train":
                out[variant] = {"val_loss": manifest.metrics["val_loss"],
                                "val_loss_start": manifest.metrics["val_loss_start"], "lr": lr}
    cons = cfg.run_dir() / "03_consolidate"
    x = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = LlamaForCausalLM.from_pretrained(cons / "hf").eval()(x).logits
        peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(folder).eval(), cons / "adapter").eval()
        out["peft_max_abs_diff"] = float((merged - peft(x).logits).abs().max())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, list[dict]] = {"full": [], "lora": []}
        for _ in range(a.rounds):  # alternate, so drifting load on the machine hits both alike
            for variant in runs:
                runs[variant].append(measure(variant, Path(tmp)))
        q = quality(Path(tmp), a.steps)
    rows = {v: {"trainable": r[0]["trainable"], "planned": r[0]["planned"],
                "peak": statistics.median(x["peak"] for x in r),
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in r), **q[v]} for v, r in runs.items()}
    if a.json:
        print(json.dumps({"rows": rows, "peft_max_abs_diff": q["peft_max_abs_diff"]}))
        return
    mib = 1 << 20
    print(f"\nsmall model {MODEL['dim']}x{MODEL['n_layers']} (vocab {VOCAB}), DDP on 2 gloo ranks, micro-batch 4 x 64, "
          f"{a.rounds} alternating rounds (medians); val loss: tiny HF folder, {a.steps} steps\n")
    print(f"{'':<6}{'trainable':>12}{'planned MiB':>13}{'peak MiB':>10}{'tokens/s':>10}{'val loss':>10}"
          f"{'(start)':>9}{'lr':>8}")
    for v, r in rows.items():
        print(f"{v:<6}{r['trainable']:>12,}{r['planned'] / mib:>13.0f}{r['peak'] / mib:>10.0f}"
              f"{r['tokens_per_s']:>10.0f}{r['val_loss']:>10.4f}{r['val_loss_start']:>9.4f}{r['lr']:>8.0e}")
    f, lo = rows["full"], rows["lora"]
    print(f"\nLoRA / full: trainable {lo['trainable'] / f['trainable']:.4f}, peak {lo['peak'] / f['peak']:.2f}, "
          f"planned {lo['planned'] / f['planned']:.2f}, tokens/s {lo['tokens_per_s'] / f['tokens_per_s']:.2f}")
    print(f"merged hf/ vs PEFT (base + adapter/) logits, fp32: max abs diff {q['peft_max_abs_diff']:.2e}")


if __name__ == "__main__":
    main()
