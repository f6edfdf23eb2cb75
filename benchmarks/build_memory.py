"""Peak memory per rank while building a >= 1 GB model and taking its first step: FSDP2, ZeRO-3 and
DDP on 2 gloo ranks, beside the planner's prediction (llmpipe.tools.plan) for the same config.

    python benchmarks/build_memory.py [--layers 3] [--only fsdp,zero3,ddp] [--json]

Each layout runs under torchrun (this file as the worker) through llmpipe's own builder
(llmpipe.parallel.build_strategy). Per rank:

    floor      RSS once torch, the process group (and DeepSpeed) are up, before the model is built
    build      getrusage's peak RSS minus the floor once the model is built (a sharded layout
               allocates only its shards, drawing one full tensor at a time)
    peak       the same after two training steps (micro-batch 1): the second one runs forward and
               backward with the optimizer state allocated
    planned    the planner's total for that rank: sharded states + gathered units + activations +
               communication buffers
    states     the planner's sharded parameters + gradients + optimizer state
    full       what one whole copy of the states would be (16 bytes/param fp32 with AdamW)

The rank with the highest peak is shown; error = peak / planned - 1. On CPU, RSS is the only
process-level number (accelerators report the allocator's peak through llmpipe.device).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_per_rank import _rss_now, init_worker  # noqa: E402

VOCAB = 32000
STEPS = 2
LAYOUTS = {
    "fsdp": {"data": "fsdp"},
    # a 50M-element reduce bucket: DeepSpeed allocates the whole bucket (contiguous_gradients), and the
    # default 500M elements (2 GB in fp32) would dwarf the model's own numbers; the planner counts it too
    "zero3": {"data": "zero", "zero_stage": 3, "reduce_bucket_size": 50_000_000},
    "ddp": {"data": "ddp"},
}
MODEL = {"flavor": "llama-1b", "dim": 2048, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 5632, "max_seq_len": 64}


def worker(config: str, out: str) -> None:
    import torch.nn.functional as F

    from llmpipe.models.llama import model_args
    from llmpipe.parallel import build_strategy
    from llmpipe.train.main import _exit

    cfg, env = init_worker(config)
    floor = _rss_now()
    strategy = build_strategy(cfg, env, model_args(cfg.model, vocab_size=VOCAB))
    after_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - floor
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(STEPS):  # the second step holds the optimizer state through forward and backward
        x = torch.randint(0, VOCAB, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), generator=gen)
        with strategy.micro_context(True):
            with strategy.forward_context():
                logits = strategy.module(x[:, :-1])  # (B, T, vocab)
            strategy.backward(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()))
        del logits
        strategy.step(1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - floor
    Path(out, f"rank{env.rank}.json").write_text(json.dumps({"floor": floor, "build": after_build, "peak": peak}))
    strategy.close()
    _exit(0)


def config_for(folder: Path, layout: str, layers: int):
    from tests.conftest import make_cfg

    return make_cfg(folder, data={"seq_len": 16}, model={**MODEL, "n_layers": layers},
                    train={"nproc_per_node": 2, "micro_batch_size": 1, "grad_accum_steps": 1,
                           "parallel": LAYOUTS[layout]})


def measure(layout: str, root: Path, layers: int) -> dict:
    """Run one layout on 2 ranks; its worst rank's numbers beside the planner's."""
    import yaml

    from llmpipe.models.llama import model_args
    from llmpipe.tools import plan
    from llmpipe.train.launch import run_streaming

    folder = root / layout
    folder.mkdir(parents=True)
    cfg = config_for(folder, layout, layers)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
            __file__, "--worker", str(folder / "config.yaml"), str(folder)]
    lines: list[str] = []
    code, _ = run_streaming(argv, lines.append, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if code != 0:
        raise RuntimeError(f"{layout} failed:\n" + "\n".join(lines[-40:]))
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    worst = max(ranks, key=lambda r: r["peak"])
    cfg.data.tokenizer.vocab_size = VOCAB  # the planner takes the vocabulary from here
    mem = plan.peak_memory(plan.setup_from_config(cfg, 2))
    n = model_args(cfg.model, vocab_size=VOCAB).num_params()
    return {"layout": layout, "params": n, **worst, "planned": mem.total, "states": mem.model_states,
            "full": 16 * n, "error": worst["peak"] / mem.total - 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--only", default=",".join(LAYOUTS))
    p.add_argument("--json", action="store_true", help="print the rows as JSON (for tests)")
    p.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, Path(tmp), a.layers) for name in a.only.split(",")]
    if a.json:
        print(json.dumps(rows))
        return
    gib = 1 << 30
    print(f"\nmodel: {rows[0]['params'] / 1e6:.0f}M parameters, {4 * rows[0]['params'] / gib:.2f} GiB fp32; "
          "2 gloo ranks; GiB on the rank with the highest peak\n")
    print(f"{'layout':<8}{'floor':>8}{'build':>8}{'peak':>8}{'planned':>9}{'error':>8}{'states':>8}{'full':>8}")
    for r in rows:
        print(f"{r['layout']:<8}{r['floor'] / gib:>8.2f}{r['build'] / gib:>8.2f}{r['peak'] / gib:>8.2f}"
              f"{r['planned'] / gib:>9.2f}{r['error']:>+8.1%}{r['states'] / gib:>8.2f}{r['full'] / gib:>8.2f}")


if __name__ == "__main__":
    main()
