"""What can be checked before any stage runs, on this machine, for the stages a pipeline run is about
to run (selected, and forced or not done): before training, `check_launch` (the hostfile readable,
dp x tp x pp against the world size the train stage will start: nproc_per_node x train.nodes, or x
the hostfile's hosts) and `check_resume` (an explicit train.checkpoint.resume holds this config's
model); before convert_om, `check_atc_present` (ATC found when convert_om.required is true); with
export_onnx selected and export.ort_graph on, `check_ort_builder` (onnxruntime-genai's builder installed);
with evaluate selected, `check_evaluate` (its task files and chat_questions).
`check_before_run` runs them; `llmpipe run`, `llmpipe stage` and the flow call it.

What a config can tell about itself alone is llmpipe.config_checks' (run when the config loads);
this module sits above the stages it checks for, and nothing below imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmpipe import config_checks
from llmpipe.config import RunConfig
from llmpipe.errors import ConfigError, StageError, UserError
from llmpipe.train.launch import hostfile_nodes


def check_launch(cfg: RunConfig) -> None:
    """The hostfile readable, and dp x tp x pp against the world size the train stage will launch."""
    t = cfg.train
    nodes = t.nodes if t.hostfile is None else hostfile_nodes(cfg)  # missing: named now, not after prepare_data
    world = t.nproc_per_node * nodes
    if cfg.train.compile:
        from llmpipe import device as dev

        try:
            dev.compile_backend(dev.resolve(cfg.run.device))
        except RuntimeError as err:
            raise ConfigError(str(err)) from None
    config_checks.validate_layout(cfg, config_checks.config_model_args(cfg), world,
                     f" (world size {world} = nproc_per_node {cfg.train.nproc_per_node} x {nodes} node(s))")
    if t.launcher != "local":  # the scheduler's client here and answering, its partition / namespace there
        from llmpipe.train import cluster

        cluster.check(cfg)


# The largest meta.json read for check_resume: it lists every file of the checkpoint with its digest,
# about 150 bytes each, so this is room for ~100k files.
MAX_META_BYTES = 16 << 20
_RESUME_WORDS = ("auto", "never", "false")  # what llmpipe.train.loop reads as no path


def _recorded_model(folder: Path) -> dict:
    """The model a checkpoint folder records (meta.json's "model", what llmpipe.train.loop writes):
    read bounded, parsed safely, never through a link out of the folder; ConfigError naming the file."""
    from llmpipe.checkpoint.io import META

    path = folder / META
    problem = f"train.checkpoint.resume: {path} missing or unreadable"
    try:
        if path.is_symlink() and not path.resolve().is_relative_to(folder.resolve()):
            raise ConfigError(f"train.checkpoint.resume: {path} links outside {folder}")
        with open(path, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
    except OSError:
        raise ConfigError(problem) from None
    if len(raw) > MAX_META_BYTES:
        raise ConfigError(f"train.checkpoint.resume: {path} is over {MAX_META_BYTES >> 20} MiB")
    try:
        model = json.loads(raw).get("model")
    except (ValueError, RecursionError, AttributeError):  # not JSON, nested past the stack, not an object
        raise ConfigError(problem) from None
    if not isinstance(model, dict):
        raise ConfigError(f"train.checkpoint.resume: {path} records no model")
    return model


def check_resume(cfg: RunConfig) -> None:
    """An explicit train.checkpoint.resume (a path) holds this config's model: every ModelArgs field
    meta.json records but the vocabulary (the tokenizer's, known after prepare_data) equals the
    config's, as for a warm start (llmpipe.train.warm). The full check (every file's digest) stays
    with the ranks: a large checkpoint takes minutes to hash."""
    r = cfg.train.checkpoint.resume
    if not isinstance(r, str) or r in _RESUME_WORDS:
        return
    recorded = _recorded_model(Path(r))
    mine = config_checks.config_model_args(cfg).to_dict()
    # NOTE: to_dict leaves the family options out at their defaults (a model made before they existed records
    # none): a side without one has the default, so a tied checkpoint and an untied config still differ
    from llmpipe.models.llama.model import option_defaults

    for key, default in option_defaults().items():
        if key in mine or key in recorded:
            mine.setdefault(key, default)
            recorded.setdefault(key, default)
    differ = [f"{k} {recorded[k]!r} (config {mine[k]!r})" for k in mine
              if k != "vocab_size" and k in recorded and recorded[k] != mine[k]]
    if differ:
        raise ConfigError(f"train.checkpoint.resume: {r} holds another model than the config's: {', '.join(differ)}")


def check_atc_present(cfg: RunConfig) -> None:
    """convert_om finds ATC where it will run (llmpipe.export.atc.find_atc, the stage's own search):
    a convert_om.atc_path that is not an executable, or no ATC when convert_om.required is true, is
    refused before training instead of after it."""
    from llmpipe.export import atc

    try:
        found = atc.find_atc(cfg.convert_om)
    except StageError as err:
        raise ConfigError(str(err)) from None
    if found is None and cfg.convert_om.required:
        raise ConfigError(atc.required_but_missing())


def check_ort_builder(cfg: RunConfig) -> None:
    """export.ort_graph: onnxruntime-genai's builder (and what it imports) installed here, checked before
    training instead of at export_onnx."""
    from llmpipe.export import fused

    reason = fused.unavailable_reason()
    if reason:
        raise ConfigError(f"export.ort_graph: {reason}")


def check_evaluate(cfg: RunConfig) -> None:
    """evaluate.tasks' files (read and checked as the stage reads them) and evaluate.chat_questions (every line
    a conversation with a user question and an assistant answer): found before the hours of training the
    stage comes after, not when it runs. lm_eval's own task names are looked up when the stage runs (indexing
    lm_eval's registry takes longer than most checks here)."""
    from llmpipe.eval import tasks

    tasks.plan(cfg)
    if cfg.evaluate.chat_questions and cfg.data.format == "chat":
        tasks.question_records(Path(cfg.evaluate.chat_questions), render=lambda messages: "")  # the shape only


def _to_run(cfg: RunConfig, selected: list[str], force: bool) -> set[str]:
    """Which of train and convert_om a pipeline run will run: selected, and forced or not done (train
    also when prepare_data is not done: its new output would make train stale)."""
    wanted = {s for s in ("train", "convert_om") if s in selected}
    if force or not wanted:
        return wanted
    from llmpipe import stages

    fps = stages.fingerprints(cfg)
    done = {s for s in ("prepare_data", "train", "convert_om") if stages.state(cfg, s, fps[s], full=False)[0] == "done"}
    if {"prepare_data", "train"} <= done:
        wanted.discard("train")
    if "convert_om" in done:
        wanted.discard("convert_om")
    return wanted


def check_before_run(cfg: RunConfig, selected: list[str], force: bool, source: str = "config") -> None:
    """What this machine and the files a config names can tell, for the stages a pipeline run will run
    (`_to_run`): before training, `check_launch` and `check_resume`; before convert_om,
    `check_atc_present`. A run whose training is done, on a cluster say, goes on elsewhere without its
    launch settings (they are not in the fingerprint), and `--only benchmark` needs neither."""
    stages = _to_run(cfg, selected, force)
    try:
        if "train" in stages:
            check_launch(cfg)
            check_resume(cfg)
        if "convert_om" in stages:
            check_atc_present(cfg)
        if "export_onnx" in selected and cfg.export.ort_graph:
            check_ort_builder(cfg)
        if "evaluate" in selected:
            check_evaluate(cfg)
    except UserError as err:
        raise ConfigError(f"{source}: {err}") from None
