"""Serve the deployments declared in prefect.yaml from this process (no work pool needed).

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve [--only on-demand]

Each flow run executes in a subprocess of this one; cancelling it kills that process and, with
it, its training ranks. prefect.yaml stays the one place the deployments are defined.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from prefect import serve  # (flows/__init__.py has set the Prefect defaults)
from prefect.schedules import Cron

from flows.serve_latest import serve_latest
from flows.train_to_deploy import train_to_deploy

ROOT = Path(__file__).resolve().parents[1]
FLOWS = {"flows/train_to_deploy.py:train_to_deploy": train_to_deploy,  # prefect.yaml's entrypoints
         "flows/serve_latest.py:serve_latest": serve_latest}


def deployments(spec_path: Path = ROOT / "prefect.yaml", only: list[str] | None = None) -> list:
    """RunnerDeployments for each entry of prefect.yaml (its name, parameters and cron schedules)."""
    spec = yaml.safe_load(spec_path.read_text())
    out = []
    for d in spec["deployments"]:
        if only and d["name"] not in only:
            continue
        schedules = [Cron(s["cron"], timezone=s.get("timezone", "UTC")) for s in d.get("schedules") or []]
        flow_fn = FLOWS[d["entrypoint"]]
        out.append(flow_fn.to_deployment(name=d["name"], description=d.get("description"),
                                                 parameters=d.get("parameters", {}), schedules=schedules))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", help="serve just this deployment (repeatable)")
    args = p.parse_args()
    serve(*deployments(only=args.only))


if __name__ == "__main__":
    main()
