"""Memory per rank of each data-parallel strategy on the same model: DDP, ZeRO-1/2/3, FSDP2 (add an entry
to STRATEGIES, and to EXPECTED if there is a prediction, for another one).

    python benchmarks/memory_per_rank.py [--dim 512 --layers 8] [--nproc 2] [--only ddp,zero3]

Each strategy trains a few fp32 steps (micro-batch 1, accumulation 2) of the same model on `--nproc`
gloo ranks (torchrun, this file as the worker, llmpipe's build_strategy: one builder
for every layout) and reports, for the rank with the most:

    model states   bytes of the distinct tensor storages holding, per category,
                   params   this rank's parameters (ZeRO-3: its partition, p.ds_tensor)
                   grads    gradients of the module's and of the torch optimizer's parameters
                   master   torch optimizer parameters that are not module parameters (ZeRO's fp32
                            partitions)
                   optim    the optimizer's state (AdamW exp_avg, exp_avg_sq, step)
                   sampled after every backward and when the torch optimizer steps (a step pre-hook:
                   gradients complete, not yet freed); the sample with the largest sum is shown.
    expect         the model-state bytes per parameter ZeRO's analysis predicts (EXPECTED).
    rss@step       RSS at those samples minus RSS just before the model is built (imports done):
                   also activations, communication buffers, the process's allocator.
    rss peak       getrusage's peak minus the same baseline: includes set-up transients (DeepSpeed
                   flattening the parameters; ZeRO-3 partitioning a model built whole on each rank).

On CPU RSS is the only process-level number (dev.peak_memory_bytes gives the allocator's peak on
accelerators); the model-state columns are the part that sharding is meant to divide.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch

# NOTE: lets `python benchmarks/memory_per_rank.py` run from a checkout without installing llmpipe.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 256
# name -> train.parallel settings; the order is the table's.
STRATEGIES: dict[str, dict] = {
    "ddp": {"data": "ddp"},
    "zero1": {"data": "zero", "zero_stage": 1},
    "zero2": {"data": "zero", "zero_stage": 2},
    "zero3": {"data": "zero", "zero_stage": 3},
    "fsdp": {"data": "fsdp"},
}
CATEGORIES = ("params", "grads", "master", "optim")
# Model-state bytes per parameter that ZeRO's analysis predicts for fp32 AdamW on N ranks, with the
# separate fp32 master copy DeepSpeed keeps: params 4, grads 4, master 4, AdamW 8, the last ones sharded.
EXPECTED = {
    "ddp": lambda n: 16.0,
    "zero1": lambda n: 4 + 4 + 12 / n,
    "zero2": lambda n: 4 + 16 / n,
    "zero3": lambda n: 20 / n,
    # FSDP2 shards params, grads and AdamW state with no separate master copy. NOTE: while gradients
    # accumulate without sync, each rank briefly holds full-size unsharded gradients (+4 bytes/param).
    "fsdp": lambda n: 16 / n,
}


def _rss_now() -> int:
    """Resident set now. NOTE: glibc keeps freed heap memory (the full model ZeRO-3 partitions away,
    DeepSpeed's flattening copies) in the process; malloc_trim returns it first, so that this counts
    live memory rather than allocator slack."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank stores: ZeRO-3's partition, a DTensor's local shard."""
    t = getattr(t, "ds_tensor", t)
    return t.to_local() if hasattr(t, "to_local") else t


def count_states(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes per category of distinct storages (a storage is counted once, in its first category)."""
    module_params = list(module.parameters())
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    found = {
        "params": [_local(p) for p in module_params],
        "master": opt_params,
        "grads": [p.grad for p in module_params + opt_params if p.grad is not None],
        "optim": [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)],
    }
    seen: set[int] = set()
    out = {}
    for cat in ("params", "master", "grads", "optim"):
        total = 0
        for t in found[cat]:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[cat] = total
    return out


def _torch_optimizer(strategy) -> torch.optim.Optimizer:
    """The torch optimizer that does the update (DeepSpeed keeps the client one as basic_optimizer)."""
    engine = getattr(strategy, "engine", None)
    return engine.basic_optimizer if engine is not None else strategy.opts[0]


def init_worker(config: str):
    """A gloo rank under torchrun: (config, llmpipe Env on CPU in fp32), one thread; DeepSpeed imported
    first for data=zero, so its import cost is outside any baseline taken afterwards."""
    import torch.distributed as dist

    from llmpipe import config as config_mod
    from llmpipe.device import Env

    cfg = config_mod.load(config)
    dist.init_process_group("gloo")
    env = Env(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "fp32")
    torch.set_num_threads(1)
    if cfg.train.parallel.data == "zero":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401
    return cfg, env


def worker(config: str, out: str, steps: int) -> None:
    """torchrun worker: train `steps` steps on random tokens, write rank{N}.json."""
    import torch.nn.functional as F

    from llmpipe.models.llama import model_args
    from llmpipe.parallel import build_strategy
    from llmpipe.train.main import _exit

    cfg, env = init_worker(config)
    before = _rss_now()
    args = model_args(cfg.model, vocab_size=VOCAB)
    strategy = build_strategy(cfg, env, args)
    samples: list[dict[str, int]] = []

    def sample(*_):
        samples.append({**count_states(strategy.module, _torch_optimizer(strategy)), "rss": _rss_now() - before})

    _torch_optimizer(strategy).register_step_pre_hook(sample)
    gen = torch.Generator().manual_seed(env.rank)
    t = cfg.train
    for _ in range(steps):
        for _ in range(t.grad_accum_steps):
            x = torch.randint(0, VOCAB, (t.micro_batch_size, cfg.data.seq_len + 1), generator=gen)
            with strategy.micro_context(True):
                with strategy.forward_context():
                    logits = strategy.module(x[:, :-1])  # (B, T, vocab)
                strategy.backward(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()))
            sample()  # after each backward: gradients accumulated so far (ZeRO-1 keeps them whole)
        strategy.step(1)
    top = max(samples, key=lambda r: sum(r[c] for c in CATEGORIES))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = {**top, "rss_at_step": max(r["rss"] for r in samples), "rss_peak": peak - before,
              "psi": args.num_params()}
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(report))
    strategy.close()
    _exit(0)


def run_strategy(name: str, parallel: dict, root: Path, a: argparse.Namespace) -> list[dict]:
    """Launch one strategy under torchrun; returns each rank's report."""
    import yaml

    from llmpipe.train.launch import run_streaming
    from tests.conftest import make_cfg

    folder = root / name
    folder.mkdir(parents=True)
    buckets = {"reduce_bucket_size": a.bucket, "allgather_bucket_size": a.bucket} if a.bucket and "zero_stage" in \
        parallel else {}
    cfg = make_cfg(folder, data={"seq_len": a.seq},
                   model={"flavor": "debug", "dim": a.dim, "n_layers": a.layers, "n_heads": a.dim // 64,
                          "n_kv_heads": a.dim // 64, "ffn_dim": 3 * a.dim},
                   train={"nproc_per_node": a.nproc, "micro_batch_size": 1, "grad_accum_steps": 2,
                          "parallel": {**parallel, **buckets}})
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={a.nproc}", __file__, "--worker", str(folder / "config.yaml"), str(folder),
            str(a.steps)]
    lines: list[str] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code, _ = run_streaming(argv, lines.append, env=env)
    if code != 0:
        sys.exit(f"{name} failed:\n" + "\n".join(lines[-40:]))
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(a.nproc)]


def _row(r: dict, n: int, expect: float) -> list[float]:
    """One table row: MiB per category and in all, then bytes per parameter beside each total."""
    mb = 1 << 20
    states = sum(r[c] for c in CATEGORIES)
    return [*(r[c] / mb for c in CATEGORIES), states / mb, states / n, expect,
            r["rss_at_step"] / mb, r["rss_at_step"] / n, r["rss_peak"] / mb, r["rss_peak"] / n]


def print_table(rows: dict[str, list[dict]], world: int) -> None:
    """For each strategy, the rank with the most model states; B/p = bytes per parameter."""
    n = next(iter(rows.values()))[0]["psi"]
    print(f"\nmodel: {n / 1e6:.1f}M parameters ({4 * n / 2**20:.0f} MiB fp32), {world} ranks, MiB per rank\n")
    cols = [*CATEGORIES, "states", "B/p", "expect", "rss@step", "B/p", "rss peak", "B/p"]
    print(f"{'strategy':<10}" + "".join(f"{c:>9}" for c in cols))
    for name, ranks in rows.items():
        r = max(ranks, key=lambda r: sum(r[c] for c in CATEGORIES))
        expect = EXPECTED[name](world) if name in EXPECTED else float("nan")
        print(f"{name:<10}" + "".join(f"{v:>9.1f}" for v in _row(r, n, expect)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--bucket", type=int, default=None, help="ZeRO reduce/allgather bucket size (elements); "
                   "default: llmpipe's config default")
    p.add_argument("--only", default=",".join(STRATEGIES), help="comma-separated strategy names")
    p.add_argument("--worker", nargs=3, metavar=("CONFIG", "OUT", "STEPS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], int(a.worker[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = {n: run_strategy(n, STRATEGIES[n], Path(tmp), a) for n in a.only.split(",")}
    print_table(rows, a.nproc)


if __name__ == "__main__":
    main()
