"""Warm start: a new train attempt continues from an earlier attempt's checkpoint.

When the train stage runs again because a result-defining field changed (lr, max_steps, the global
batch...) and its own folder holds no checkpoint yet, the newest verified checkpoint of an earlier
attempt of the same run is the starting point, provided the model architecture and the data
(prepare_data's content digest) are unchanged; a checkpoint of another layout or world size is
resharded on load (llmpipe.checkpoint.portable).
Earlier attempts are the stage's completed folder (02_train) and the folders kept under
superseded/; each holds `attempt.json` (written at launch: the data digest, the config it ran and
the stage's fingerprint). An earlier attempt with this attempt's fingerprint (its manifest lost, or
--force) that reached max_steps is this stage's result already: its final checkpoint is published
as this attempt's without training.

Carried over: weights, optimizer state, data position (consumed samples), RNG state; the optimizer
hyperparameters and the lr schedule come from the new config (llmpipe.train.loop.retune).
With schedule.decay=wsd on both sides, only a checkpoint from the old run's stable phase is used, so
raising max_steps gives exactly the run that had planned the longer horizon.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe import attempts
from llmpipe import config as config_mod
from llmpipe.checkpoint import io as ckpt

log = logging.getLogger("llmpipe.train")

ATTEMPT = "attempt.json"
CARRIED = ["weights", "optimizer state", "data position (consumed samples)", "RNG state"]


@dataclass
class WarmStart:
    checkpoint: Path
    step: int
    source: Path  # the earlier attempt's folder
    changed: dict[str, list]  # dotted field -> [old, new], every field that differs

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": str(self.checkpoint), "step": self.step, "source": str(self.source),
                "changed": self.changed, "carried_over": CARRIED}

    def describe(self) -> str:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in list(self.changed.items())[:12])
        more = f" (+{len(self.changed) - 12} more)" if len(self.changed) > 12 else ""
        return (f"warm start from {self.checkpoint} (step {self.step}): changed {shown or 'nothing'}{more}; "
                f"carried over {', '.join(CARRIED)}; lr schedule and optimizer settings from the new config")


# What in data_meta.json defines the data training reads; the rest (document counts, read errors, symlinks
# refused) describes how prepare_data got there, and a release that adds such a key changes no token.
DATA_META_KEYS = ("vocab_size", "eos_id", "eos_token", "dtype", "seq_len", "format", "chat")


def data_digest(data_dir: Path, manifest) -> str:
    """What defines prepare_data's result for training: the tokenizer's and shards' sha256 (every output but
    data_meta.json) and the defining keys of data_meta.json (issue 36 item 19: a prepare_data rerun that
    only adds a descriptive key to data_meta.json must not stop a warm start)."""
    from llmpipe.manifest import fingerprint, read_json_bounded

    meta = read_json_bounded(manifest.path(data_dir, "meta"))
    return fingerprint({"outputs": {n: e["sha256"] for n, e in manifest.outputs.items() if n != "meta"},
                        "meta": {k: meta.get(k) for k in DATA_META_KEYS}})


def write_attempt(work_dir: Path, cfg: config_mod.RunConfig, data_digest: str, fingerprint: str,
                  data_files: str | None = None) -> None:
    record = {"data": data_digest, "data_files": data_files, "config": cfg.to_dict(), "fingerprint": fingerprint}
    (Path(work_dir) / ATTEMPT).write_text(json.dumps(record, indent=2) + "\n")


def diff(old: Any, new: Any, prefix: str = "") -> dict[str, list]:
    """{dotted path: [old, new]} of every leaf that differs between two config trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: dict[str, list] = {}
        for k in sorted(set(old) | set(new)):
            out.update(diff(old.get(k), new.get(k), f"{prefix}{k}."))
        return out
    return {} if old == new else {prefix.rstrip("."): [old, new]}


def _candidates(run_dir: Path, stage_folder: Path) -> list[Path]:
    found = [stage_folder] if stage_folder.is_dir() else []
    return found + [k.path for k in attempts.kept(run_dir, attempts.SUPERSEDED, stage_folder.name)]


def _why_not(source: Path, model: dict, data_digest: str, data_files: str | None = None) -> tuple[str | None, dict]:
    """Why an earlier attempt cannot seed this one (None if it can), and its recorded attempt."""
    try:
        attempt = json.loads((source / ATTEMPT).read_text())
        old_model = json.loads((source / "model_config.json").read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return "it records no attempt.json/model_config.json", {}
    same = (attempt.get("data_files") == data_files if attempt.get("data_files") and data_files
            else attempt.get("data") == data_digest)  # an attempt before data_files: the whole prepare_data
    if not same:
        return "its data (tokenizer and shards) differ", attempt
    if old_model != model:
        return "its model architecture differs", attempt
    return None, attempt


def _pick_checkpoint(source: Path, cfg, attempt: dict, fingerprint: str) -> tuple[Path, int] | None:
    """Newest verified checkpoint of `source` usable here: before the new max_steps (so the attempt
    trains at least one step and writes its own final checkpoint), of any layout (resharded on load)
    and, wsd on both sides, from the old run's stable phase. An attempt with this one's fingerprint
    gives its checkpoint at max_steps first: the result itself (published without training)."""
    from llmpipe.optim import stable_until

    final = ckpt.step_dir(source / "checkpoints", cfg.train.max_steps)
    if attempt.get("fingerprint") == fingerprint and final.is_dir():
        if ckpt.verify(final) is None:
            return final, cfg.train.max_steps
        log.warning("checkpoint %s does not verify; not published as this attempt's result", final)
    limit = cfg.train.max_steps - 1
    try:
        old_cfg = config_mod.from_dict(attempt["config"], source=str(source / ATTEMPT), check="fields")
    except (config_mod.ConfigError, KeyError):
        old_cfg = None
    if old_cfg is not None and cfg.train.schedule.decay == "wsd" and old_cfg.train.schedule.decay == "wsd":
        limit = min(limit, stable_until(old_cfg) or limit)
    for folder in reversed(ckpt.list_steps(source / "checkpoints")):
        try:
            meta = ckpt.read_meta(folder)
        except (OSError, ValueError):
            continue
        if meta.get("step", 0) > limit:
            continue
        if ckpt.verify(folder) is None:
            return folder, int(meta["step"])
        log.warning("checkpoint %s does not verify; not used for a warm start", folder)
    return None


def find(cfg, work_dir: Path, stage_folder: Path, model: dict, data_digest: str, fingerprint: str,
         data_files: str | None = None) -> WarmStart | None:
    """The warm start for this attempt (`fingerprint`: the stage's now), or None (its own checkpoints
    come first; resume must be auto)."""
    resume = cfg.train.checkpoint.resume
    if not (resume is True or resume == "auto") or ckpt.latest_valid(Path(work_dir) / "checkpoints"):
        return None
    new_tree = cfg.to_dict()
    for source in _candidates(cfg.run_dir(), stage_folder):
        problem, attempt = _why_not(source, model, data_digest, data_files)
        picked = None if problem else _pick_checkpoint(source, cfg, attempt, fingerprint)
        if picked is None:
            log.info("no warm start from %s: %s", source,
                     problem or f"no verified checkpoint before max_steps {cfg.train.max_steps} "
                     "(and, with wsd, in the old run's stable phase)")
            continue
        return WarmStart(picked[0], picked[1], source, diff(attempt.get("config", {}), new_tree))
    return None


WARM_START = "warm_start.json"  # in the train folder: where this training started from


def prepare(ctx) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """For the train stage: the config tree to hand the ranks (with resume pointing at the warm-start
    checkpoint when there is one) and the warm-start record of this training, if any."""
    from llmpipe.models.llama import model_args

    cfg, out = ctx.cfg, Path(ctx.work_dir)
    data_dir, data_manifest = ctx.inputs["prepare_data"]
    digest, files = data_manifest.content_digest(), data_digest(Path(data_dir), data_manifest)
    write_attempt(out, cfg, digest, ctx.fingerprint, files)
    tree = cfg.to_dict()
    vocab = json.loads((Path(data_dir) / "data_meta.json").read_text())["vocab_size"]
    model = model_args(cfg.model, vocab_size=vocab).to_dict()
    from llmpipe.stages import stage_dir

    found = find(cfg, out, stage_dir(ctx.run_dir, ctx.name), model, digest, ctx.fingerprint, files)
    if found is not None:
        if found.step == cfg.train.max_steps:
            log.info("%s is this stage's result already (an attempt with the same fingerprint, at train.max_steps="
                     "%d): published without training (train.checkpoint.resume=never trains from scratch)",
                     found.checkpoint, found.step)
        else:
            log.info("%s", found.describe())
        tree["train"]["checkpoint"]["resume"] = str(found.checkpoint)
        (out / WARM_START).write_text(json.dumps(found.to_dict(), indent=2, default=str) + "\n")
    try:
        return tree, json.loads((out / WARM_START).read_text())
    except (OSError, ValueError):
        return tree, None
