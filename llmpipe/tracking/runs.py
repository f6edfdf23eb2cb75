"""`llmpipe runs`: the runs of an experiment side by side, from MLflow (what `mlflow ui` shows, as text)."""

from __future__ import annotations

from typing import Any

from llmpipe.tracking.client import TrackingError, client, missing_store, quiet, short, within

COLUMNS = ("run", "status", "steps", "val_loss", "tokens/s", "gates", "model", "aliases")


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def rows(uri: str, experiment: str | None, timeout_s: float = 10.0, deadline_s: float = 60.0) -> list[dict[str, str]]:
    """One row per llmpipe run (nested train attempts left out), newest first; TrackingError when the store
    does not exist (never created by a command that reads) or does not answer in full within `deadline_s`."""
    problem = missing_store(uri)
    if problem:
        raise TrackingError(problem)
    with quiet():
        return within(deadline_s, uri, lambda _: _rows(uri, experiment, timeout_s))


def _rows(uri: str, experiment: str | None, timeout_s: float) -> list[dict[str, str]]:
    c = client(uri, timeout_s)
    try:
        if experiment is not None:
            found = c.get_experiment_by_name(experiment)
            if found is None:
                raise TrackingError(f"--experiment {experiment!r}: no such experiment in {uri}")
            ids = [found.experiment_id]
        else:
            ids = [e.experiment_id for e in c.search_experiments()]
        runs = c.search_runs(ids, filter_string="tags.`llmpipe.run_dir` != ''", max_results=1000,
                             order_by=["attributes.start_time DESC"]) if ids else []
    except TrackingError:
        raise
    except Exception as err:  # noqa: BLE001  MLflow's and connection errors: one line
        raise TrackingError(f"MLflow at {uri} failed: {short(err)}") from None
    out = []
    try:
        aliases = _aliases(c)
    except Exception as err:  # noqa: BLE001
        raise TrackingError(f"MLflow at {uri} failed: {short(err)}") from None
    for run in runs:
        tags, m = run.data.tags, run.data.metrics
        if "mlflow.parentRunId" in tags:
            continue
        steps = m.get("train.steps")
        version = tags.get("llmpipe.model_version")
        out.append({"run": tags.get("llmpipe.run", run.info.run_name), "status": run.info.status,
                    "steps": _fmt(int(steps) if steps is not None else None, "d"),
                    "val_loss": _fmt(m.get("val_loss", m.get("train.val_loss")), ".4f"),
                    "tokens/s": _fmt(m.get("train.tokens_per_s"), ",.0f"),
                    "gates": tags.get("llmpipe.gates", "-"), "model": version or "-",
                    "aliases": ",".join(sorted(aliases.get(version, []))) or "-"})
    return out


def _aliases(c: Any) -> dict[str, list[str]]:
    """"name/version" -> its aliases, over every registered model."""
    out: dict[str, list[str]] = {}
    for model in c.search_registered_models(max_results=1000):
        for alias, version in (model.aliases or {}).items():
            out.setdefault(f"{model.name}/{version}", []).append(alias)
    return out


def table(found: list[dict[str, str]]) -> str:
    if not found:
        return "no llmpipe runs logged here yet"
    widths = {c: max(len(c), *(len(r[c]) for r in found)) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in COLUMNS) for r in found]
    return "\n".join(line.rstrip() for line in lines)
