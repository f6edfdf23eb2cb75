"""Model parallel at world size > 1: tp=2 parity on 2 gloo ranks (torchrun), and the 64-rank dry run
of the seed's LLaMA-7B recipe on the fake backend.

Run as a script (under torchrun) this file is the tp worker: each rank builds the same debug model,
applies the TP plan on a 2-rank mesh and compares logits and gradients with the unsharded model.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from llmpipe import cli
from llmpipe import config as config_mod
from llmpipe.models.llama.flavors import FLAVORS
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _tp_worker(sequence_parallel: bool) -> None:
    """Forward + backward of the TP-sharded debug model against the unsharded one, on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from llmpipe.models.llama.model import Transformer
    from llmpipe.models.llama.parallelize import apply_tp

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ref = Transformer(FLAVORS["debug"])
    ref.init_weights(seed=3)
    model = apply_tp(copy.deepcopy(ref), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel)
    tokens = torch.randint(0, ref.args.vocab_size, (2, 32))  # same on both ranks (same seed)
    ref_logits, logits = ref(tokens), model(tokens)
    # NOTE: the row-wise matmuls sum two partial products in another order: ~1e-6 relative.
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    ref_logits.square().mean().backward()
    logits.square().mean().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    sharded = sum(isinstance(p, DTensor) and p.to_local().shape != p.shape for p in model.parameters())
    assert sharded == 2 * 7 + 2, sharded  # 7 Linears per block, embedding and head
    print(f"rank {dist.get_rank()}: tp=2 sequence_parallel={sequence_parallel} parity ok", flush=True)
    dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_matches_unsharded_forward_and_backward(sequence_parallel):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TP_SP": str(int(sequence_parallel))}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            __file__]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("parity ok") == 2, proc.stdout


def _pp_worker() -> None:
    """Each schedule at pp=2 (interleaved: 2 virtual stages per rank) against one process: loss and grads."""
    from dataclasses import replace

    import torch.distributed as dist
    import torch.nn.functional as F

    from llmpipe.models.llama.model import Transformer
    from llmpipe.parallel import pipeline

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = Transformer(replace(FLAVORS["debug"], n_layers=4))
    base.init_weights(seed=3)
    torch.manual_seed(0)
    tokens = torch.randint(0, base.args.vocab_size, (4, 16))
    targets = torch.randint(0, base.args.vocab_size, (4, 16))

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    ref = copy.deepcopy(base)
    ref_loss = loss_fn(ref(tokens), targets)  # equal micro-batches: mean of their losses = this loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]:
        n_stages = 2 * v
        splits = pipeline.split_layers(4, n_stages)
        ids = pipeline.stage_ids(rank, 2, v)
        modules = [pipeline.build_stage_module(copy.deepcopy(base), s, n_stages, splits[s]) for s in ids]
        sched = pipeline.make_schedule(name, pipeline.make_stages(modules, ids, n_stages, torch.device("cpu")),
                                       4, loss_fn)
        losses: list[torch.Tensor] = []
        if rank == 0:  # holds stage 0 (the input); rank 1 holds the last stage (the targets)
            sched.step(tokens)
        else:
            sched.step(target=targets, losses=losses)
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for m in modules:  # the schedule scales grads by 1/microbatches (scale_grads=True)
            for n, p in m.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{name} {n}")
        print(f"rank {rank}: pp=2 {name} parity ok", flush=True)
    dist.destroy_process_group()


def test_pp2_each_schedule_matches_one_process():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "LLMPIPE_WORKER": "pp"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("parity ok") == 6, proc.stdout


def _rows(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        f = line.split()
        if len(f) == 9 and f[0].isdigit():
            rows.append({"rank": int(f[0]), "pp": int(f[1]), "dp": int(f[2]), "tp": int(f[3]),
                         "params": int(f[6].replace(",", "")), "replicated": int(f[7].replace(",", ""))})
    return rows


def test_dry_run_of_the_7b_recipe_at_64_ranks(capsys):
    code = cli.main(["dryrun", str(ROOT / "configs" / "llama7b_64dev.yaml"), "--world-size", "64"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = _rows(out)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3, 32, 33, 34, 35], out  # dp replica 0: pp x tp ranks
    total = FLAVORS["llama-7b"].num_params()
    assert total == 6_738_415_616
    # Sharded weights split exactly over the 8 ranks; the norms (replicated) appear on all 4 tp ranks.
    assert sum(r["params"] for r in rows) - sum(r["replicated"] for r in rows) * 3 // 4 == total
    assert "every dp replica holds the same shards as replica 0: True" in out
    assert "= 256 sequences" in out and "bubble (p-1)/(v*m+p-1) = 0.200" in out


def test_dry_run_bad_world_size_is_one_clear_error(capsys):
    code = cli.main(["dryrun", str(ROOT / "configs" / "llama7b_64dev.yaml"), "--world-size", "32"])
    assert code == 2
    assert capsys.readouterr().err.strip().endswith("dp=8 x tp=4 x pp=2 = 64, but world size is 32")


@pytest.mark.parametrize("sets", [["train.parallel.data=zero", "train.parallel.zero_stage=3"],
                                  ["train.parallel.data=fsdp", "train.precision.dtype=fp16"]],
                         ids=["zero3", "fsdp-fp16"])
def test_a_dry_run_at_tp_pp_1_refuses_nothing_training_does(capsys, sets):
    """What only tp or pp > 1 refuses (ZeRO, fp16 loss scaling) is not refused by the dry run of a plain
    data-parallel layout, which trains."""
    argv = ["dryrun", str(ROOT / "configs" / "tiny.yaml"), "--world-size", "2"]
    code = cli.main([*argv, *[x for s in sets for x in ("--set", s)]])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "x dp 2 = 32 sequences" in captured.out


def test_recipe_config_loads():
    cfg = config_mod.load(ROOT / "configs" / "llama7b_64dev.yaml")
    t = cfg.train
    assert (t.parallel.dp, t.parallel.tp, t.parallel.pp) == (8, 4, 2)
    assert (t.micro_batch_size, t.grad_accum_steps, t.optim.lr, t.schedule.warmup_steps) == (4, 8, 3e-4, 2000)


if __name__ == "__main__":
    if os.environ.get("LLMPIPE_WORKER") == "pp":
        _pp_worker()
    else:
        _tp_worker(bool(int(os.environ.get("TP_SP", "0"))))
