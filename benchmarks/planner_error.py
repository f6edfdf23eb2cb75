"""Planned vs measured memory per rank: what `llmpipe plan` predicts against what 2 gloo ranks hold, for
DDP, ZeRO-1/2/3, FSDP2, tp=2 and pp=2 on the same small model (fp32).

    python benchmarks/planner_error.py [--dim 256 --layers 4 --seq 64] [--only ddp,tp2]

Each strategy trains `--steps` steps (micro-batch 2, accumulation 2, pipeline micro-batches of 1) under
torchrun with this file as the worker, through llmpipe's own builders (build_strategy, or
MeshStrategy for tp/pp). Measured, on each rank:

    states   model-state bytes counted as benchmarks/memory_per_rank.py counts them (distinct storages of
             params, grads, master, optimizer state; its `count_states`), the largest sample over the
             micro-steps and the optimizer's step pre-hook. Planned: params + grads + optimizer of
             llmpipe.tools.plan for the rank's pipeline stage.
    act      bytes of the distinct tensors autograd saves during one forward + loss (a
             torch.autograd.graph.saved_tensors_hooks pack hook; parameters, buffers and their shards
             excluded), on the first micro-step. Planned: the plan's activations without checkpointing
             (llmpipe.tools.plan's count of a LLaMA block's saved tensors plus fp32 logits). Not measured
             with a pipeline schedule: its saved tensors live and die across micro-batches, so a sum is not
             the peak.

Every micro-step syncs gradients (like memory_per_rank), so FSDP's unsharded accumulation gradients do not
appear; they are in the plan's `working` bytes, which this comparison leaves out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

# NOTE: lets `python benchmarks/planner_error.py` run from a checkout without installing llmpipe.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_per_rank import (  # noqa: E402
    CATEGORIES,
    STRATEGIES,
    _torch_optimizer,
    count_states,
    init_worker,
)

VOCAB = 512
CASES: dict[str, dict] = {**STRATEGIES, "tp2": {"data": "ddp", "tp": 2}, "pp2": {"data": "ddp", "pp": 2}}


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data: a wrapper subclass (DTensor, AsyncCollectiveTensor) unflattened."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, n) for n in names]
    return [x for i in inner if isinstance(i, torch.Tensor) for x in _plain(i)]


class SavedBytes:
    """Context: bytes of the distinct storages autograd saves for backward, minus those of `modules`'
    parameters (also ZeRO-3's gathered ones and partitions) and buffers."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules, self.seen, self.total = modules, set(), 0

    def _excluded(self) -> set[int]:
        from benchmarks.memory_per_rank import _local

        out = set()
        for m in self.modules:
            for t in [*m.parameters(), *m.buffers()]:
                out.add(_local(t).untyped_storage().data_ptr())  # a DTensor's shard, ZeRO-3's partition
                if not hasattr(t, "to_local"):  # ZeRO-3's gathered parameter
                    out.add(t.untyped_storage().data_ptr())
        return out

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            for inner in _plain(t):
                storage = inner.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.seen and ptr not in self._excluded():
                    self.seen.add(ptr)
                    self.total += storage.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _build(cfg, env):
    """(strategy, [(module, torch optimizer)], forward module or None for a pipeline)."""
    from llmpipe.models.llama import model_args
    from llmpipe.parallel import build_strategy

    vocab = cfg.data.tokenizer.vocab_size
    if cfg.train.parallel.tp > 1 or cfg.train.parallel.pp > 1:
        from llmpipe.parallel.model_parallel import MeshStrategy

        strategy = MeshStrategy(cfg, env, model_args(cfg.model, vocab_size=vocab))
        return strategy, list(zip(strategy.parts, strategy.opts)), (None if strategy.schedule else strategy.parts[0])
    strategy = build_strategy(cfg, env, model_args(cfg.model, vocab_size=vocab))
    return strategy, [(strategy.module, _torch_optimizer(strategy))], strategy.module


def _micro_step(strategy, forward, x, y, measure: bool) -> int | None:
    """One forward + backward; with `measure`, returns the bytes saved for backward by forward + loss."""
    import torch.nn.functional as F

    if forward is None:  # pipeline: the schedule runs forward and backward of its micro-batches
        strategy.forward_backward(x, y)
        return None
    with SavedBytes([forward]) if measure else contextlib.nullcontext() as saved:
        with strategy.forward_context():
            logits = forward(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    strategy.backward(loss)
    return saved.total if measure else None


def worker(config: str, out: str, steps: int) -> None:
    """torchrun worker: train `steps` steps on random tokens, write rank{N}.json."""
    from llmpipe.train.main import _exit

    cfg, env = init_worker(config)
    strategy, pairs, forward = _build(cfg, env)
    samples: list[int] = []

    def sample(*_):
        counts = [count_states(m, o) for m, o in pairs]
        samples.append(sum(c[k] for c in counts for k in CATEGORIES))

    for _, opt in pairs:
        opt.register_step_pre_hook(sample)
    gen = torch.Generator().manual_seed(env.rank)
    t, act = cfg.train, None
    for step in range(steps):
        for micro in range(t.grad_accum_steps):
            shape = (t.micro_batch_size, cfg.data.seq_len + 1)
            x = torch.randint(0, cfg.data.tokenizer.vocab_size, shape, generator=gen)
            with strategy.micro_context(True):
                saved = _micro_step(strategy, forward, x[:, :-1], x[:, 1:], step == 0 and micro == 0)
            act = saved if saved is not None else act
            sample()
        strategy.step(1)
    Path(out, f"rank{env.rank}.json").write_text(json.dumps({"states": max(samples), "act": act}))
    strategy.close()
    _exit(0)


def _config(name: str, folder: Path, a: argparse.Namespace):
    from tests.conftest import make_cfg

    parallel = {**CASES[name], **({"microbatches": 2} if CASES[name].get("pp", 1) > 1 else {})}
    return make_cfg(folder, data={"seq_len": a.seq, "tokenizer": {"vocab_size": VOCAB}},
                    model={"flavor": "debug", "dim": a.dim, "n_layers": a.layers, "n_heads": a.dim // 64,
                           "n_kv_heads": a.dim // 64, "ffn_dim": 3 * a.dim, "max_seq_len": max(512, a.seq)},
                    train={"nproc_per_node": a.nproc, "micro_batch_size": 2, "grad_accum_steps": 2,
                           "parallel": parallel})


def run_case(name: str, root: Path, a: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Launch one case under torchrun; returns (measured, planned) per rank."""
    import yaml

    from llmpipe.tools import plan
    from llmpipe.train.launch import run_streaming

    folder = root / name
    folder.mkdir(parents=True)
    cfg = _config(name, folder, a)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    setup = plan.setup_from_config(cfg, a.nproc)
    stages = plan.memory(setup)
    planned = [{"states": stages[r // (setup.dp * setup.tp)].model_states,
                "act": stages[r // (setup.dp * setup.tp)].activations_full} for r in range(a.nproc)]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={a.nproc}", __file__, "--worker", str(folder / "config.yaml"), str(folder),
            str(a.steps)]
    lines: list[str] = []
    code, _ = run_streaming(argv, lines.append, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if code != 0:
        sys.exit(f"{name} failed:\n" + "\n".join(lines[-40:]))
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(a.nproc)], planned


def _err(planned: float, measured: float | None) -> float | None:
    return None if not measured else 100 * (planned - measured) / measured


def print_table(results: dict[str, tuple[list[dict], list[dict]]]) -> None:
    """Per case, the rank with the most measured model states; error = (planned - measured) / measured."""
    mib = 1 << 20
    fmt = lambda v, spec: format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0].lstrip(">")))
    print(f"{'strategy':<9}{'rank':>5}{'planned':>10}{'measured':>10}{'error %':>9}   "
          f"{'act plan':>9}{'act meas':>9}{'error %':>9}   (MiB per rank)")
    worst = {"states": 0.0, "act": 0.0}
    for name, (measured, planned) in results.items():
        for m, p in zip(measured, planned):
            for k in worst:
                e = _err(p[k], m[k])
                worst[k] = max(worst[k], abs(e)) if e is not None else worst[k]
        r = max(range(len(measured)), key=lambda i: measured[i]["states"])
        m, p = measured[r], planned[r]
        print(f"{name:<9}{r:>5}{p['states'] / mib:>10.2f}{m['states'] / mib:>10.2f}"
              f"{fmt(_err(p['states'], m['states']), '>9.2f')}   {p['act'] / mib:>9.2f}"
              f"{fmt(m['act'] and m['act'] / mib, '>9.2f')}{fmt(_err(p['act'], m['act']), '>9.2f')}")
    print(f"\nmax |error| over every rank: model states {worst['states']:.2f}%, activations {worst['act']:.2f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--only", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--worker", nargs=3, metavar=("CONFIG", "OUT", "STEPS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], int(a.worker[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = {n: run_case(n, Path(tmp), a) for n in a.only.split(",")}
    print(f"\nmodel: dim {a.dim}, {a.layers} layers, vocab {VOCAB}, seq {a.seq}, micro-batch 2, fp32, "
          f"{a.nproc} gloo ranks\n")
    print_table(results)


if __name__ == "__main__":
    main()
