"""What llmpipe.tracking reads from a run folder: its MLflow state file, its lineage, flattened keys."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from llmpipe.config import RunConfig
from llmpipe.manifest import Manifest, write_json_atomic
from llmpipe.tracking.client import TrackingError, resolve_uri

STATE_FILE = "mlflow.json"  # in the run folder: the MLflow run (and attempts, versions) per tracking URI
PARAM_MAX = 6000  # MLflow's longest param value
TAG_MAX = 5000
_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")


def load_state(run_dir: Path) -> dict[str, Any]:
    """The run folder's mlflow.json ({"stores": {}} when there is none), read bounded and checked for the shape
    llmpipe writes; TrackingError "mlflow.json: invalid: why" otherwise (the folder is untrusted input: a
    malformed file is never a traceback, nor silently replaced)."""
    from llmpipe.manifest import read_json_file

    path = Path(run_dir) / STATE_FILE
    if not path.exists() and not path.is_symlink():
        return {"stores": {}}
    state = read_json_file(path, TrackingError)
    problem = _state_problem(state)
    if problem:
        raise TrackingError(f"{path}: invalid: {problem} (remove the file to start a new MLflow run)")
    return state


def _state_problem(state: dict[str, Any]) -> str | None:
    stores = state.get("stores")
    if not isinstance(stores, dict):
        return "stores: expected an object"
    for uri, store in stores.items():
        if not isinstance(store, dict):
            return f"stores.{uri}: expected an object"
        for field in ("run_id", "experiment_id"):
            if field in store and not isinstance(store[field], str):
                return f"stores.{uri}.{field}: expected a string"
        if not isinstance(store.get("attempts", {}), dict) or not all(
                isinstance(v, str) for v in store.get("attempts", {}).values()):
            return f"stores.{uri}.attempts: expected an object of run ids"
        versions = store.get("versions", {})
        if not isinstance(versions, dict) or not all(isinstance(v, dict) for v in versions.values()):
            return f"stores.{uri}.versions: expected an object of {{name, version}} entries"
    return None


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    write_json_atomic(Path(run_dir) / STATE_FILE, state)


def store_state(cfg: RunConfig) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(tracking URI, the whole state, this URI's part of it)."""
    uri = resolve_uri(cfg.tracking.mlflow.tracking_uri, cfg.run.artifacts_dir)
    state = load_state(cfg.run_dir())
    return uri, state, state["stores"].setdefault(uri, {})


def key(text: str) -> str:
    return _KEY_BAD.sub("_", text)[:250]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf} of a nested dict; lists stay leaves."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def clip(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def manifests(cfg: RunConfig) -> dict[str, Manifest]:
    from llmpipe.stages import SPECS, stage_dir

    run_dir = cfg.run_dir()
    return {n: m for n in SPECS if (m := Manifest.read(stage_dir(run_dir, n))) is not None}


def lineage(cfg: RunConfig) -> dict[str, str]:
    """What made the run's model: fingerprints, the data digest, the code's commit, the toolchain."""
    out: dict[str, str] = {}
    found = manifests(cfg)
    for name, m in found.items():
        out[f"fingerprint.{name}"] = m.fingerprint
    if "prepare_data" in found:
        out["data.digest"] = found["prepare_data"].content_digest()
    commit = _git_commit()
    if commit:
        out["mlflow.source.git.commit"] = commit
    if found:
        latest = max(found.values(), key=lambda m: m.finished_at)
        out.update({f"version.{k}": str(v) for k, v in latest.versions.items()})
    from llmpipe.export.atc import fingerprint_extra  # ATC where this sync runs: its real path names CANN

    out["toolchain.atc"] = fingerprint_extra(cfg)["atc"] or "not found"
    for m in found.values():  # any other toolchain version a stage recorded in its metrics
        for k, v in flatten(m.metrics).items():
            if "version" in k.lower() and isinstance(v, (str, int, float)):
                out[f"version.{m.stage}.{k}"] = str(v)
    return {key(k): clip(v, TAG_MAX) for k, v in out.items()}


def run_link(cfg: RunConfig) -> tuple[str, str] | None:
    """(tracking URI, run id) recorded for the run, if it has one."""
    uri, _, store = store_state(cfg)
    return (uri, store["run_id"]) if store.get("run_id") else None


