"""Reconcile a run's MLflow run with its folder: log what the store does not have yet.

Everything logged comes from the run folder (manifests, metrics.jsonl, attempt.json, failed/), so a sync
is idempotent: run after every stage, after a failure, after a kill, or later by `llmpipe track RUN`,
it adds what is missing and nothing twice. The folder is the record; MLflow is a view of it.

    parent run (one per llmpipe run, its id in <run>/mlflow.json)
      params   the resolved config, dotted (a later value of a param MLflow already holds, which it
               refuses to change, goes to the tag config.<key>)
      metrics  loss, lr, grad_norm, tokens_per_s, val_loss ... by global step: a step is logged only
               past the highest step the store has for that key, so a resumed training continues the
               curve, never repeats or reorders it; <stage>.duration_s and each stage's numeric results
               (benchmark.*, evaluate.*, by stage name), stepped by how many times the stage completed
      tags     stage.<name>.status / fingerprint / last_failure, data digest, git commit, versions
      artifacts report.html, and each stage folder's .md, .html and .png files
    nested runs, one per train attempt (the train stage's fingerprint): a resume or a topology change
      keeps the fingerprint, so it continues its attempt's run; a warm start (a changed result field)
      opens a new one, tagged with where it started. The parent's curve runs on through a warm start
      from the newest checkpoint; an attempt that restarts below the parent's last step shows its own
      steps there in its nested run (the parent's history is never rewritten).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from llmpipe import attempts
from llmpipe.config import RunConfig
from llmpipe.manifest import Manifest
from llmpipe.tracking.client import artifact_location, client
from llmpipe.tracking.folder import (
    PARAM_MAX,
    STATE_FILE,
    TAG_MAX,
    as_number,
    clip,
    flatten,
    key,
    lineage,
    load_state,
    save_state,
    store_state,
)
from llmpipe.train import metrics as metrics_mod

log = logging.getLogger("llmpipe.tracking")

BATCH = 900  # MLflow takes at most 1000 metrics per log_batch
_ARTIFACT_SUFFIXES = (".md", ".html", ".png")


def sync(cfg: RunConfig, status: str | None = None, cancelled: threading.Event | None = None) -> str:
    """Bring the run's MLflow run up to date with its folder; returns the MLflow run id. `status`:
    RUNNING, FINISHED or FAILED to set (None: leave it). `cancelled`: set when the caller gave up waiting
    (client.within); the folder's mlflow.json is then left as the next sync finds it."""
    from llmpipe.tracking import registry

    m = cfg.tracking.mlflow
    run_dir = cfg.run_dir()
    uri, state, store = store_state(cfg)
    c = client(uri, m.timeout_s, m.retries)
    try:
        run_id = _parent(c, cfg, uri, store)
        _params(c, run_id, cfg)
        _tags(c, run_id, cfg)
        _curves(c, run_id, cfg, store)
        _stages(c, run_id, cfg)
        _artifacts(c, run_id, run_dir)
        registry.sync(c, cfg, run_id, store)
        if status:
            current = c.get_run(run_id).info.status
            if status == "RUNNING" and current != "RUNNING":
                c.update_run(run_id, status="RUNNING")
            elif status != "RUNNING":
                c.set_terminated(run_id, status)
    finally:
        if run_dir.is_dir() and not (cancelled is not None and cancelled.is_set()):
            save_state(run_dir, state)
    return run_id


def _experiment(c: Any, cfg: RunConfig, uri: str) -> str:
    name = cfg.tracking.mlflow.experiment or cfg.run.name
    found = c.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            c.restore_experiment(found.experiment_id)
        return found.experiment_id
    return c.create_experiment(name, artifact_location=artifact_location(uri, cfg.run.artifacts_dir))


def _parent(c: Any, cfg: RunConfig, uri: str, store: dict[str, Any]) -> str:
    """The run's MLflow run: the one recorded for this store, or a new one (recorded at once)."""
    from mlflow.exceptions import MlflowException

    run_id = store.get("run_id")
    if run_id:
        try:
            run = c.get_run(run_id)
            tags = run.data.tags
            if tags.get("llmpipe.run") == cfg.run.name:  # (a moved folder keeps its run: the name, not the path)
                if run.info.lifecycle_stage == "deleted":
                    c.restore_run(run_id)
                return run_id
            # mlflow.json is the folder's word, not the store's: a run id of another run is never logged to
            log.warning("tracking: mlflow.json names MLflow run %s, which is not run %s's (it is %s's); starting "
                        "a new one", str(run_id)[:64], cfg.run.name, str(tags.get("llmpipe.run"))[:64])
        except MlflowException as err:
            if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            log.warning("tracking: MLflow run %s of %s is gone from %s; starting a new one", str(run_id)[:64],
                        cfg.run.name, uri)
    experiment_id = _experiment(c, cfg, uri)
    run = c.create_run(experiment_id, run_name=cfg.run.name,
                       tags={"llmpipe.run": cfg.run.name, "llmpipe.run_dir": str(cfg.run_dir())})
    store.clear()
    store.update(run_id=run.info.run_id, experiment_id=experiment_id)
    save_state(cfg.run_dir(), {**load_state(cfg.run_dir()), "stores": {**load_state(cfg.run_dir())["stores"],
                                                                         uri: store}})
    return run.info.run_id


def _params(c: Any, run_id: str, cfg: RunConfig) -> None:
    from mlflow.entities import Param, RunTag

    have = c.get_run(run_id).data.params
    new, changed = [], []
    for k, v in flatten(cfg.to_dict()).items():
        name, value = key(k), clip(v, PARAM_MAX)
        if name not in have:
            new.append(Param(name, value))
        elif have[name] != value:
            changed.append(RunTag(f"config.{name}", clip(value, TAG_MAX)))
    for i in range(0, len(new), 100):
        c.log_batch(run_id, params=new[i:i + 100])
    if changed:
        c.log_batch(run_id, tags=changed)


def _tags(c: Any, run_id: str, cfg: RunConfig) -> None:
    from mlflow.entities import RunTag

    have = c.get_run(run_id).data.tags
    tags = {**lineage(cfg), "llmpipe.run_dir": str(cfg.run_dir())}
    fresh = [RunTag(k, v) for k, v in tags.items() if have.get(k) != v]
    if fresh:
        c.log_batch(run_id, tags=fresh)


def train_attempts(run_dir: Path) -> list[tuple[str, Path]]:
    """(fingerprint, folder) of every train attempt with metrics, oldest first: those kept under
    superseded/, the published one, then one in progress."""
    from llmpipe.stages import partial_dir, stage_dir

    folders = [k.path for k in reversed(attempts.kept(run_dir, attempts.SUPERSEDED, "02_train"))]
    folders += [stage_dir(run_dir, "train"), partial_dir(run_dir, "train")]
    out = []
    for folder in folders:
        if not (folder / metrics_mod.METRICS).is_file():
            continue
        try:
            fp = json.loads((folder / "attempt.json").read_text())["fingerprint"]
        except (OSError, ValueError, KeyError, TypeError):
            fp = folder.name
        out.append((str(fp), folder))
    return out


class _Curve:
    """Metrics of one MLflow run by step, logged only past the highest step the store holds per key."""

    def __init__(self, c: Any, run_id: str):
        self.c, self.run_id, self.top = c, run_id, {}

    def high(self, k: str) -> int:
        if k not in self.top:
            history = self.c.get_metric_history(self.run_id, k)
            self.top[k] = max((h.step for h in history), default=-1)
        return self.top[k]

    def log(self, records: list[dict[str, Any]]) -> int:
        from mlflow.entities import Metric

        out = []
        now = int(time.time() * 1000)
        for rec in sorted(records, key=lambda r: r["step"]):
            for k, v in rec.items():
                value, name = as_number(v), key(k)
                if k in ("step", "time") or value is None or rec["step"] <= self.high(name):
                    continue
                out.append(Metric(name, value if math.isfinite(value) else float("nan"), now, rec["step"]))
                self.top[name] = rec["step"]  # a step repeated in the file is logged once
        for i in range(0, len(out), BATCH):  # on a failure the object is dropped: the next sync asks the store
            self.c.log_batch(self.run_id, metrics=out[i:i + BATCH])
        return len(out)


def _curves(c: Any, run_id: str, cfg: RunConfig, store: dict[str, Any]) -> None:
    run_dir = cfg.run_dir()
    parent = _Curve(c, run_id)
    children = store.setdefault("attempts", {})
    for fp, folder in train_attempts(run_dir):
        records = sorted(metrics_mod.read(folder / metrics_mod.METRICS), key=lambda r: r["step"])
        child = children.get(fp) or _child(c, run_id, cfg, fp, folder)
        children[fp] = child
        _attempt_tags(c, child, folder)
        _Curve(c, child).log(records)
        parent.log(records)


def _child(c: Any, parent_id: str, cfg: RunConfig, fp: str, folder: Path) -> str:
    experiment_id = c.get_run(parent_id).info.experiment_id
    run = c.create_run(experiment_id, run_name=f"train {fp[:12]}",
                       tags={"mlflow.parentRunId": parent_id, "llmpipe.run": cfg.run.name,
                             "llmpipe.attempt": fp, "llmpipe.stage": "train"})
    try:
        params = flatten(json.loads((folder / "attempt.json").read_text()).get("config", {}))
    except (OSError, ValueError, AttributeError):
        params = {}
    from mlflow.entities import Param

    items = [Param(key(k), clip(v, PARAM_MAX)) for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i:i + 100])
    return run.info.run_id


def _attempt_tags(c: Any, child: str, folder: Path) -> None:
    """Where the attempt's folder is now, its state and layout, and where a warm start began."""
    from mlflow.entities import RunTag

    tags = {"llmpipe.folder": str(folder),
            "llmpipe.state": ("in progress or interrupted" if folder.name.endswith(".partial")
                              else "superseded" if folder.parent.name == attempts.SUPERSEDED else "completed")}
    for name in ("warm_start.json", "summary.json"):
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if name == "warm_start.json":
            tags.update({"warm_start.step": str(data.get("step")), "warm_start.source": str(data.get("source")),
                         "warm_start.changed": clip(data.get("changed"), TAG_MAX)})
        else:
            tags.update({f"summary.{k}": clip(v, 250) for k, v in data.items() if not isinstance(v, dict)})
    have = c.get_run(child).data.tags
    fresh = [RunTag(key(k), v) for k, v in tags.items() if have.get(key(k)) != v]
    if fresh:
        c.log_batch(child, tags=fresh)
    if tags["llmpipe.state"] != "in progress or interrupted" and c.get_run(child).info.status == "RUNNING":
        c.set_terminated(child, "FINISHED")


def _stages(c: Any, run_id: str, cfg: RunConfig) -> None:
    """Each stage's status, fingerprint, duration and results (any stage, by name); a newly completed
    result is logged at step n, its n-th completion, so a rerun that changed nothing adds nothing."""
    from mlflow.entities import Metric, RunTag

    from llmpipe.stages import SPECS, stage_dir

    run_dir = cfg.run_dir()
    have = c.get_run(run_id).data.tags
    tags: dict[str, str] = {}
    metrics: list[Metric] = []
    now = int(time.time() * 1000)
    for name in SPECS:
        folder = stage_dir(run_dir, name)
        manifest = Manifest.read(folder)
        failure = attempts.last_failure(run_dir, folder.name)
        if failure is not None:
            tags[f"stage.{name}.last_failure"] = clip(f"{failure[0].when}: {failure[1]}", TAG_MAX)
        if manifest is None:
            if failure is not None:
                tags[f"stage.{name}.status"] = "failed"
            continue
        tags[f"stage.{name}.status"] = manifest.status
        tags[f"stage.{name}.fingerprint"] = manifest.fingerprint
        mark = f"llmpipe.logged.{name}"
        done, _, count = have.get(mark, "|0").rpartition("|")
        if done == manifest.finished_at:
            continue
        step = int(count) if count.isdigit() else 0
        values = {"duration_s": manifest.duration_s, **flatten(manifest.metrics)}
        for k, v in values.items():
            number = as_number(v)
            if number is not None:
                metrics.append(Metric(key(f"{name}.{k}"), number, now, step))
            elif v is not None:
                tags[f"{name}.{k}"] = clip(v, TAG_MAX)
        tags[mark] = f"{manifest.finished_at}|{step + 1}"
    for i in range(0, len(metrics), BATCH):
        c.log_batch(run_id, metrics=metrics[i:i + BATCH])
    fresh = [RunTag(key(k), v) for k, v in tags.items() if have.get(key(k)) != v]
    for i in range(0, len(fresh), 100):
        c.log_batch(run_id, tags=fresh[i:i + 100])


def _artifacts(c: Any, run_id: str, run_dir: Path) -> None:
    """report.html and each stage folder's tables, pages and plots, uploaded when new or changed."""
    from mlflow.entities import RunTag

    from llmpipe.stages import SPECS, stage_dir

    files = [(run_dir / "report.html", None)]
    for name in SPECS:
        folder = stage_dir(run_dir, name)
        if folder.is_dir() and not folder.is_symlink():
            files += [(p, folder.name) for p in sorted(folder.iterdir())
                      if p.suffix in _ARTIFACT_SUFFIXES and p.is_file() and not p.is_symlink()]
    have = c.get_run(run_id).data.tags
    marks = []
    for path, under in files:
        if not path.is_file() or path.is_symlink():  # a link may lead out of the run (report.html included)
            continue
        st = path.stat()
        mark, value = key(f"llmpipe.artifact.{under or '.'}/{path.name}"), f"{st.st_size}:{st.st_mtime_ns}"
        if have.get(mark) != value:
            c.log_artifact(run_id, str(path), under)
            marks.append(RunTag(mark, value))
    if marks:
        c.log_batch(run_id, tags=marks)


def is_present(run_dir: Path) -> bool:
    return os.path.isfile(Path(run_dir) / STATE_FILE)
