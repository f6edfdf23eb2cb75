"""The torchrun entry point: `torchrun ... -m llmpipe.train.main --config C --data D --out O`.

Each rank initialises the process group with the backend device.py picks, trains, then tears
down in an order that avoids the torch 2.13 + gloo abort at interpreter exit.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import sys
import traceback

import torch.distributed as dist

from llmpipe import config as config_mod
from llmpipe import device as dev


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llmpipe.train.main", description=__doc__)
    p.add_argument("--config", required=True, help="resolved run config (YAML)")
    p.add_argument("--data", required=True, help="prepare_data output folder")
    p.add_argument("--out", required=True, help="folder for checkpoints and metrics")
    return p.parse_args(argv)


def _init_distributed(cfg) -> None:
    if "RANK" not in os.environ:  # plain `python -m llmpipe.train.main`: one process, no group
        return
    device = dev.resolve(cfg.run.device)
    dev.set_current(device)
    dist.init_process_group(backend=dev.dist_backend(device),
                            timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s))


def _exit(code: int) -> None:
    """Flush, tear the process group down and leave without interpreter finalisation.

    NOTE: with torch 2.13 + gloo a rank can abort at interpreter exit ("terminate called without an
    active exception") after correct work; collecting the model first, destroying the group and
    leaving through os._exit avoids it.
    """
    gc.collect()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # already broken by a failed peer; we are exiting anyway
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(message)s", stream=sys.stdout)
    code = 0
    try:
        cfg = config_mod.load(args.config)
        _init_distributed(cfg)
        from llmpipe.train.loop import train

        train(cfg, args.data, args.out)
    except Exception as err:  # report once per rank, then exit non-zero
        code = 1
        from llmpipe.train.debug import ReplicaMismatch

        if isinstance(err, (ValueError, config_mod.ConfigError, FloatingPointError, ReplicaMismatch)):
            print(f"[rank{rank}] error: {err}", file=sys.stderr)
        else:
            traceback.print_exc()
    _exit(code)


if __name__ == "__main__":
    main()
