"""What a run config can tell about itself, checked before any stage runs.

`config.from_dict` runs these after every field has validated, so a config that cannot train fails
in a second instead of after prepare_data has read the whole corpus:

- `check_artifacts_dir`: run.artifacts_dir is a folder or can become one;
- `check_atc`: convert_om.input_shape well formed, its -1 dims given gears by dynamic_dims;
- `check_model`: the flavor exists and its overridden dimensions fit together, data.seq_len fits the
  model's max_seq_len, and the parallel layout fits the model (tp divides heads, kv heads, ffn and
  dim; pp against the layers, split points and schedule; pipeline micro-batches) at the layout's own
  world size, so `plan` and `dryrun` can still try any --world-size.

`check_before_run` adds `check_launch` (dp x tp x pp against the world size the train stage will
start: nproc_per_node x train.nodes, or x the hostfile's hosts) when a pipeline run is about to train.

Only the vocabulary waits for the data: the trained tokenizer may be smaller than
data.tokenizer.vocab_size, so tp against the vocabulary is checked by the train stage.

The checks are llmpipe.parallel.mesh's own (the ranks run them again at start). NOTE: they import
torch, so this module is imported lazily by config.py, which everything imports.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmpipe.config import ConfigError, RunConfig

# One dim of ATC's --input_shape: a size, -1 (dynamic: dynamic_dims gives the gears), or a range lo~hi
_ATC_DIM_RE = re.compile(r"^(-1|[1-9][0-9]*(~([1-9][0-9]*|-1))?)$")


def check_artifacts_dir(path: str) -> None:
    """run.artifacts_dir must be a folder or creatable as one: neither it nor a parent is a file."""
    for folder in (p := Path(os.path.abspath(path)), *p.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "" if folder == p else f" ({folder} is a file)"
                raise ConfigError(f"run.artifacts_dir: {path!r} is not a folder{where}")
            return


def check_atc(cfg: RunConfig) -> None:
    """convert_om.input_shape well formed ('name:dims;name2:dims') and dynamic_dims consistent with
    it (llmpipe.export.atc's own rule), so an ATC argument error shows before training, not after."""
    om = cfg.convert_om
    if om.input_shape is not None:
        specs = [s.strip() for s in om.input_shape.split(";")]
        for spec in specs:
            name, _, dims = spec.rpartition(":")  # input names may themselves contain ':'
            if not name or not all(_ATC_DIM_RE.match(d.strip()) for d in dims.split(",")):
                raise ConfigError(f"convert_om.input_shape: {spec!r} in {om.input_shape!r} is not "
                                  "'name:d1,d2,...' with sizes, -1 or lo~hi ranges")
    from llmpipe.export.atc import check_dynamic_dims

    try:
        check_dynamic_dims(om.input_shape, om.dynamic_dims)  # -1 dims need gears, one value per -1 dim
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _model_args(cfg: RunConfig):
    """ModelArgs of the config's model, with a stand-in vocabulary every tp divides (the real one
    comes from the tokenizer)."""
    from llmpipe.models.llama import model_args

    try:
        return model_args(cfg.model, vocab_size=cfg.train.parallel.tp)
    except ValueError as err:  # unknown flavor, or overrides that do not fit (dim vs heads ...)
        raise ConfigError(str(err)) from None


def _validate_layout(cfg: RunConfig, args, world: int, where: str = "") -> None:
    from llmpipe.parallel import mesh

    p = cfg.train.parallel
    try:
        mesh.validate(p, args, world, cfg.train.micro_batch_size)
        if p.tp > 1 or p.pp > 1:
            from llmpipe.parallel.mesh import check_supported

            # the requested dtype: "auto" never resolves to fp16, the one precision refused here
            check_supported(cfg, cfg.train.precision.dtype)
    except mesh.LayoutError as err:
        prefix = "" if str(err).startswith("train.") else "train.parallel: "  # some name their own field
        raise ConfigError(f"{prefix}{err}{where}") from None


def check_model(cfg: RunConfig) -> None:
    """Model and layout checks that hold at any world size; raises ConfigError naming the field."""
    args = _model_args(cfg)
    if cfg.data.seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len={args.max_seq_len}")
    if cfg.model.init_from:  # Mistral's sliding window equals full attention only within the window
        from llmpipe.models.llama import hf

        try:
            window = hf.read_config(cfg.model.init_from)[1]["sliding_window"]
            hf.pretrained(cfg.model, args)  # every weight present, shaped as config.json says (headers only)
        except hf.HFFolderError as err:
            raise ConfigError(f"model.init_from: {err}") from None
        if window is not None and cfg.data.seq_len > window:
            raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.init_from's sliding_window={window}, "
                              "which llmpipe's full attention does not implement")
    p = cfg.train.parallel
    _validate_layout(cfg, args, (p.dp or 1) * p.tp * p.pp)


def launch_world(cfg: RunConfig) -> tuple[int, int] | None:
    """(world size, nodes) of the train stage's launch: nproc_per_node x train.nodes under torchrun,
    x the hostfile's hosts under DeepSpeed's launcher; None when the hostfile cannot be read here
    (the train stage then names it; `--only benchmark` on another machine needs none)."""
    if cfg.train.hostfile is None:
        return cfg.train.nproc_per_node * cfg.train.nodes, cfg.train.nodes
    from llmpipe.stages import StageError
    from llmpipe.train.stage import _hosts  # the launcher's own reading of the hostfile

    try:
        nodes = len(_hosts(cfg))
    except (StageError, OSError):
        return None
    return cfg.train.nproc_per_node * nodes, nodes


def check_launch(cfg: RunConfig) -> None:
    """dp x tp x pp against the world size the train stage will launch."""
    launch = launch_world(cfg)
    if launch is None:
        return
    world, nodes = launch
    if cfg.train.compile:
        from llmpipe import device as dev

        try:
            dev.compile_backend(dev.resolve(cfg.run.device))
        except RuntimeError as err:
            raise ConfigError(str(err)) from None
    _validate_layout(cfg, _model_args(cfg), world,
                     f" (world size {world} = nproc_per_node {cfg.train.nproc_per_node} x {nodes} node(s))")


def check_before_run(cfg: RunConfig, selected: list[str], force: bool, source: str = "config") -> None:
    """`check_launch` for a pipeline run that will start the train stage: train is selected, and forced
    or not done (nor prepare_data, whose new output would make it stale). A run whose training is done,
    on a cluster say, goes on elsewhere without its launch settings (they are not in the fingerprint)."""
    if "train" not in selected:
        return
    if not force:
        from llmpipe import stages

        fps = stages.fingerprints(cfg)
        if all(stages.state(cfg, s, fps[s], full=False)[0] == "done" for s in ("prepare_data", "train")):
            return
    try:
        check_launch(cfg)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
