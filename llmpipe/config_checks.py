"""What a run config can tell about itself, checked when it loads (before any stage runs).

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

What depends on this machine (the launch world, the resume checkpoint, ATC present) is
llmpipe.preflight's, for the stages a run is about to run.

Only the vocabulary waits for the data: the trained tokenizer may be smaller than
data.tokenizer.vocab_size, so tp against the vocabulary is checked by the train stage.

The checks are llmpipe.parallel.mesh's own (the ranks run them again at start). NOTE: they import
torch, so this module is imported lazily by config.py, which everything imports; it imports only
modules below config (errors, models, parallel.mesh, export.atc_args, infer.graphs), never config
itself, so no import circle runs through it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from llmpipe.errors import ConfigError

if TYPE_CHECKING:
    from llmpipe.config import RunConfig

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


# MLflow's tracking-store schemes (a plugin adds more through the `mlflow.tracking_store` entry points). An
# empty scheme is a local folder (a file store).
TRACKING_SCHEMES = ("file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc",
                    "uc")


def _tracking_schemes() -> set[str]:
    """The store schemes MLflow takes: its own, and any a plugin registers (entry points; no mlflow import)."""
    from importlib.metadata import entry_points

    return {*TRACKING_SCHEMES, *(e.name for e in entry_points(group="mlflow.tracking_store"))}


def check_tracking(section) -> None:
    """tracking.mlflow: a tracking URI MLflow has a store for, and a model name its registry accepts.
    NOTE: the name rule is mlflow.utils.validation._validate_model_name's (not empty; no '/' or ':'; a
    normalised path equal to itself), repeated here because importing mlflow takes seconds."""
    import posixpath
    from urllib.parse import urlparse

    if section.tracking_uri is not None:
        scheme = urlparse(section.tracking_uri).scheme.split("+")[0]
        if len(scheme) > 1 and scheme not in _tracking_schemes():  # one letter: a Windows drive
            raise ConfigError(f"tracking.mlflow.tracking_uri: {section.tracking_uri!r} has the scheme {scheme!r}, "
                              "which MLflow has no store for (http, https, sqlite, file, postgresql, mysql, ...)")
    name = section.model_name
    if name is not None:
        norm = posixpath.normpath(name)
        if not name.strip() or "/" in name or ":" in name or norm != name or norm == "." or norm.startswith(".."):
            raise ConfigError(f"tracking.mlflow.model_name: {name!r} is refused by MLflow's registry (not empty, "
                              "no '/' or ':', no '..' or '.')")
    for field in ("experiment",):
        value = getattr(section, field)
        if value is not None and not value.strip():
            raise ConfigError(f"tracking.mlflow.{field}: must not be empty")


def check_atc(cfg: RunConfig) -> None:
    """convert_om.soc_version one ATC knows, convert_om.input_shape well formed ('name:dims;name2:dims')
    and dynamic_dims consistent with it (llmpipe.export.atc's own rules), so an ATC argument error
    shows before training, not after."""
    om = cfg.convert_om
    from llmpipe.export.atc_args import check_dynamic_dims, check_soc_version

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


def config_model_args(cfg: RunConfig):
    """ModelArgs of the config's model, with a stand-in vocabulary every tp divides (the real one
    comes from the tokenizer)."""
    from llmpipe.models.llama import model_args

    try:
        return model_args(cfg.model, vocab_size=cfg.train.parallel.tp)
    except ValueError as err:  # unknown flavor, or overrides that do not fit (dim vs heads ...)
        raise ConfigError(str(err)) from None


def validate_layout(cfg: RunConfig, args, world: int, where: str = "") -> None:
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


def check_chat(cfg: RunConfig) -> None:
    """data.format: chat: a chat template that loads (model.init_from's, else data.chat_template: a built-in
    name or a .jinja file; sandboxed, renders, supports add_generation_prompt), and packing only where the
    layout carries its mask (not through pipeline stages)."""
    from llmpipe.chat.template import TemplateError, resolve_template

    d = cfg.data
    if d.format != "chat":
        return
    try:
        found = resolve_template(cfg.model.init_from, d.chat_template)
    except TemplateError as err:
        where = "model.init_from" if cfg.model.init_from and str(err).find(str(cfg.model.init_from)) >= 0 else \
            "data.chat_template"
        raise ConfigError(f"{where}: {err}") from None
    if found is None:
        raise ConfigError("data.chat_template: data.format is chat but there is no chat template (model.init_from "
                          "has none; set a built-in name, chatml or llama3, or a .jinja file)")
    if d.packing and cfg.train.parallel.pp > 1:
        raise ConfigError(f"data.packing: packed conversations need a block-causal mask that pipeline stages "
                          f"do not carry (train.parallel.pp={cfg.train.parallel.pp}); set data.packing: false "
                          "or pp: 1")


def check_model(cfg: RunConfig) -> None:
    """Model and layout checks that hold at any world size; raises ConfigError naming the field."""
    check_chat(cfg)
    args = config_model_args(cfg)
    if cfg.data.seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len={args.max_seq_len}")
    cache = cfg.export.kv_cache_len
    if cfg.export.static_decoder and cache is not None and cache > args.max_seq_len:
        raise ConfigError(f"export.kv_cache_len={cache} exceeds the model's max_seq_len={args.max_seq_len}")
    if cfg.export.ort_graph and not cfg.consolidate.hf_layout:
        raise ConfigError("export.ort_graph: the builder reads consolidate's hf/ folder (set consolidate.hf_layout: "
                          "true)")
    if cfg.export.ort_graph:  # the builder quantizes int4 / int8w's ORT-optimised graphs at these settings
        from llmpipe.export.fused import BUILDER_BLOCK_SIZES, ORT_VARIANTS

        for name in (n for n in ORT_VARIANTS if n in cfg.benchmark.variants):
            q = getattr(cfg.benchmark.quantize, name)
            field, block = ("ort_block_size", q.ort_block_size) if q.ort_block_size else ("block_size", q.block_size)
            if q.bits in (4, 8) and block not in BUILDER_BLOCK_SIZES:
                raise ConfigError(f"benchmark.quantize.{name}.{field}={block}: onnxruntime-genai's "
                                  f"builder, which makes {name}'s ORT-optimised graph (export.ort_graph), takes "
                                  f"{', '.join(map(str, BUILDER_BLOCK_SIZES))}")
            if q.bits in (4, 8) and q.accuracy_level == 0:
                raise ConfigError(f"benchmark.quantize.{name}.accuracy_level=0: onnxruntime-genai's builder, which "
                                  f"makes {name}'s ORT-optimised graph (export.ort_graph), takes 1 to 4")
    for name in ("int4", "int8w"):
        q = getattr(cfg.benchmark.quantize, name)
        if q.adapter != "separate" or name not in cfg.benchmark.variants:
            continue
        if not cfg.export.ort_graph:
            raise ConfigError(f"benchmark.quantize.{name}.adapter: separate is the ORT-optimised graph's (set "
                              "export.ort_graph: true); the portable graphs stay merged")
        block = q.ort_block_size or q.block_size
        widths = {"model dim": args.dim, "n_heads x head_dim": args.n_heads * args.head_dim, "ffn_dim": args.ffn_dim}
        uneven = [f"{k}={v}" for k, v in widths.items() if v % block]
        if uneven:  # the fold (and so the adapter's rows) needs each projection's input in whole blocks
            raise ConfigError(f"benchmark.quantize.{name}.adapter: separate needs every projection's input in whole "
                              f"blocks of {block}; the model has {', '.join(uneven)}")
    if cfg.model.init_from:  # config.json (its family's refusals, a sliding window in effect) was read above
        from llmpipe.models.llama import hf, hf_files

        try:
            hf.pretrained(cfg.model, args)  # every weight present, shaped as config.json says (headers only)
            hf_files.read_carried(cfg.model.init_from, args.vocab_size)  # what consolidate's hf/ carries over
        except hf.HFFolderError as err:
            raise ConfigError(f"model.init_from: {err}") from None
    p = cfg.train.parallel
    if cfg.train.lora is not None and (p.tp > 1 or p.pp > 1):
        # NOTE: tensor parallel would have to shard each adapter with its base layer (A with a row-wise
        # layer, B with a column-wise one) and the pipeline's stages to carry them; not built yet.
        raise ConfigError(f"train.lora: LoRA trains with data parallelism only (ddp, fsdp, zero), not with "
                          f"train.parallel.tp={p.tp} x pp={p.pp}; set both to 1")
    if cfg.train.lora is not None and cfg.train.lora.dropout > 0 and cfg.train.activation_checkpointing:
        # NOTE: the blocks are recomputed without replaying the RNG (preserve_rng_state=False), so the
        # recomputed dropout masks would not be the forward's and the adapters' gradients would be wrong
        raise ConfigError(f"train.lora.dropout={cfg.train.lora.dropout} does not work with "
                          "train.activation_checkpointing (its recompute draws other dropout masks); "
                          "set one of them to 0 / false")
    validate_layout(cfg, args, (p.dp or 1) * p.tp * p.pp)
    check_llm_bench(cfg, args)  # last, as the benchmark is the last stage


def check_llm_bench(cfg: RunConfig, args) -> None:
    """benchmark.llm's prompts (and, decoding, the new tokens) fit the context every engine decodes in:
    the static decoder's cache (export.kv_cache_len, null: min(max_seq_len, 1024)) when export_onnx
    writes one, else the model's max_seq_len (PyTorch's cache). The engines' own rule
    (llmpipe.infer.decode): a prompt fills its slots and the first new token is picked from its last
    one, so a static cache holds prompts shorter than itself; each later token takes one slot but the
    last, which is never fed back. Beyond it every engine's row is an error and the stage fails. The
    default prompt lengths are cut to those that fit (a model of a short context is no user error)."""
    from llmpipe.infer.graphs import DEFAULT_CACHE_LEN

    c = cfg.benchmark.llm
    if cfg.export.static_decoder:
        context = cfg.export.kv_cache_len or min(args.max_seq_len, DEFAULT_CACHE_LEN)
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


