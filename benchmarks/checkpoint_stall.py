"""Checkpoint stall per save, synchronous vs asynchronous (DCP async_save), and per-rank vs rank-0
hashing, for a ~370M-parameter LLaMA on 2 FSDP2 gloo ranks (CPU), measured in one run.

    python benchmarks/checkpoint_stall.py [--steps 2] [--dir /tmp/ckpt-bench]

It relaunches itself under torchrun (2 processes). Per rank: a few optimizer steps (their mean is
the step time), one synchronous save through llmpipe.checkpoint.io.Saver, a step, one asynchronous
save, a step (overlapping the background write), then waits. The stall is what the step loop was
blocked by save() (for async: staging the state to CPU). Hashing: each rank hashes its own files
(what Saver does; the slowest rank counts) vs rank 0 hashing every file (what it did before).
Numbers are ratios from the same run; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout without installing llmpipe


def _bench(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from llmpipe.checkpoint import io as ckpt
    from llmpipe.checkpoint.dcp import save_state
    from llmpipe.models.llama.model import ModelArgs, Transformer
    from llmpipe.models.llama.parallelize import apply_fsdp, init_weights

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    margs = ModelArgs(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816, max_seq_len=256,
                      vocab_size=32000)
    with torch.device("meta"):
        model = Transformer(margs)
    apply_fsdp(model, init_device_mesh("cpu", (world,)), None, None, True)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = margs.num_params()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, margs.vocab_size, (1, args.seq + 1), generator=gen)

    def step() -> float:
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()  # warm-up, creates Adam's states
    step_s = sum(step() for _ in range(args.steps)) / args.steps
    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()

    def write(asynchronous, group=None):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        return lambda folder: save_state(state, folder, rank, asynchronous, group)

    sync = ckpt.Saver(root / "sync", rank, world)
    sync_stall = sync.save(1, write(False), {"format": "dcp"})
    step()
    asyn = ckpt.Saver(root / "async", rank, world, asynchronous=True)
    async_stall = asyn.save(1, write(True, asyn.group), {"format": "dcp"})
    overlapped = step()
    t0 = time.perf_counter()
    asyn.wait()
    tail = time.perf_counter() - t0

    folder = ckpt.step_dir(root / "sync", 1)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ckpt.META)
    mine = [p for p in files if p.name.startswith(f"__{rank}_") or (rank == 0 and not p.name.startswith("__"))]
    os.sync()
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.hash_files(folder, mine)
    own = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(own, op=dist.ReduceOp.MAX)  # the slowest rank
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        ckpt.hash_files(folder, files)
    all_on_0 = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        gb = sum(p.stat().st_size for p in files) / 1e9
        print(f"model {n_params / 1e6:.0f}M parameters (fp32, AdamW), 2 FSDP2 ranks, checkpoint {gb:.2f} GB; "
              f"step {step_s:.2f} s (seq {args.seq}, micro-batch 1)")
        print(f"stall per save  sync  {sync_stall:7.2f} s = {sync_stall / step_s:6.2f} x step time")
        print(f"stall per save  async {async_stall:7.2f} s = {async_stall / step_s:6.2f} x step time "
              f"(sync/async = {sync_stall / async_stall:.1f}x); the step overlapping the write took "
              f"{overlapped:.2f} s ({overlapped / step_s:.2f} x), then {tail:.2f} s waiting for it")
        print(f"hashing         per rank (slowest) {float(own):6.2f} s   rank 0 alone {all_on_0:6.2f} s   "
              f"ratio {all_on_0 / float(own):.2f}x (page cache warm: both read from memory)")
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2, help="timed steps for the step time")
    p.add_argument("--seq", type=int, default=128, help="tokens per sample")
    p.add_argument("--dir", default="/tmp/llmpipe-ckpt-bench", help="scratch folder (removed after)")
    args = p.parse_args()
    if "LOCAL_RANK" in os.environ:
        return _bench(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
