"""What a run config can tell about itself, checked before any stage runs.

`config.from_dict` runs these after every field has validated, so a config that cannot train fails
in a second instead of after prepare_data has read the whole corpus:

- `check_artifacts_dir`: run.artifacts_dir is a folder or can become one;
- `check_atc`: convert_om.soc_version a SoC ATC knows, convert_om.input_shape well formed, its -1
  dims given gears by dynamic_dims;
- `check_model`: the flavor exists and its overridden dimensions fit together, data.seq_len and
  export.kv_cache_len fit the model's max_seq_len, benchmark.llm's prompts fit the context the
  benchmark decodes in, and the parallel layout fits the model (tp divides heads, kv heads, ffn and
  dim; pp against the layers, split points and schedule; pipeline micro-batches) at the layout's own
  world size, so `plan` and `dryrun` can still try any --world-size.

`check_before_run` adds what depends on this machine, for the stages a pipeline run is about to run
(selected, and forced or not done): before training, `check_launch` (the hostfile readable, dp x tp
x pp against the world size the train stage will start: nproc_per_node x train.nodes, or x the
hostfile's hosts) and `check_resume` (an explicit train.checkpoint.resume holds this config's
model); before convert_om, `check_atc_present` (ATC found when convert_om.required is true).

Only the vocabulary waits for the data: the trained tokenizer may be smaller than
data.tokenizer.vocab_size, so tp against the vocabulary is checked by the train stage.

The checks are llmpipe.parallel.mesh's own (the ranks run them again at start). NOTE: they import
torch, so this module is imported lazily by config.py, which everything imports.
"""

from __future__ import annotations

import json
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
    """convert_om.soc_version one ATC knows, convert_om.input_shape well formed ('name:dims;name2:dims')
    and dynamic_dims consistent with it (llmpipe.export.atc's own rules), so an ATC argument error
    shows before training, not after."""
    om = cfg.convert_om
    from llmpipe.export.atc import check_dynamic_dims, check_soc_version

    try:
        check_soc_version(om.soc_version)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if om.input_shape is not None:
        specs = [s.strip() for s in om.input_shape.split(";")]
        for spec in specs:
            name, _, dims = spec.rpartition(":")  # input names may themselves contain ':'
            if not name or not all(_ATC_DIM_RE.match(d.strip()) for d in dims.split(",")):
                raise ConfigError(f"convert_om.input_shape: {spec!r} in {om.input_shape!r} is not "
                                  "'name:d1,d2,...' with sizes, -1 or lo~hi ranges")
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
    cache = cfg.export.kv_cache_len
    if cfg.export.static_decoder and cache is not None and cache > args.max_seq_len:
        raise ConfigError(f"export.kv_cache_len={cache} exceeds the model's max_seq_len={args.max_seq_len}")
    if cfg.model.init_from:  # Mistral's sliding window equals full attention only within the window
        from llmpipe.models.llama import hf

        try:
            window = hf.read_config(cfg.model.init_from, cfg.model.max_seq_len)[1]["sliding_window"]
            hf.pretrained(cfg.model, args)  # every weight present, shaped as config.json says (headers only)
        except hf.HFFolderError as err:
            raise ConfigError(f"model.init_from: {err}") from None
        if window is not None and cfg.data.seq_len > window:
            raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.init_from's sliding_window={window}, "
                              "which llmpipe's full attention does not implement")
    p = cfg.train.parallel
    _validate_layout(cfg, args, (p.dp or 1) * p.tp * p.pp)
    check_llm_bench(cfg, args)  # last, as the benchmark is the last stage


def check_llm_bench(cfg: RunConfig, args) -> None:
    """benchmark.llm's prompts (and, decoding, the new tokens) fit the context every engine decodes in:
    the static decoder's cache (export.kv_cache_len, null: min(max_seq_len, 1024)) when export_onnx
    writes one, else the model's max_seq_len (PyTorch's cache). The engines' own rule
    (llmpipe.bench.decode): a prompt fills its slots and the first new token is picked from its last
    one, so a static cache holds prompts shorter than itself; each later token takes one slot but the
    last, which is never fed back. Beyond it every engine's row is an error and the stage fails. The
    default prompt lengths are cut to those that fit (a model of a short context is no user error)."""
    from llmpipe.plan_deploy import cache_len  # not llmpipe.export.onnx's: that imports onnxruntime

    c = cfg.benchmark.llm
    if cfg.export.static_decoder:
        context = cache_len(cfg, args)
        where, longest = f"the static decoder's cache of {context} slots (export.kv_cache_len)", context - 1
    else:
        context, where, longest = args.max_seq_len, f"the model's max_seq_len={args.max_seq_len}", args.max_seq_len
    too_long = [n for n in c.prompt_lens if n > longest]
    if too_long and "prompt_lens" not in c.model_fields_set:  # the defaults, for a short context: those that fit
        c.prompt_lens = [n for n in c.prompt_lens if n <= longest] or [longest]
        too_long = []
    if too_long:
        raise ConfigError(f"benchmark.llm.prompt_lens: {too_long[0]} does not fit {where}: prompts up to "
                          f"{longest} tokens")
    if c.decode_prompt_len + c.new_tokens - 1 > context:
        raise ConfigError(f"benchmark.llm: decode_prompt_len={c.decode_prompt_len} + new_tokens={c.new_tokens} "
                          f"does not fit {where}: their sum can be at most {context + 1}")


MAX_HOSTFILE_BYTES = 1 << 20  # a line per node: 4096 nodes take ~100 KB


def _hostfile_nodes(cfg: RunConfig) -> int:
    """Hosts in train.hostfile, read as the launcher reads it; ConfigError naming it when it cannot be."""
    from llmpipe.stages import StageError
    from llmpipe.train.stage import _hosts  # the launcher's own reading of the hostfile

    path = Path(cfg.train.hostfile)
    try:
        if path.is_file() and path.stat().st_size > MAX_HOSTFILE_BYTES:  # it is read whole
            raise ConfigError(f"train.hostfile: {path} is over {MAX_HOSTFILE_BYTES >> 20} MiB, not a hostfile")
        return len(_hosts(cfg))
    except StageError as err:
        raise ConfigError(str(err)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"train.hostfile: {path} is not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"train.hostfile: {path}: {(err.strerror or str(err)).lower()}") from None


def launch_world(cfg: RunConfig) -> tuple[int, int] | None:
    """(world size, nodes) of the train stage's launch: nproc_per_node x train.nodes under torchrun,
    x the hostfile's hosts under DeepSpeed's launcher; None when the hostfile cannot be read here
    (`check_launch` refuses that before a run trains; a fingerprint or `--only benchmark` on another
    machine needs none)."""
    if cfg.train.hostfile is None:
        return cfg.train.nproc_per_node * cfg.train.nodes, cfg.train.nodes
    try:
        nodes = _hostfile_nodes(cfg)
    except ConfigError:
        return None
    return cfg.train.nproc_per_node * nodes, nodes


def check_launch(cfg: RunConfig) -> None:
    """The hostfile readable, and dp x tp x pp against the world size the train stage will launch."""
    t = cfg.train
    nodes = t.nodes if t.hostfile is None else _hostfile_nodes(cfg)  # missing: named now, not after prepare_data
    world = t.nproc_per_node * nodes
    if cfg.train.compile:
        from llmpipe import device as dev

        try:
            dev.compile_backend(dev.resolve(cfg.run.device))
        except RuntimeError as err:
            raise ConfigError(str(err)) from None
    _validate_layout(cfg, _model_args(cfg), world,
                     f" (world size {world} = nproc_per_node {cfg.train.nproc_per_node} x {nodes} node(s))")


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
    mine = _model_args(cfg).to_dict()
    differ = [f"{k} {recorded[k]!r} (config {mine[k]!r})" for k in mine
              if k != "vocab_size" and k in recorded and recorded[k] != mine[k]]
    if differ:
        raise ConfigError(f"train.checkpoint.resume: {r} holds another model than the config's: {', '.join(differ)}")


def check_atc_present(cfg: RunConfig) -> None:
    """convert_om finds ATC where it will run (llmpipe.export.atc.find_atc, the stage's own search):
    a convert_om.atc_path that is not an executable, or no ATC when convert_om.required is true, is
    refused before training instead of after it."""
    from llmpipe.export import atc
    from llmpipe.stages import StageError

    try:
        found = atc.find_atc(cfg.convert_om)
    except StageError as err:
        raise ConfigError(str(err)) from None
    if found is None and cfg.convert_om.required:
        raise ConfigError(atc.required_but_missing())


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
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
