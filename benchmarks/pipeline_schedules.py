"""Step time and bubble fraction of the three pipeline schedules at pp=2, with 4 and 8 micro-batches.

    python benchmarks/pipeline_schedules.py [--dim 256 --layers 4 --seq 128 --batch 8 --steps 8]

For each (schedule, micro-batches) a 2-rank gloo job (torchrun, this file as the worker) builds
llmpipe's MeshStrategy (pp=2, data=ddp at dp=1, fp32) and times, after warm-up:

    step        `forward_backward` of one micro-batch of `--batch` samples: the whole schedule, split
                into `microbatches` pipeline micro-batches, sends and receives included (median).
    compute     time the rank spent inside its stages' forward_one_chunk / backward_one_chunk in
                that step (the schedule waits for receives before calling them), median.
    bubble      measured: 1 - compute / step, averaged over the two ranks: the share of a step a
                rank waits or communicates; formula: (p-1)/(m+p-1), (p-1)/(v*m+p-1) interleaved.

The baseline is the unpipelined model (one process, one thread, the whole micro-batch at once):
`vs 1 proc` is its step time over the schedule's (above 1: the pipeline's two ranks finish sooner).
On 2 CPU cores each rank has one thread; ranks exchange activations through gloo over loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout without installing llmpipe

VOCAB = 512  # small, so the output head does not unbalance the two stages
CASES = [("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8), ("interleaved_1f1b", 4), ("interleaved_1f1b", 8)]


def _median_time(fn, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_compute(schedule) -> list[float]:
    """Wrap the schedule's stage(s) so the time spent inside forward_one_chunk / backward_one_chunk
    (compute only: the schedule waits for its receives before calling them) is added to the
    returned one-element list."""
    spent = [0.0]
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            inner = getattr(stage, name)

            def timed(*args, _inner=inner, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - t0

            setattr(stage, name, timed)
    return spent


def worker(config: str, out: str, steps: int) -> None:
    import torch.distributed as dist

    from llmpipe import config as config_mod
    from llmpipe.device import Env
    from llmpipe.models.llama import model_args
    from llmpipe.parallel.model_parallel import MeshStrategy
    from llmpipe.train.main import _exit

    cfg = config_mod.load(config)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    env = Env(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "fp32")
    strategy = MeshStrategy(cfg, env, model_args(cfg.model, vocab_size=VOCAB))
    gen = torch.Generator().manual_seed(0)
    t = cfg.train
    x = torch.randint(0, VOCAB, (t.micro_batch_size, cfg.data.seq_len + 1), generator=gen)
    x, y = x[:, :-1], x[:, 1:]

    spent = _time_compute(strategy.schedule)
    records: list[tuple[float, float]] = []

    def step():
        before = spent[0]
        t0 = time.perf_counter()
        strategy.forward_backward(x, y)
        records.append((time.perf_counter() - t0, spent[0] - before))
        for part in strategy.parts:
            part.zero_grad(set_to_none=True)

    _median_time(step, steps)
    records = records[2:]  # after warm-up
    step_s = statistics.median(r[0] for r in records)
    compute_s = statistics.median(r[1] for r in records)
    Path(out, f"rank{env.rank}.json").write_text(json.dumps({"step_s": step_s, "compute_s": compute_s}))
    strategy.close()
    _exit(0)


def run_case(schedule: str, m: int, root: Path, a: argparse.Namespace) -> list[dict]:
    import yaml

    from llmpipe.train.launch import run_streaming
    from tests.conftest import make_cfg

    folder = root / f"{schedule}-{m}"
    folder.mkdir(parents=True)
    v = 2 if schedule == "interleaved_1f1b" else 1
    cfg = make_cfg(folder, data={"seq_len": a.seq}, model=_model(a),
                   train={"nproc_per_node": 2, "micro_batch_size": a.batch,
                          "parallel": {"pp": 2, "pp_schedule": schedule, "microbatches": m, "virtual_stages": v}})
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
            __file__, "--worker", str(folder / "config.yaml"), str(folder), str(a.steps)]
    lines: list[str] = []
    code, _ = run_streaming(argv, lines.append, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if code != 0:
        sys.exit(f"{schedule} m={m} failed:\n" + "\n".join(lines[-40:]))
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def _model(a) -> dict:
    return {"flavor": "debug", "dim": a.dim, "n_layers": a.layers, "n_heads": a.dim // 64,
            "n_kv_heads": a.dim // 64, "ffn_dim": 3 * a.dim, "max_seq_len": a.seq}


def baseline(a: argparse.Namespace) -> float:
    """One process, one thread, the whole model forward + backward on the whole micro-batch."""
    import torch.nn.functional as F

    from llmpipe.models.llama import Transformer
    from llmpipe.models.llama.model import ModelArgs

    torch.set_num_threads(1)
    m = _model(a)
    model = Transformer(ModelArgs(dim=m["dim"], n_layers=m["n_layers"], n_heads=m["n_heads"],
                                  n_kv_heads=m["n_kv_heads"], ffn_dim=m["ffn_dim"], vocab_size=VOCAB,
                                  max_seq_len=a.seq))
    model.init_weights(seed=0)
    x = torch.randint(0, VOCAB, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    return _median_time(step, a.steps)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="samples per micro-batch (split into pipeline micro-batches)")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    from llmpipe.parallel.pipeline import bubble_fraction

    base = baseline(a)
    print(f"model dim={a.dim} layers={a.layers} seq={a.seq}, micro-batch {a.batch}, pp=2 on gloo, 1 thread per rank; "
          f"unpipelined 1-process step {base * 1e3:.1f} ms")
    head = f"{'schedule':<18} {'m':>2} {'step ms':>8} {'compute ms':>10} {'bubble':>7} {'formula':>7} {'vs 1 proc':>9}"
    print(head + "\n" + "-" * len(head))
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, m in CASES:
            ranks = run_case(schedule, m, Path(tmp), a)
            v = 2 if schedule == "interleaved_1f1b" else 1
            step = max(r["step_s"] for r in ranks)
            compute = max(r["compute_s"] for r in ranks)
            measured = statistics.mean(1 - r["compute_s"] / r["step_s"] for r in ranks)
            print(f"{schedule:<18} {m:>2} {step * 1e3:>8.1f} {compute * 1e3:>10.1f} {measured:>7.3f} "
                  f"{bubble_fraction(2, m, v):>7.3f} {base / step:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
