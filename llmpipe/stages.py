"""The stage contract: fingerprints, verified inputs, skip-if-done, atomic publish.

`run_stage(name, cfg)` is what both the CLI and the Prefect tasks call. Each stage writes into
`artifacts/<run>/.<NN_stage>.partial/`, which is renamed to `<NN_stage>/` only when the stage
succeeds, and then carries `manifest.json`. A stage whose manifest validates, is consistent with
its status, verifies (every output's size and sha256) and whose fingerprint equals the one computed
now is skipped.

A stage's fingerprint hashes its own config sections, environment facts (`extra`), the stage's
revision (bumped when its code changes what it produces; never the package version, so an upgrade
re-runs only what it changed), and the content digest of each input stage's outputs as recorded in
that stage's manifest (`Manifest.content_digest`). So a config change re-runs the stage it belongs
to; whatever follows re-runs only if the bytes it reads changed. Inputs are verified in full
(sha256, through the digest cache) before a stage reads them: a corrupted input stops the stage
with the file's name. A run that takes the run lock first removes what killed attempts of
non-resumable stages left (`remove_stale_partials`).

A stage's folder is numbered by its spec (`StageSpec.number`), never by its place in the pipeline,
so a stage added later takes the next free number and renames no existing folder.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llmpipe import attempts, console
from llmpipe.config import STAGES, RunConfig, operational_changes, result_section, section
from llmpipe.errors import ConfigError, StageError, UserError
from llmpipe.lock import run_lock
from llmpipe.manifest import DigestCache, Manifest, ManifestError, file_entry, fingerprint, versions

log = logging.getLogger("llmpipe.stages")


def is_transient(exc: BaseException) -> bool:
    """Whether a retry could succeed: flagged StageErrors and I/O or connection trouble."""
    if isinstance(exc, UserError):
        return exc.transient
    return isinstance(exc, (ConnectionError, TimeoutError, BlockingIOError))


@dataclass(frozen=True)
class StageSpec:
    name: str
    sections: tuple[str, ...]  # config sections that define this stage's result
    inputs: tuple[str, ...]  # stages whose outputs it reads
    # "llmpipe.<room>.<module>:run", taking a StageContext, returning a StageResult. The rule (a test
    # holds every spec to it): the function is `run`; its module sits in the room package that owns the
    # stage's work (data, train, checkpoint, export, bench; eval next), one stage per module, and its
    # docstring opens with "The <name> stage:", so `grep -rl "The NAME stage:" llmpipe` finds it.
    entry: str
    number: int  # its folder's NN_: fixed once released, a new stage takes the next free one
    revision: int = 1  # bump when this stage's code changes what it produces (see _revision)
    resumable: bool = False  # keep the partial folder across failed attempts (training)
    extra: str | None = None  # "module:function(cfg) -> dict" of environment facts in the fingerprint
    outputs: tuple[str, ...] = ()  # what a completed manifest must list (a folder output: "name/")
    may_skip: bool = False  # whether "skipped" (with a reason) is a legitimate result
    retention: str | None = None  # config field: how many superseded folders to keep (resumable stages)
    # Stages it reads a part of: done and verified in full before it runs, like `inputs`, but their content
    # digest is not in its fingerprint; its `extra` hashes the part it reads (the evaluation reads the graphs
    # of export_onnx and benchmark, not their timings, so a re-timed benchmark does not re-run it).
    reads: tuple[str, ...] = ()


# In pipeline order (config.STAGES), which a new stage may enter anywhere; its number is the next free one.
SPECS: dict[str, StageSpec] = {s.name: s for s in (
    StageSpec("prepare_data", ("data", "run.seed"), (), "llmpipe.data.prepare:run", number=1,
              extra="llmpipe.data.corpus:fingerprint_extra",
              outputs=("tokenizer", "train_bin", "train_idx", "val_bin", "val_idx", "meta")),
    StageSpec("train", ("model", "train", "run.seed"), ("prepare_data",), "llmpipe.train.stage:run", number=2,
              resumable=True, extra="llmpipe.train.fingerprint:extra",
              retention="train.checkpoint.keep_superseded",
              outputs=("checkpoint/", "metrics", "model_config", "summary", "config")),
    # revision 2: hf/ gains tokenizer_config.json, special_tokens_map.json, generation_config.json (issue 24)
    StageSpec("consolidate", ("consolidate",), ("train", "prepare_data"), "llmpipe.checkpoint.consolidate:run",
              number=3, revision=2, extra="llmpipe.checkpoint.consolidate:fingerprint_extra",
              outputs=("model", "model_config", "tokenizer")),
    # NOTE: ort/ (export.ort_graph, issue 25) is written only when that added field is on, so what the stage
    # produces at its defaults is unchanged: revision 1 still, and no finished export re-runs on upgrade
    StageSpec("export_onnx", ("export",), ("consolidate",), "llmpipe.export.onnx:run",
              number=4, outputs=("model", "parity")),
    StageSpec("convert_om", ("convert_om",), ("export_onnx",), "llmpipe.export.atc:run", number=5,
              extra="llmpipe.export.atc:fingerprint_extra", outputs=("om", "log", "argv"), may_skip=True),
    # revision 2: benchmark.quantize and the gates re-derived on SmolLM2-135M (issue 37): int4's head at 8 bits
    # in blocks of 32, int8 per channel with down / head in fp32, KL limits; a finished benchmark is re-measured
    # revision 3: int4 is HQQ with its zero points folded to integers (llmpipe.infer.fold), the recipe that holds
    # on SmolLM2-135M; tied models' head8 ORT graphs load (the builder's shared embedding was broken)
    StageSpec("benchmark", ("benchmark",), ("export_onnx", "convert_om", "consolidate", "prepare_data", "train"),
              "llmpipe.bench.run:run", number=6, revision=3, outputs=("results", "table")),
    StageSpec("evaluate", ("evaluate",), ("prepare_data", "consolidate"), "llmpipe.eval.stage:run", number=7,
              extra="llmpipe.eval.tasks:fingerprint_extra", reads=("export_onnx", "benchmark"),
              outputs=("results", "table", "plot", "tasks/")),
)}
assert tuple(SPECS) == STAGES
assert len({s.number for s in SPECS.values()}) == len(SPECS), "two stages share a folder number"

# NOTE: fingerprints up to llmpipe 0.1.0 hashed {"llmpipe": llmpipe.__version__}. Revision 1 keeps that
# key with the value frozen at "0.1.0", so every existing run's fingerprints stay byte-identical and
# nothing re-runs for this change or any later upgrade; revision n > 1 hashes "0.1.0+r<n>" instead.
_REVISION_1 = "0.1.0"


def _revision(spec: StageSpec) -> str:
    return _REVISION_1 if spec.revision == 1 else f"{_REVISION_1}+r{spec.revision}"


@dataclass
class StageResult:
    """What a stage function returns: outputs (name -> path relative to the stage folder; a
    folder is expanded to its files), metrics, and a status ("completed" or "skipped")."""

    outputs: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    status: str = "completed"
    reason: str | None = None


@dataclass
class StageContext:
    cfg: RunConfig
    name: str
    run_dir: Path
    work_dir: Path  # the partial folder the stage writes into
    inputs: dict[str, tuple[Path, Manifest]]  # stage name -> (its folder, its manifest)
    fingerprint: str
    # Where a stage's independent work items run (prepare_data's units): a callable
    # (fn, items, on_done) -> None, e.g. a Prefect subflow's task runner; None: the stage's default.
    executor: Callable | None = None

    def input_path(self, stage: str, output: str) -> Path:
        folder, manifest = self.inputs[stage]
        return manifest.path(folder, output)


def stage_dir(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / f"{SPECS[name].number:02d}_{name}"


def partial_dir(run_dir: Path, name: str) -> Path:
    """Where stage `name` writes until it publishes: `.<NN_stage>.partial` beside its folder."""
    return Path(run_dir) / f".{stage_dir(run_dir, name).name}.partial"


def remove_stale_partials(run_dir: Path) -> list[Path]:
    """Remove what interrupted attempts of non-resumable stages left (a killed export's partial
    folder); a resumable stage's holds paid-for work (checkpoints) and stays. Call only as the
    taker of the run lock (`run_lock` yields True): then no attempt is writing in the folder."""
    removed = []
    for name, spec in SPECS.items():
        partial = partial_dir(run_dir, name)
        if spec.resumable or not (partial.is_dir() or partial.is_symlink()):
            continue
        log.info("removing %s, left by an interrupted %s attempt", partial, name)
        if partial.is_symlink():  # never followed: only the link goes
            partial.unlink()
        else:
            shutil.rmtree(partial)
        removed.append(partial)
    return removed


def _resolve(entry: str) -> Callable:
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func)


def _content(run_dir: Path, name: str) -> str:
    """Content digest of stage `name`'s recorded outputs, or a word saying why there is none."""
    try:
        manifest = Manifest.load(stage_dir(run_dir, name))
    except ManifestError:
        return "invalid"
    return manifest.content_digest() if manifest is not None else "missing"


def fingerprints(cfg: RunConfig) -> dict[str, str]:
    """Expected fingerprint of every stage under `cfg`, in pipeline order, given the inputs on disk now."""
    out: dict[str, str] = {}
    contents: dict[str, str] = {}
    run_dir = cfg.run_dir()
    for name, spec in SPECS.items():
        for i in spec.inputs:
            if i not in contents:
                contents[i] = _content(run_dir, i)
        out[name] = fingerprint(_payload(cfg, spec, {i: contents[i] for i in spec.inputs}))
    return out


def _payload(cfg: RunConfig, spec: StageSpec, inputs: dict[str, str]) -> dict[str, Any]:
    payload = {
        "stage": spec.name,
        "config": {s: result_section(cfg, s) for s in spec.sections},
        "inputs": inputs,
        "llmpipe": _revision(spec),  # the key's name kept: see _REVISION_1
    }
    if spec.extra:
        payload["extra"] = _resolve(spec.extra)(cfg)
    return payload


def _known(value: Any, recorded: Any) -> Any:
    """`value` (a config subtree) pruned to the keys `recorded` (the same subtree as an earlier release
    wrote it) holds: the fields that release knew."""
    if not isinstance(value, dict) or not isinstance(recorded, dict):
        return value
    return {k: _known(v, recorded[k]) for k, v in value.items() if k in recorded}


def adopted(cfg: RunConfig, spec: StageSpec, manifest: Manifest) -> dict[str, Any] | None:
    """How a manifest written by an earlier release still is this stage's result, or None.

    A release hashes the result fields it knows; a later one adds fields (issue 36, item 19: data's
    external_symlinks, max_record_bytes and tokenizer.doc_chars came after 0.1.0 without the `added`
    mark) and would re-run every finished stage. So the fingerprint is recomputed the recorded
    release's way: the config pruned to the fields its recorded config holds, with the package version it
    records, the inputs and environment facts as now. It must equal the recorded fingerprint, and every
    field the release did not know must be at its default today (what the recorded config means when read
    by this release), so a changed result-defining input never matches. A stage whose revision was bumped
    since (its code changes what it produces) is never adopted."""
    from llmpipe.config import from_dict

    release = manifest.versions.get("llmpipe")
    if spec.revision != 1 or not release or not manifest.config:
        return None
    try:
        then = from_dict(manifest.config, source="recorded config", check="fields")
    except (ConfigError, ValueError, TypeError):
        return None  # a field it had is gone or changed shape: not this release's result
    now = {s: result_section(cfg, s) for s in spec.sections}
    if now != {s: result_section(then, s) for s in spec.sections}:
        return None  # a result field differs (an added one away from its default included)
    payload = _payload(cfg, spec, {i: _content(cfg.run_dir(), i) for i in spec.inputs})
    recorded = {s: _dig(manifest.config, s) for s in spec.sections}
    payload["config"] = {s: _known(v, recorded[s]) for s, v in now.items()}
    payload["llmpipe"] = release
    if fingerprint(payload) != manifest.fingerprint:
        return None
    return {"fingerprint": manifest.fingerprint, "llmpipe": release}


def _dig(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def consistency(spec: StageSpec, manifest: Manifest) -> str | None:
    """Why `manifest` cannot be what stage `spec` produced (status vs outputs), or None."""
    if manifest.stage != spec.name:
        return f"manifest is for stage {manifest.stage!r}"
    if manifest.status == "skipped":
        if not spec.may_skip:
            return f"status is skipped, but {spec.name} is never skipped"
        if not manifest.reason:
            return "status is skipped without a reason"
        if manifest.outputs:
            return "status is skipped, but outputs are listed"
        return None
    for want in spec.outputs:
        listed = (any(n.startswith(want) for n in manifest.outputs) if want.endswith("/")
                  else want in manifest.outputs)
        if not listed:
            return f"status is completed, but output {want.rstrip('/')} is not listed"
    return None


def state(cfg: RunConfig, name: str, expected: str | None = None, full: bool = True,
          rehash: bool = False) -> tuple[str, Manifest | None]:
    """One stage's state and manifest: "done", "stale" (fingerprint differs), "missing",
    "invalid: <why>" (manifest off-schema or inconsistent) or "corrupt: <why>" (outputs differ from it).

    full=True checks every output's sha256 (through the digest cache unless `rehash`)."""
    folder = stage_dir(cfg.run_dir(), name)
    try:
        manifest = Manifest.load(folder)
    except ManifestError as err:
        return f"invalid: {err}", None
    if manifest is None:
        return "missing", None
    problem = consistency(SPECS[name], manifest)
    if problem:
        return f"invalid: {folder / 'manifest.json'}: {problem}", manifest
    expected = expected or fingerprints(cfg)[name]
    if manifest.fingerprint != expected and adopted(cfg, SPECS[name], manifest) is None:
        return "stale", manifest
    problem = manifest.verify(folder, full=full, rehash=rehash)
    if problem:
        return f"corrupt: {problem}", manifest
    return "done", manifest


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _prepare_partial(partial: Path, fp: str, spec: StageSpec, run_dir: Path) -> None:
    """An empty partial folder for this attempt, or the previous attempt's with the same fingerprint
    (a resumable stage continues from it). A resumable stage's partial folder with another
    fingerprint holds paid-for work (checkpoints): it is moved aside, never deleted."""
    marker = partial / ".fingerprint"
    if partial.exists():
        old = marker.read_text().strip() if marker.is_file() else ""
        if spec.resumable and old == fp:
            log.info("resuming from the partial outputs in %s", partial)
            return
        if spec.resumable and any(p.name != ".fingerprint" for p in partial.iterdir()):
            attempts.supersede(partial, run_dir, stage_dir(run_dir, spec.name).name, old or "0" * 12)
        else:
            shutil.rmtree(partial)
    partial.mkdir(parents=True)
    marker.write_text(fp + "\n")


def _expand_outputs(root: Path, outputs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Manifest entries for a stage's outputs (a folder expands to its files); the digests are
    remembered in the folder's digest cache, so the first verification does not hash them again."""
    entries: dict[str, dict[str, Any]] = {}
    cache = DigestCache(root)
    inside = root.resolve()
    for name, rel in outputs.items():
        p = root / rel
        if not p.resolve().is_relative_to(inside):
            raise StageError(f"stage output {name} ({p}) resolves outside its folder {root}")
        if p.is_dir():
            for f in sorted(x for x in p.rglob("*") if x.is_file()):
                sub = f.relative_to(root).as_posix()
                entries[f"{name}/{f.relative_to(p).as_posix()}"] = file_entry(root, sub, cache)
        elif p.is_file():
            entries[name] = file_entry(root, rel, cache)
        else:
            raise StageError(f"stage produced no {name} ({p})")
    cache.save()
    return entries


def _publish(partial: Path, final: Path, spec: StageSpec, run_dir: Path) -> None:
    """Swap `partial` into place as `final`. The previous result is removed only afterwards, except a
    resumable stage's (checkpoints), which is moved aside to superseded/."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(partial, final)
    if old is None:
        return
    previous = Manifest.read(old) if spec.resumable else None
    if spec.resumable:
        attempts.supersede(old, run_dir, final.name, previous.fingerprint if previous else "0" * 12)
    else:
        shutil.rmtree(old, ignore_errors=True)


def _record_operational_changes(spec: StageSpec, cfg: RunConfig, manifest: Manifest) -> None:
    """A done stage run under changed operational settings: say so, and record what changed and
    when in its manifest (which then carries the new config)."""
    new = cfg.to_dict()
    changed = operational_changes(manifest.config, new, spec.sections)
    if not changed:
        return
    log.info("%s: up to date; operational settings changed (not re-run): %s", spec.name,
             ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in changed.items())))
    manifest.changes.append({"at": _now(), "operational": changed})
    manifest.config = new
    with run_lock(cfg.run_dir()):
        manifest.write(stage_dir(cfg.run_dir(), spec.name))


def _record_adoption(spec: StageSpec, cfg: RunConfig, manifest: Manifest, fp: str) -> None:
    """A result of an earlier release taken as this stage's (see adopted): its manifest gets today's
    fingerprint, and a change entry saying what it had and which release wrote it."""
    found = adopted(cfg, spec, manifest)
    log.info("%s: done by llmpipe %s (fingerprint %s, computed that release's way); adopted as %s", spec.name,
             found["llmpipe"], found["fingerprint"][:12], fp[:12])
    manifest.changes.append({"at": _now(), "adopted": found})
    manifest.fingerprint = fp
    with run_lock(cfg.run_dir()):
        manifest.write(stage_dir(cfg.run_dir(), spec.name))


def run_stage(name: str, cfg: RunConfig, force: bool = False,
              executor: Callable | None = None) -> tuple[Manifest, bool]:
    """Run one stage unless it is already done. Returns (manifest, executed). `executor`: see
    StageContext.executor."""
    if name not in SPECS:
        raise ConfigError(f"unknown stage {name!r} (stages: {', '.join(STAGES)})")
    spec = SPECS[name]
    fps = fingerprints(cfg)
    run_dir = cfg.run_dir()
    if not force:
        status, manifest = state(cfg, name, fps[name])
        if status == "done":
            if manifest.fingerprint != fps[name]:
                _record_adoption(spec, cfg, manifest, fps[name])
            console.show(log, "%s: up to date (fingerprint %s), skipped", name, fps[name][:12])
            _record_operational_changes(spec, cfg, manifest)
            return manifest, False
        if status != "missing":
            log.info("%s: existing result is %s; running again", name, status)

    inputs: dict[str, tuple[Path, Manifest]] = {}
    for dep in (*spec.inputs, *spec.reads):  # verified in full: never bytes its manifest does not vouch for
        status, manifest = state(cfg, dep, fps[dep], full=True)
        if status != "done":
            raise StageError(f"{name} needs {dep}, which is {status}; run {dep} first")
        inputs[dep] = (stage_dir(run_dir, dep), manifest)

    with run_lock(run_dir) as taken:  # also removes a run folder it created, if the stage left it empty
        if taken:
            remove_stale_partials(run_dir)
        # everything logged while it runs (Prefect's task-run lines, lm_eval's, the ranks'), appended
        with console.log_to(console.logs_dir(run_dir) / f"{stage_dir(run_dir, name).name}.log"):
            return _execute(spec, cfg, fps, inputs, executor), True


def _injected_failure(name: str) -> None:
    """Test hook, off by default: LLMPIPE_FAIL_STAGE=<stage>[,<stage>] makes those stages fail."""
    wanted = {s.strip() for s in os.environ.get("LLMPIPE_FAIL_STAGE", "").split(",")}
    if name in wanted:
        raise StageError(f"{name}: failure injected by LLMPIPE_FAIL_STAGE (a test hook)")


_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def _execute(spec: StageSpec, cfg: RunConfig, fps: dict[str, str],
             inputs: dict[str, tuple[Path, Manifest]], executor: Callable | None = None) -> Manifest:
    name, run_dir = spec.name, cfg.run_dir()
    final, partial = stage_dir(run_dir, name), partial_dir(run_dir, name)
    attempts.check_folders(run_dir)  # a symlinked superseded/ or failed/: refused before any work
    _prepare_partial(partial, fps[name], spec, run_dir)
    started, t0 = _now(), time.monotonic()
    console.show(log, "%s: running (fingerprint %s)", name, fps[name][:12])
    ctx = StageContext(cfg, name, run_dir, partial, inputs, fps[name], executor)
    try:
        _injected_failure(name)
        result: StageResult = _resolve(spec.entry)(ctx)
    except BaseException as exc:
        # The attempt's evidence (logs, error files) is kept under failed/, and the error points there.
        evidence = attempts.keep_failure(partial, run_dir, final.name, exc)
        # Nothing half-written stays behind, except a resumable stage's partial folder (training
        # checkpoints), which the next attempt with the same fingerprint continues from.
        # A resumable stage that failed before writing anything leaves nothing either.
        if not spec.resumable or not any(p.name != ".fingerprint" for p in partial.iterdir()):
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:
            # A full disk, a quota or a read-only mount is the user's to fix: one line naming where.
            where = exc.filename or partial
            raise StageError(f"{name}: {where}: {os.strerror(exc.errno).lower()}") from exc
        if isinstance(exc, UserError):  # the module's own error becomes the stage's, evidence repointed
            moved = attempts.repoint(str(exc), partial, evidence)
            if moved != str(exc) or not isinstance(exc, StageError):
                raise StageError(moved, transient=exc.transient) from exc
        raise

    (partial / ".fingerprint").unlink(missing_ok=True)
    manifest = Manifest(
        stage=name, status=result.status, reason=result.reason, fingerprint=fps[name],
        outputs=_expand_outputs(partial, result.outputs), metrics=result.metrics,
        config=cfg.to_dict(), versions=versions(), started_at=started, finished_at=_now(),
        duration_s=round(time.monotonic() - t0, 3),
        inputs={d: m.content_digest() for d, (_, m) in inputs.items() if d in spec.inputs},
    )
    manifest.write(partial)
    _publish(partial, final, spec, run_dir)
    if spec.retention:
        attempts.prune_superseded(run_dir, final.name, section(cfg, spec.retention))
    outcome = console.summary(name, result.metrics)  # (a skip's reason: the stage's own warning says it)
    console.show(log, "%s: %s in %.1fs%s -> %s", name, result.status, manifest.duration_s,
                 f" - {outcome}" if outcome else "", final)
    return manifest


def select(from_stage: str | None = None, only: list[str] | None = None) -> list[str]:
    """The stages to run, in pipeline order, for --from-stage / --only."""
    for s in [from_stage, *(only or [])]:
        if s is not None and s not in SPECS:
            raise ConfigError(f"unknown stage {s!r} (stages: {', '.join(STAGES)})")
    if only:
        return [s for s in STAGES if s in only]
    start = STAGES.index(from_stage) if from_stage else 0
    return list(STAGES[start:])
