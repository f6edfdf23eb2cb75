"""The flow: prepare_data -> train -> consolidate -> export_onnx -> convert_om -> benchmark -> evaluate.

It only sequences. Each task skips itself when its manifest is up to date, so a rerun after a
failure re-executes the failed stage and what follows, nothing else.

    --only a,b        run just these stages (each still skipped when up to date, unless force)
    --from-stage S    re-run S and every later stage (forced); earlier stages must be done
    --force           re-run every selected stage even when up to date
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact

import flows  # noqa: F401  (sets Prefect defaults before prefect is imported)
from llmpipe import config as config_mod
from llmpipe import console, stages, tracking
from llmpipe.lock import run_lock
from llmpipe.preflight import check_before_run
from llmpipe.tools import report
from tasks.stages import TASKS

log = logging.getLogger("llmpipe.flow")


@flow(name="train-to-deploy", log_prints=True, retries=0)
def train_to_deploy(config: str, overrides: list[str] | None = None, run_name: str | None = None,
                    from_stage: str | None = None, only: list[str] | None = None,
                    force: bool = False) -> dict[str, Any]:
    """Run the pipeline for `config` (+ `overrides`, `key=value`); returns each stage's result."""
    overrides = list(overrides or []) + ([f"run.name={run_name}"] if run_name else [])
    cfg = config_mod.load(config, overrides)  # fail fast, before any stage, on a bad config
    selected = stages.select(from_stage, only)
    check_before_run(cfg, selected, force or from_stage is not None, source=config)  # launch world size
    logger = get_run_logger()
    console.show(log, "run %s -> %s: stages %s", cfg.run.name, cfg.run_dir(), ", ".join(selected))
    results: dict[str, Any] = {}
    completed = False
    try:
        with run_lock(cfg.run_dir()) as taken:  # one writer per run folder; stale locks are recognised
            if taken:  # no other attempt is writing: what interrupted ones left can go
                stages.remove_stale_partials(cfg.run_dir())
            with console.log_to(console.logs_dir(cfg.run_dir()) / "run.log"):  # with Prefect's task-run lines
                for name in selected:
                    task = TASKS[name].with_options(retries=cfg.run.retries,
                                                    retry_delay_seconds=cfg.run.retry_delay_s)
                    results[name] = task(config, overrides, force=force or from_stage is not None)
        completed = True
    finally:
        path = report.write(cfg)
        if path.is_file():
            create_markdown_artifact(report.markdown(cfg), key=_artifact_key(cfg.run.name),
                                     description=f"llmpipe run report: {path}")
            logger.info("report: %s", path)
        _link_tracking(cfg, completed)
    return results


def _link_tracking(cfg, completed: bool) -> None:
    """The MLflow run marked FINISHED or FAILED (with the report uploaded), and linked from the flow run."""
    if not tracking.enabled(cfg):
        return
    tracking.finish(cfg, completed)
    found = tracking.link(cfg)
    if found is None:
        return
    url, text = found
    key = "mlflow-" + _artifact_key(cfg.run.name).removeprefix("report-")
    try:
        if url:
            create_link_artifact(url, link_text=f"MLflow run of {cfg.run.name}", key=key, description=text)
        else:
            create_markdown_artifact(text, key=key, description=f"MLflow run of {cfg.run.name}")
    except Exception as err:  # noqa: BLE001  in a finally: never hide the stage's own error
        get_run_logger().warning("tracking: the flow run's MLflow artifact was not created: %s", err)


def _artifact_key(run_name: str) -> str:
    return "report-" + "".join(c if c.isalnum() else "-" for c in run_name.lower())


if __name__ == "__main__":
    import sys

    train_to_deploy(sys.argv[1], sys.argv[2:])
