"""One thin Prefect task per stage: load the config, skip if done, run the stage, publish an artifact.

Tasks take and return small serializable values (the config path, overrides, folders and
fingerprints); tensors and models never cross a task boundary. Caching is llmpipe's own
(manifest fingerprints), not Prefect's, whose default cache key includes the run id.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from llmpipe import config as config_mod
from llmpipe import stages, tracking


def _run(name: str, config: str, overrides: list[str], force: bool) -> dict[str, Any]:
    cfg = config_mod.load(config, overrides)
    executor = None
    if name == "prepare_data":  # its work units run on the task runner data.engine names
        from tasks.units import executor as units_executor

        executor = units_executor(cfg.data)
    try:
        manifest, executed = stages.run_stage(name, cfg, force=force, executor=executor)
    finally:  # MLflow catches up with the run folder, whatever the stage did (a warning at worst)
        tracking.after_stage(cfg)
    folder = stages.stage_dir(cfg.run_dir(), name)
    if executed:
        lines = [f"**{name}**: {manifest.status} in {manifest.duration_s:.1f}s, fingerprint "
                 f"`{manifest.fingerprint[:12]}`", f"folder: `{folder}`"]
        if manifest.reason:
            lines.append(f"reason: {manifest.reason}")
        create_markdown_artifact("\n\n".join(lines), key=_key(cfg.run.name, name),
                                 description=f"{name} result")
    return {"stage": name, "status": manifest.status, "executed": executed, "folder": str(folder),
            "fingerprint": manifest.fingerprint, "metrics": manifest.metrics}


def _key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def _retry_if_transient(task, task_run, state) -> bool:
    """Prefect retry condition: only failures llmpipe marks transient are retried."""
    try:
        state.result()
    except BaseException as exc:
        return stages.is_transient(exc)
    return False


def _task(fn_name: str):
    # The flow sets retries / retry_delay_seconds from run.retries via .with_options().
    return task(name=fn_name, cache_policy=NO_CACHE, retries=0, retry_condition_fn=_retry_if_transient)


@_task("prepare_data")
def prepare_data(config: str, overrides: list[str], force: bool = False) -> dict[str, Any]:
    return _run("prepare_data", config, overrides, force)


@_task("train_model")
def train_model(config: str, overrides: list[str], force: bool = False) -> dict[str, Any]:
    return _run("train", config, overrides, force)


@_task("consolidate_checkpoint")
def consolidate_checkpoint(config: str, overrides: list[str], force: bool = False) -> dict[str, Any]:
    return _run("consolidate", config, overrides, force)


@_task("export_onnx")
def export_onnx(config: str, overrides: list[str], force: bool = False) -> dict[str, Any]:
    return _run("export_onnx", config, overrides, force)


@_task("convert_om")
def convert_om(config: str, overrides: list[str], force: bool = False) -> dict[str, Any]:
    return _run("convert_om", config, overrides, force)


@_task("benchmark_model")
def benchmark_model(config: str, overrides: list[str], force: bool = False) -> dict[str, Any]:
    result = _run("benchmark", config, overrides, force)
    if result["executed"]:
        from llmpipe.bench.run import load_results, table_rows

        rows = table_rows(load_results(result["folder"]))
        create_table_artifact(rows, key="benchmark", description="FP32 / FP16 / INT8 inference benchmark")
    return result


@_task("evaluate_model")
def evaluate_model(config: str, overrides: list[str], force: bool = False) -> dict[str, Any]:
    result = _run("evaluate", config, overrides, force)
    if result["executed"]:
        from llmpipe.eval.stage import TABLE_FILE

        folder = Path(result["folder"])
        create_markdown_artifact((folder / TABLE_FILE).read_text(encoding="utf-8"),
                                 key=_key("evaluation", folder.parent.name),
                                 description="lm-evaluation-harness: task x variant")
    return result


TASKS = {"prepare_data": prepare_data, "train": train_model, "consolidate": consolidate_checkpoint,
         "export_onnx": export_onnx, "convert_om": convert_om, "benchmark": benchmark_model,
         "evaluate": evaluate_model}
