"""DDP bucket sweep on the demo model: `llmpipe tune buckets` on configs/tiny.yaml (2 ranks) for
bucket_cap_mb 1, 5, 10, 25, 50, 100, its table, then each value's tokens/s as a ratio of the configured
value's, measured in the same sweep.

    python benchmarks/bucket_sweep.py [--values 1,5,10,25,50,100] [--steps 10] [--repeats 2] [--set KEY=VALUE ...]

It trains under the run name `bench-buckets` (artifacts/bench-buckets/: its own prepare_data, reused by
later sweeps, and tune/buckets-<value>/), so the demo run's folder is left alone; `--set run.name=tiny`
sweeps in the demo run itself. Values the planner gives the same number of buckets train the same way:
their spread is printed as the noise of the machine, against which the other differences are read; with
--repeats (default 2) the values take turns, and each value's runs differ by the `runs apart` column.
"""

from __future__ import annotations

import argparse
import logging
import sys
from itertools import groupby
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout

from llmpipe import config as config_mod  # noqa: E402
from llmpipe.tools import tune  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--values", default="1,5,10,25,50,100")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    cfg = config_mod.load(a.config, ["run.name=bench-buckets", f"train.nproc_per_node={a.nproc}", *a.overrides])
    points = tune.bucket_sweep(cfg, tune.parse_values(a.values), a.steps, repeats=a.repeats)
    print(tune.format_table(cfg, points, a.steps, 100.0))

    configured = cfg.train.parallel.bucket_cap_mb
    base = next((q for q in points if q.bucket_cap_mb == configured), None)
    if base is not None:
        print(f"\ntokens/s relative to the configured bucket_cap_mb={configured:g}: " + ", ".join(
            f"{q.bucket_cap_mb:g}: {q.tokens_per_s / base.tokens_per_s:.2f}" for q in points))
    for buckets, same in groupby(sorted(points, key=lambda q: q.buckets), key=lambda q: q.buckets):
        same = list(same)
        if len(same) > 1:
            rates = [q.tokens_per_s for q in same]
            print(f"noise: {', '.join(f'{q.bucket_cap_mb:g}' for q in same)} all make {buckets} bucket(s), the same "
                  f"training; their tokens/s differ by {100 * (max(rates) / min(rates) - 1):.1f}%")


if __name__ == "__main__":
    main()
