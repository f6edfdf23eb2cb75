"""A DDP checkpoint save in the format DDP writes now (DCP: replicated tensors written once, the writes spread
over the ranks) against the one it wrote before (format "full": rank 0 writes the whole state, the other
ranks wait), on 2 gloo ranks with the same model, optimizer state and llmpipe.checkpoint.io.Saver
(per-rank hashing, meta.json, the rename), alternating, in one run.

    python benchmarks/ddp_checkpoint.py [--flavor small] [--repeats 3] [--dir /tmp/ddp-ckpt-bench]

It relaunches itself under torchrun (2 processes). Per format and repeat: one save (the stall the step
loop would see: save() returns when the checkpoint is published), then the bytes each rank wrote and a
resume of it by DDP's reader. Medians and spread; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout without installing llmpipe


def _bench(args) -> None:
    import torch
    import torch.distributed as dist

    from llmpipe.checkpoint import io as ckpt
    from llmpipe.checkpoint import state
    from llmpipe.device import Env
    from llmpipe.models.llama import FLAVORS
    from llmpipe.parallel.ddp import DDPStrategy
    from tests.conftest import make_cfg

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    root = Path(args.dir)
    cfg = make_cfg(root / "cfg", model={"flavor": args.flavor}, train__micro_batch_size=1)
    margs = FLAVORS[args.flavor]
    strategy = DDPStrategy(cfg, Env(rank, world, torch.device("cpu"), "fp32"), margs)
    x = torch.randint(0, margs.vocab_size, (1, 16))
    with strategy.forward_context():  # one optimizer step: AdamW's moments exist, as in any checkpoint
        strategy.module(x).float().mean().backward()
    for opt in strategy.opts:
        opt.step()
    counters = state.counters(1, 1)
    times: dict[str, list[float]] = {"full": [], "dcp": []}
    written: dict[str, list[int]] = {}
    for i in range(args.repeats):
        for fmt in ("full", "dcp") if i % 2 == 0 else ("dcp", "full"):
            ts = strategy.train_state()
            if fmt == "full":
                ts.state_format = "full"
            saver = ckpt.Saver(root / fmt, rank, world)
            dist.barrier()
            t0 = time.perf_counter()
            saver.save(i + 1, lambda f, ts=ts: state.write(f, ts, counters, rank), state.meta(ts, world, margs, 1,
                                                                                               "DDPStrategy"))
            dist.barrier()  # published by rank 0 (the other ranks return once their files are hashed)
            times[fmt].append(time.perf_counter() - t0)
            folder = ckpt.step_dir(root / fmt, i + 1)
            files = ckpt.read_meta(folder)["bytes"]
            mine = [p for p in files if fmt == "full" and rank == 0 or f"__{rank}_" in p]
            gathered: list = [None] * world
            dist.all_gather_object(gathered, sum(files[p] for p in mine))
            written[fmt] = gathered
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder)
    if rank == 0:
        print(f"{args.flavor} ({sum(p.numel() for p in strategy.parts[0].parameters()) / 1e6:.0f}M parameters, "
              f"AdamW state), 2 gloo ranks, {args.repeats} saves each, alternating")
        for fmt, ts in times.items():
            per_rank = ", ".join(f"rank {r}: {b / 2**20:.0f} MiB" for r, b in enumerate(written[fmt]))
            print(f"  {fmt:>4}: save {statistics.median(ts):.2f} s median (min {min(ts):.2f}, max {max(ts):.2f}); "
                  f"written {per_rank}")
        print(f"dcp / full save time: {statistics.median(times['dcp']) / statistics.median(times['full']):.2f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/ddp-ckpt-bench")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        _bench(args)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", "29533", __file__, "--inner", "--flavor", args.flavor, "--repeats", str(args.repeats),
            "--dir", args.dir]
    sys.exit(subprocess.call(argv, env=env))


if __name__ == "__main__":
    main()
