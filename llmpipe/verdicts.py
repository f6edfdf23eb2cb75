"""What the gates said about each variant of a run, and whether it still holds for the model in the folder.

Two stages judge: the benchmark (its quality gates; `metrics.rejected` lists the variants it refused, and
every variant it measured has `metrics.ppl`) and the evaluation where it has run (`metrics.rejected`). A
verdict counts only for the model it judged: each judging stage records the content digests of the stages
it read (`Manifest.inputs`), and those must be the digests of the stages in the folder now. After a retrain
whose benchmark fails or has not run (or an evaluation rerun that failed), the verdict on disk is about the
earlier model: it is stale, and `serve`, `serve --latest-passing`, `generate` and the registry refuse it,
naming the stage and both digests. A manifest is verified (outputs' sha256, paths inside its folder) before
a verdict is read from it.

A stage that records no inputs (written before manifests carried them) cannot be checked this way and is
taken as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmpipe.manifest import Manifest, ManifestError

JUDGES = ("benchmark", "evaluate")


@dataclass
class Judged:
    """A judging stage's completed, verified manifest and its folder (None: not judged), or why it cannot count."""

    folder: Path
    manifest: Manifest | None
    problem: str | None = None


def stale(run_dir: Path, stage: str, manifest: Manifest) -> str | None:
    """Why `manifest` (of stage `stage`) judged another model than the run folder holds, or None."""
    from llmpipe.stages import stage_dir

    for dep, recorded in manifest.inputs.items():
        try:
            now = Manifest.load(stage_dir(run_dir, dep))
        except ManifestError:
            now = None
        digest = now.content_digest() if now is not None else "missing"
        if digest != recorded:
            return (f"the {stage} verdict is stale: it judged {dep} {recorded[:12]}, but the run's {dep} is now "
                    f"{digest[:12]} (run {stage} again)")
    return None


def judged(run_dir: Path, stage: str) -> Judged:
    """Stage `stage`'s completed manifest, verified and current; `problem` says why it cannot count."""
    from llmpipe.stages import stage_dir

    folder = stage_dir(run_dir, stage)
    manifest = Manifest.read(folder)
    if manifest is None or manifest.status != "completed":
        return Judged(folder, None)
    problem = manifest.verify(folder)
    if problem:
        return Judged(folder, manifest, f"{folder}: {problem}")
    return Judged(folder, manifest, stale(run_dir, stage, manifest))


def variant_problem(run_dir: Path, variant: str) -> str | None:
    """Why `variant` of the run has not passed its gates for the model in the folder now, or None."""
    bench = judged(run_dir, "benchmark")
    if bench.manifest is None:
        return f"{run_dir}: the benchmark stage has not completed, so no quality gate has passed"
    if bench.problem:
        return bench.problem
    metrics = bench.manifest.metrics
    if variant in (metrics.get("rejected") or []):
        return f"{variant} was rejected by the benchmark's quality gate ({bench.folder / 'results.md'})"
    if variant != "torch" and variant not in (metrics.get("ppl") or {}):
        return f"{variant} was not measured by the benchmark's quality gate (is it in benchmark.variants?)"
    return evaluation_problem(run_dir, variant)


def evaluation_problem(run_dir: Path, variant: str) -> str | None:
    """Why the evaluate stage's result forbids `variant` (rejected, files changed, or stale), or None; a run
    without an evaluation (made before the stage existed, or not evaluated yet) is not refused for it."""
    ev = judged(run_dir, "evaluate")
    if ev.manifest is None:
        return None
    if ev.problem:
        return ev.problem
    if variant in (ev.manifest.metrics.get("rejected") or []):
        return f"{variant} was rejected by the evaluation's gate ({ev.folder / 'results.md'})"
    return None


def per_variant(run_dir: Path) -> dict[str, str]:
    """{variant: "passed" | "failed"} for every variant the benchmark measured, for the model in the folder
    now ({} when no current benchmark verdict exists). A variant passes when neither judge rejected it."""
    bench = judged(run_dir, "benchmark")
    if bench.manifest is None or bench.problem:
        return {}
    measured = list(bench.manifest.metrics.get("ppl") or {})
    return {v: "failed" if variant_problem(run_dir, v) else "passed" for v in measured}


def rejection(run_dir: Path, variant: str) -> str | None:
    """Which judge rejected `variant` of the model in the folder now, or None (not judged yet, or judged
    about an earlier model: a stale verdict rejects nothing)."""
    for stage in JUDGES:
        j = judged(run_dir, stage)
        if j.manifest is not None and not j.problem and variant in (j.manifest.metrics.get("rejected") or []):
            gate = "the benchmark's quality gate" if stage == "benchmark" else "the evaluation's gate"
            return f"{variant} was rejected by {gate} ({j.folder / 'results.md'})"
    return None
