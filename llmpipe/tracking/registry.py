"""The model registry: consolidate's hf/ as a version of a registered model, promoted by its gates.

    consolidate completed   hf/ (with its tokenizer files) uploaded under the MLflow run and registered as
                            a new version of tracking.mlflow.model_name (default: the run name), tagged
                            with its lineage (run, run folder, fingerprints, data digest, commit); one
                            version per consolidated model (its content digest), never two
    export_onnx, convert_om, the benchmark's variants   uploaded beside it (deploy/<NN_stage>/), the version
                            tagged llmpipe.deploy.<stage> with where they are and their fingerprint
    benchmark (evaluate)    llmpipe.gates = passed | failed on the version; the first time it passes, the
                            version gets the alias `candidate`
    `llmpipe promote`       moves an alias (production) to a version whose gates passed; --force is
                            tagged on the version (llmpipe.forced.<alias>) and logged

`llmpipe serve` and `llmpipe generate` take models:/NAME@ALIAS or models:/NAME/VERSION: the version's
run folder (llmpipe.run_dir) is what they load, verified against its manifests as for a run name.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

from llmpipe import attempts
from llmpipe.config import RunConfig
from llmpipe.manifest import Manifest
from llmpipe.tracking.client import TrackingError, client, missing_store, quiet, short

log = logging.getLogger("llmpipe.tracking")

CANDIDATE = "candidate"
GATES = "llmpipe.gates"
VARIANT = "llmpipe.gates.variant."  # + fp32, int8 ...: passed | failed, for the model this version is
PASSED = "llmpipe.gates.passed_variants"  # the variants that passed, comma-separated
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[0-9]+))$")
_NAME_VERSION = re.compile(r"^(?P<name>[^/@]+)/(?P<version>[0-9]+)$")
DEPLOYED = ("export_onnx", "convert_om", "benchmark")  # whose outputs are attached to the version


def model_name(cfg: RunConfig) -> str:
    return cfg.tracking.mlflow.model_name or cfg.run.name


def _manifest(cfg: RunConfig, stage: str) -> Manifest | None:
    from llmpipe.stages import SPECS, stage_dir

    return Manifest.read(stage_dir(cfg.run_dir(), stage)) if stage in SPECS else None


def sync(c: Any, cfg: RunConfig, run_id: str, store: dict[str, Any]) -> None:
    """Register the consolidated model if new; attach what was deployed from it; record its gates."""
    cons = _manifest(cfg, "consolidate")
    if cons is None or cons.status != "completed":
        return
    digest = cons.content_digest()
    versions = store.setdefault("versions", {})
    entry = versions.get(digest)
    if entry is None or not _ours(c, cfg, run_id, entry, digest):
        versions[digest] = entry = _find(c, cfg, run_id, digest) or _register(c, cfg, run_id, cons, digest)
    _attach(c, cfg, run_id, entry, digest)
    _gates(c, cfg, run_id, entry, digest, cons)


def _ours(c: Any, cfg: RunConfig, run_id: str, entry: Any, digest: str) -> bool:
    """Whether mlflow.json's version entry is this run's model: the version exists, under the run's model
    name, made by the run's MLflow run from this consolidated model. The folder is untrusted: an edited
    entry must not let a sync judge (and alias) another model's version."""
    from mlflow.exceptions import MlflowException

    ok = False
    if isinstance(entry, dict) and entry.get("name") == model_name(cfg):
        try:
            mv = c.get_model_version(entry["name"], str(entry.get("version")))
            ok = mv.run_id == run_id and mv.tags.get("llmpipe.consolidate_digest") == digest
        except MlflowException:
            ok = False
    if not ok:
        shown = f"{entry.get('name')}/{entry.get('version')}" if isinstance(entry, dict) else repr(entry)
        log.warning("tracking: mlflow.json's model version entry %s is not this run's consolidated model "
                    "(another name, run or model); not used", shown[:120])
    return ok


def _find(c: Any, cfg: RunConfig, run_id: str, digest: str) -> dict[str, str] | None:
    """The version this run registered for `digest` already (a lost or edited mlflow.json), if any."""
    from mlflow.exceptions import MlflowException

    name = model_name(cfg)
    try:
        found = c.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except MlflowException:
        return None
    for mv in found:
        if mv.tags.get("llmpipe.consolidate_digest") == digest:
            return {"name": name, "version": str(mv.version)}
    return None


def _register(c: Any, cfg: RunConfig, run_id: str, cons: Manifest, digest: str) -> dict[str, str]:
    from mlflow.exceptions import MlflowException

    from llmpipe.stages import stage_dir
    from llmpipe.tracking.folder import lineage

    name = model_name(cfg)
    hf = stage_dir(cfg.run_dir(), "consolidate") / "hf"
    folder = hf if hf.is_dir() else stage_dir(cfg.run_dir(), "consolidate")
    trusted(cons, stage_dir(cfg.run_dir(), "consolidate"), folder)
    path = f"model-{digest[:12]}/{folder.name if folder == hf else 'model'}"
    c.log_artifacts(run_id, str(folder), path)
    try:
        c.create_registered_model(name, description="llmpipe: consolidated models (hf/) of the runs logging here")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {**lineage(cfg), "llmpipe.run": cfg.run.name, "llmpipe.run_dir": str(cfg.run_dir()),
            "llmpipe.consolidate_digest": digest, GATES: "pending"}
    source = f"{c.get_run(run_id).info.artifact_uri.rstrip('/')}/{path}"
    mv = c.create_model_version(name, source, run_id=run_id, tags=tags,
                                description=f"run {cfg.run.name}, consolidated {cons.finished_at}")
    log.info("tracking: registered %s version %s (%s)", name, mv.version, source)
    return {"name": name, "version": str(mv.version)}


def trusted(manifest: Manifest, stage_folder: Path, upload: Path | None = None) -> None:
    """TrackingError unless `manifest` verifies (every output's size and sha256, inside its folder) and
    `upload` (a folder about to be uploaded whole) holds no link that leads out of the stage folder: nothing
    outside the run reaches the artifact store, and no verdict comes from files the manifest does not vouch
    for."""
    problem = manifest.verify(stage_folder)
    if problem:
        raise TrackingError(f"{stage_folder}: {problem}; not uploaded (run {manifest.stage} again)")
    inside = stage_folder.resolve()
    for p in sorted(upload.rglob("*")) if upload is not None else ():
        if p.is_symlink() and not p.resolve().is_relative_to(inside):
            raise TrackingError(f"{p}: a link out of the run folder (to {p.resolve()}); not uploaded")


def _from_this_model(cfg: RunConfig, stage: str, digest: str) -> Manifest | None:
    """Stage `stage`'s completed manifest if it was made from the consolidated model `digest`."""
    m = _manifest(cfg, stage)
    if m is None or m.status != "completed":
        return None
    chain = {"export_onnx": "consolidate", "convert_om": "export_onnx"}
    up = chain.get(stage, "consolidate")
    if up == "consolidate":
        return m if m.inputs.get("consolidate") == digest else None
    parent = _from_this_model(cfg, up, digest)
    return m if parent is not None and m.inputs.get(up) == parent.content_digest() else None


def _attach(c: Any, cfg: RunConfig, run_id: str, entry: dict[str, str], digest: str) -> None:
    from llmpipe.stages import stage_dir

    have = c.get_model_version(entry["name"], entry["version"]).tags
    base = c.get_run(run_id).info.artifact_uri.rstrip("/")
    for stage in DEPLOYED:
        m = _from_this_model(cfg, stage, digest)
        tag = f"llmpipe.deploy.{stage}"
        if m is None or have.get(tag, "").endswith(m.fingerprint):
            continue
        folder = stage_dir(cfg.run_dir(), stage)
        trusted(m, folder)
        under = f"model-{digest[:12]}/deploy/{folder.name}"
        for name, out in m.outputs.items():
            rel = Path(out["path"])
            if stage == "benchmark" and rel.parts[0] != "variants":  # results are the run's artifacts
                continue
            parent = "/".join([under, *rel.parts[:-1]])
            c.log_artifact(run_id, str(m.path(folder, name)), parent)  # resolved inside the folder, or refused
        c.set_model_version_tag(entry["name"], entry["version"], tag, f"{base}/{under} {m.fingerprint}")


def verdict(cfg: RunConfig, digest: str, cons: Manifest) -> tuple[str, dict[str, str], dict[str, str]]:
    """passed / failed / pending for the consolidated model `digest`, each judging stage's word, and each
    variant's (llmpipe.verdicts: a variant passes when no judge rejected it). A stage's word counts only if it
    judged this model (its recorded inputs are the run's current stages: not stale) and its manifest
    verifies. The model passes when at least one variant passed: `candidate` and `promote` act on the
    variants that passed, and one is not refused for another's rejection."""
    from llmpipe.stages import stage_dir
    from llmpipe.verdicts import JUDGES, judged, per_variant

    run_dir = cfg.run_dir()
    words: dict[str, str] = {}
    for stage in JUDGES:
        j = judged(run_dir, stage)
        current = j.manifest is not None and j.problem is None and (
            stage != "benchmark" or j.manifest.inputs.get("consolidate") in (None, digest))
        metrics = j.manifest.metrics if current else {}
        if current and (stage == "benchmark" or "rejected" in metrics or "gates_passed" in metrics):
            rejected = [str(v) for v in metrics.get("rejected") or []]
            bad = bool(rejected) or metrics.get("gates_passed") is False
            words[stage] = ("rejected " + ",".join(rejected) if rejected else "failed") if bad else "passed"
        elif _manifest(cfg, stage) is None or j.problem:  # none, or one about an earlier model (stale)
            failure = attempts.last_failure(run_dir, stage_dir(run_dir, stage).name)
            if failure is not None and failure[0].when >= cons.finished_at:
                words[stage] = "failed"  # e.g. a required variant failed, or nothing deployable was left
    variants = per_variant(run_dir) if "benchmark" in words and words["benchmark"] != "failed" else {}
    if "failed" in words.values():
        return "failed", words, variants
    if "benchmark" not in words:
        return "pending", words, variants
    return ("passed" if "passed" in variants.values() else "failed"), words, variants


def _gates(c: Any, cfg: RunConfig, run_id: str, entry: dict[str, str], digest: str, cons: Manifest) -> None:
    name, version = entry["name"], entry["version"]
    word, words, variants = verdict(cfg, digest, cons)
    have = c.get_model_version(name, version).tags
    tags = {**{f"{GATES}.{stage}": w for stage, w in words.items()},
            **{f"{VARIANT}{v}": w for v, w in variants.items()},
            **({PASSED: ",".join(v for v, w in variants.items() if w == "passed")} if variants else {})}
    for tag, w in tags.items():
        if have.get(tag) != w:
            c.set_model_version_tag(name, version, tag, w)
    if have.get(GATES) != word:
        c.set_model_version_tag(name, version, GATES, word)
    run = c.get_run(run_id)
    for k, v in {GATES: word, "llmpipe.model_version": f"{name}/{version}"}.items():
        if run.data.tags.get(k) != v:
            c.set_tag(run_id, k, v)
    if word == "passed" and "llmpipe.candidate_at" not in have:  # once: a person may move it later
        c.set_registered_model_alias(name, CANDIDATE, version)
        c.set_model_version_tag(name, version, "llmpipe.candidate_at", _now())
        log.info("tracking: %s version %s passed its gates (%s): alias @%s", name, version,
                 ", ".join(v for v, w in variants.items() if w == "passed"), CANDIDATE)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _version(c: Any, name: str, version: str | None, alias: str | None, uri: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        if alias is not None:
            return c.get_model_version_by_alias(name, alias)
        return c.get_model_version(name, version)
    except MlflowException as err:
        what = f"{name}@{alias}" if alias is not None else f"{name}/{version}"
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            raise TrackingError(f"model version {what} not found in {uri}") from None
        raise TrackingError(f"{what}: MLflow at {uri} failed: {short(err)}") from None
    except Exception as err:  # noqa: BLE001  connection errors: one line
        raise TrackingError(f"MLflow at {uri} failed: {short(err)}") from None


def promote(uri: str, name: str, version: str, alias: str, force: bool, timeout_s: float = 10.0,
            variant: str | None = None) -> str:
    """Move `alias` to NAME/VERSION if its gates passed (with `variant`: if that variant passed), or with force
    (recorded on the version)."""
    problem = missing_store(uri)
    if problem:
        raise TrackingError(problem)
    with quiet():
        return _promote(uri, name, version, alias, force, timeout_s, variant)


def _promote(uri: str, name: str, version: str, alias: str, force: bool, timeout_s: float,
             variant: str | None = None) -> str:
    c = client(uri, timeout_s)
    mv = _version(c, name, version, None, uri)
    gates = mv.tags.get(GATES) if variant is None else mv.tags.get(f"{VARIANT}{variant}")
    if gates != "passed" and not force:
        if variant is not None:
            why = (f"its {variant} variant's gates are {gates}" if gates else
                   f"it has no gate verdict for the {variant} variant (passed: {mv.tags.get(PASSED) or 'none'})")
        else:
            why = f"its gates are {gates}" if gates in ("failed", "pending") else "it has no gate verdict recorded"
        raise TrackingError(f"{name}/{version}: {why}; not promoted to @{alias} (--force promotes anyway, "
                            "recorded on the version)")
    try:
        if gates != "passed":
            c.set_model_version_tag(name, version, f"llmpipe.forced.{alias}", f"{_now()} gates {gates or 'none'}")
            log.warning("promote: %s/%s promoted to @%s with --force although its gates are %s", name, version,
                        alias, gates or "not recorded")
        if variant is not None:  # which variant the alias was given for
            c.set_model_version_tag(name, version, f"llmpipe.alias.{alias}.variant", variant)
        c.set_registered_model_alias(name, alias, version)
    except Exception as err:  # noqa: BLE001
        raise TrackingError(f"promote {name}/{version} to @{alias}: MLflow at {uri} failed: {short(err)}") from None
    what = f"gates {gates or 'none'}" if variant is None else f"{variant}: gates {gates or 'none'}"
    return f"{name}/{version} -> @{alias} ({what}{', forced' if gates != 'passed' else ''})"


def current_version(cfg: RunConfig) -> tuple[str, str]:
    """(name, version) registered for the run's current consolidated model; TrackingError if none."""
    from llmpipe.tracking.folder import store_state

    cons = _manifest(cfg, "consolidate")
    uri, _, store = store_state(cfg)
    entry = store.get("versions", {}).get(cons.content_digest()) if cons is not None else None
    if entry is None:
        raise TrackingError(f"run {cfg.run.name}: no model version registered in {uri} for its consolidated "
                            f"model (is tracking.mlflow.enabled on? `llmpipe track {cfg.run.name}` registers it)")
    return entry["name"], entry["version"]


def parse_ref(text: str) -> tuple[str, str] | None:
    """NAME/VERSION -> (name, version), else None (a run name)."""
    m = _NAME_VERSION.match(text)
    return (m["name"], m["version"]) if m else None


def is_models_uri(text: str) -> bool:
    return text.startswith("models:/")


def resolve(models_uri: str, uri: str, timeout_s: float = 10.0) -> Path:
    """The run folder of models:/NAME@ALIAS or models:/NAME/VERSION (TrackingError, one line)."""
    m = _MODELS_URI.match(models_uri)
    if not m:
        raise TrackingError(f"{models_uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    problem = missing_store(uri)
    if problem:
        raise TrackingError(problem)
    with quiet():
        mv = _version(client(uri, timeout_s), m["name"], m["version"], m["alias"], uri)
    run_dir = mv.tags.get("llmpipe.run_dir")
    if not run_dir:
        raise TrackingError(f"{models_uri} (version {mv.version}) was not registered by llmpipe (no llmpipe.run_dir "
                            "tag)")
    if not Path(run_dir).is_dir():
        raise TrackingError(f"{models_uri} is version {mv.version}, made by the run folder {run_dir}, which is not "
                            "on this machine")
    _same_model(models_uri, mv, Path(run_dir))
    return Path(run_dir)


def _same_model(models_uri: str, mv: Any, run_dir: Path) -> None:
    """TrackingError unless the run folder still holds the consolidated model the version is: after a rerun,
    the folder holds a newer model, which the alias never named."""
    from llmpipe.stages import stage_dir

    want = mv.tags.get("llmpipe.consolidate_digest") or "none recorded"
    cons = Manifest.read(stage_dir(run_dir, "consolidate"))
    now = cons.content_digest() if cons is not None and cons.status == "completed" else "none"
    if now != want:
        raise TrackingError(f"{models_uri} is version {mv.version}, consolidated model {want[:12]}, but its run "
                            f"folder {run_dir} now holds consolidated model {now[:12]}; refusing to load another "
                            "model than the version")
