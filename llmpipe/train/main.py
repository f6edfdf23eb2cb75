"""The torchrun entry point: `torchrun ... -m llmpipe.train.main --config C --data D --out O`.

Each rank initialises the process group with the backend device.py picks, trains, then tears
down in an order that avoids the torch 2.13 + gloo abort at interpreter exit. A rank that raises
writes torchelastic's error file (torchrun sets TORCHELASTIC_ERROR_FILE under its --log-dir): the
JSON of `@record`, {"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}, plus
extraInfo "rank", "type" and "time" (seconds, sub-second, to order ranks failing within a second);
the train stage reads these files instead of the ranks' output.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import gc
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from llmpipe import config as config_mod
from llmpipe import device as dev
from llmpipe.errors import UserError


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
    timeout = datetime.timedelta(seconds=cfg.train.dist_timeout_s)
    store = _attempt_store(timeout)
    extra = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                      "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(backend=dev.dist_backend(device), timeout=timeout, **extra)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The ranks' store: torchrun's agent's under a prefix per in-place restart, or rank 0's on a
    loopback MASTER_ADDR (one node); None: let init_process_group connect (env://).

    NOTE: torchrun (2.4+) shares its rendezvous TCPStore with the ranks and keeps it across restarts
    (train.restarts), but the ranks use it without a per-attempt prefix, so a restarted group can read
    the previous attempt's gloo addresses and fail ("connectFullMesh failed ... Connection refused").
    On one node the agent shares none (llmpipe.train.launch.torchrun_env) and each attempt gets a new port.
    """
    addr, port, world = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"llmpipe/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if not ip.is_loopback:
        return None
    if int(os.environ["RANK"]) != 0:
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    # NOTE: a TCPStore server listens on every interface whatever host it is given (torch 2.13); handed
    # a socket already bound to loopback, it listens there only (see llmpipe.train.launch).
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    listener = socket.create_server((addr, port), family=family, backlog=max(128, world))
    return dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, multi_tenant=True,
                         master_listen_fd=listener.detach())  # the store owns the socket from here


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


TRACEBACK = "traceback.txt"  # beside the error file
RANK_FILE = "rank.json"  # {"rank": global rank} at start; "exit": its code once it leaves on its own
SIGTERM_FILE = "sigterm.txt"  # empty, or where the rank was when a SIGTERM ended it


def _rank_dir() -> Path | None:
    """torchrun's folder for this rank's files (that of TORCHELASTIC_ERROR_FILE); None outside torchrun."""
    file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return Path(file).parent if file else None


def _mark(exit_code: int | None = None) -> None:
    """Write rank.json; at start, also arm sigterm.txt.

    NOTE: a rank that dies from a signal writes no error file. To tell a rank killed from outside
    (SIGKILL, the OOM killer: nothing written) from one torchrun stopped with SIGTERM after a peer
    failed, faulthandler's C-level SIGTERM handler dumps the stack into sigterm.txt at once, even
    inside a blocking collective, then chains to the default action: the rank still dies from SIGTERM.
    """
    folder = _rank_dir()
    if folder is None:
        return
    info = {"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid()}
    if exit_code is None:
        global _SIGTERM_OUT
        _SIGTERM_OUT = open(folder / SIGTERM_FILE, "w")  # noqa: SIM115 (open until the process ends)
        faulthandler.register(signal.SIGTERM, file=_SIGTERM_OUT, all_threads=False, chain=True)
    else:
        info["exit"] = exit_code
    (folder / RANK_FILE).write_text(json.dumps(info))


_SIGTERM_OUT = None


def _user_error(err: BaseException) -> bool:
    """A mistake the user can fix (config, data, a diverged run: a llmpipe.errors.UserError): one
    line, no traceback. Anything else, a ValueError from torch included, is a bug: a traceback."""
    return isinstance(err, UserError)


class _ErrorFile(ErrorHandler):
    """@record's error file with the rank, the exception's type and a sub-second time added."""

    def record_exception(self, e: BaseException) -> None:
        file = self._get_error_file_path()
        if not file:
            return
        now, stack = time.time(), traceback.format_exc()
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": stack, "timestamp": str(int(now)), "time": now,
                                          "rank": int(os.environ.get("RANK", "0")), "type": type(e).__name__,
                                          "error": str(e), "user_error": _user_error(e)}}}
        self._write_error_file(file, json.dumps(data))
        self._write_error_file(os.path.join(os.path.dirname(file), TRACEBACK), stack)  # readable as is


@functools.partial(record, error_handler=_ErrorFile())
def _train(args: argparse.Namespace) -> None:
    """The rank's work; @record writes the error file of an exception, which then goes on to main."""
    cfg = config_mod.load(args.config)
    _init_distributed(cfg)
    from llmpipe.train.loop import train

    train(cfg, args.data, args.out)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(message)s", stream=sys.stdout)
    code = 0
    _mark()
    try:
        _train(args)
    except Exception as err:  # report once per rank, then exit non-zero (after _train's error file)
        code = 1
        if _user_error(err):
            print(f"[rank{rank}] error: {err}", file=sys.stderr)
        else:
            traceback.print_exc()
    _mark(code)
    _exit(code)


if __name__ == "__main__":
    main()
