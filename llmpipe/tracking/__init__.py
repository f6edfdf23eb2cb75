"""Experiment tracking and the model registry, on MLflow (tracking.mlflow in the config).

One MLflow run per llmpipe run, kept across reruns, failed attempts, resumes, warm starts and topology
changes: its id is recorded in the run folder (mlflow.json, per tracking URI), and each sync logs what
the store does not hold yet, from the folder (llmpipe.tracking.sync says what goes where). Train
attempts are nested runs under it, one per train fingerprint: a resume or a layout change keeps the
fingerprint and so continues its attempt; a warm start opens the next, tagged with where it began.

Tracking never fails a stage: `after_stage` and `finish` turn any failure into one warning line, and
the next sync (after the next stage, or `llmpipe track RUN`) logs what this one could not. mlflow is
imported only when tracking is enabled.
"""

from __future__ import annotations

import logging
from typing import Any

from llmpipe.config import RunConfig
from llmpipe.tracking.client import TrackingError, quiet, resolve_uri, short, within

log = logging.getLogger("llmpipe.tracking")

__all__ = ["TrackingError", "after_stage", "backfill", "enabled", "finish"]


def enabled(cfg: RunConfig) -> bool:
    return cfg.tracking.mlflow.enabled


def _safe(cfg: RunConfig, status: str | None) -> str | None:
    from llmpipe.tracking import sync

    uri = resolve_uri(cfg.tracking.mlflow.tracking_uri, cfg.run.artifacts_dir)
    try:
        with quiet():
            return within(cfg.tracking.mlflow.deadline_s, uri, lambda cancelled: sync.sync(cfg, status, cancelled))
    except TrackingError as err:
        log.warning("tracking: %s (tracking.mlflow.deadline_s); the run goes on, and the next stage's sync (or "
                    "`llmpipe track %s`) logs what is missing", err, cfg.run.name)
        return None
    except Exception as err:  # noqa: BLE001  tracking never fails a stage; the next sync retries
        log.warning("tracking: MLflow at %s failed: %s; the run goes on, and the next stage's sync (or "
                    "`llmpipe track %s`) logs what is missing", uri, short(err), cfg.run.name)
        return None


def after_stage(cfg: RunConfig) -> None:
    """Log what the run folder holds that MLflow does not yet (a warning line, never an error)."""
    if enabled(cfg) and cfg.run_dir().is_dir():
        _safe(cfg, "RUNNING")


def finish(cfg: RunConfig, ok: bool) -> str | None:
    """The last sync of a pipeline invocation: the run is marked FINISHED or FAILED. Returns its run id."""
    if enabled(cfg) and cfg.run_dir().is_dir():
        return _safe(cfg, "FINISHED" if ok else "FAILED")
    return None


def backfill(cfg: RunConfig) -> dict[str, Any]:
    """`llmpipe track RUN`: log the run folder to MLflow now (TrackingError, one line, if it cannot)."""
    from llmpipe.tracking import folder, sync

    uri = resolve_uri(cfg.tracking.mlflow.tracking_uri, cfg.run.artifacts_dir)
    try:
        with quiet():
            run_id = within(cfg.tracking.mlflow.deadline_s, uri, lambda cancelled: sync.sync(cfg, None, cancelled))
    except TrackingError:
        raise
    except Exception as err:  # noqa: BLE001  MLflow's own and connection errors: one line
        raise TrackingError(f"tracking: MLflow at {uri} failed: {short(err)}") from None
    _, _, store = folder.store_state(cfg)
    return {"uri": uri, "run_id": run_id, "versions": store.get("versions", {})}


def link(cfg: RunConfig) -> tuple[str | None, str] | None:
    """(the MLflow UI's address of the run when the store is a server, a markdown line saying where the
    run is) for the Prefect flow run's artifact; None when the run has no MLflow run."""
    from llmpipe.tracking import folder

    try:
        found = folder.run_link(cfg)
    except TrackingError as err:  # an invalid mlflow.json: the syncs warn about it; the flow goes on
        log.warning("tracking: %s", err)
        return None
    if found is None:
        return None
    uri, run_id = found
    _, _, store = folder.store_state(cfg)
    experiment = store.get("experiment_id", "0")
    if uri.startswith(("http://", "https://")):
        url = f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
        return url, f"MLflow run of **{cfg.run.name}**: [{run_id}]({url})"
    return None, (f"MLflow run of **{cfg.run.name}**: `{run_id}` (experiment {experiment}) in `{uri}`; "
                  f"browse with `mlflow ui --backend-store-uri {uri}`")
