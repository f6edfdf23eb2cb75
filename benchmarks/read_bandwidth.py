"""How fast this machine's cores can read memory: the ceiling of a batch-1 decode, which reads every weight
once per token.

    python benchmarks/read_bandwidth.py [--mb 98,220,1024] [--threads 1,2] [--model-mb 98]

Each thread sums its own contiguous part of one int64 buffer of --mb MiB (numpy's reduction, vectorised, the
GIL released), 11 repeats after a warm-up; the median rate and the spread are printed per buffer and thread
count. With --model-mb, the tokens/s a decode could reach if it did nothing but read that many MB per token
at the measured rate: no kernel, in any engine, decodes a model of that size faster on these cores.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np


def read_rate(buf: np.ndarray, threads: int, repeats: int = 11) -> tuple[float, float, float]:
    """(median, min, max) GB/s of `threads` threads each summing 1/threads of `buf`."""
    parts = np.array_split(buf, threads)

    def once() -> float:
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return buf.nbytes / (time.perf_counter() - t0) / 1e9

    once()
    rates = sorted(once() for _ in range(repeats))
    return float(np.median(rates)), rates[0], rates[-1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", default="98,220,1024", help="buffer sizes, MiB")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--model-mb", type=float, help="bytes a decode step reads (MB): print its tokens/s ceiling")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    out = []
    for mb in (int(x) for x in a.mb.split(",")):
        buf = np.ones(mb * 2**20 // 8, dtype=np.int64)
        for threads in (int(x) for x in a.threads.split(",")):
            med, lo, hi = read_rate(buf, threads)
            row = {"mib": mb, "threads": threads, "gb_s": med, "min": lo, "max": hi}
            line = f"{mb} MiB, {threads} thread(s): {med:.1f} GB/s ({lo:.1f}-{hi:.1f})"
            if a.model_mb:
                row["ceiling_tok_s"] = med * 1e3 / a.model_mb
                line += f"; a decode reading {a.model_mb:g} MB a token: at most {row['ceiling_tok_s']:.0f} tok/s"
            print(line, flush=True)
            out.append(row)
        del buf
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
