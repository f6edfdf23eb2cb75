"""The consolidate stage: newest training checkpoint -> one self-describing model folder.

    model.safetensors   weights in llmpipe names (fp32 or bf16)
    model_config.json   architecture (ModelArgs) and dtype
    tokenizer.json      the tokenizer the model was trained with
    chat_template.jinja the chat template training rendered the conversations with (chat runs)
    hf/                 the same weights under Hugging Face Llama names + config.json + tokenizer.json,
                        tokenizer_config.json (special tokens, the chat template), special_tokens_map.json
                        and generation_config.json (llmpipe.models.llama.hf_files): what transformers'
                        AutoTokenizer / LlamaForCausalLM, vLLM and TGI load as it is
    adapter/            LoRA runs (train.lora): the adapter alone in PEFT's folder format; the two
                        weight files above hold the merged model, W + alpha/rank B A (checkpoint.adapter)

The chat template is training's (prepare_data's chat_template.jinja), checked against the digest
prepare_data recorded and recorded again in this stage's metrics (llmpipe.checkpoint.template_digest).

Tensors are streamed one at a time from the checkpoint to the output file.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from llmpipe import device as dev
from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint.adapter import Merge
from llmpipe.checkpoint.dcp import consolidate_dcp
from llmpipe.checkpoint.stream import write_streaming
from llmpipe.checkpoint.template_digest import METRIC, RENDER, TEMPLATE_FILE, digest, mismatch, read_template
from llmpipe.checkpoint.zero import consolidate_zero
from llmpipe.manifest import sha256_file
from llmpipe.models.llama import hf
from llmpipe.models.llama import io as model_io
from llmpipe.models.llama.hf_files import GENERATION_CONFIG, TOKENIZER_CONFIG, hf_files, read_carried, write_hf_files
from llmpipe.models.llama.lora import LoraSpec
from llmpipe.models.llama.model import ModelArgs
from llmpipe.stages import StageContext, StageError, StageResult

log = logging.getLogger("llmpipe.consolidate")


def consolidate(checkpoint: Path, out_dir: Path, dtype_name: str, rename=lambda n: n,
                filename: str = model_io.WEIGHTS, transform=None) -> dict:
    """Stream a full checkpoint's model.safetensors into out_dir/filename with names mapped by `rename`;
    `transform(shapes, load) -> (shapes, load)`, when given, maps the stored tensors (by llmpipe name)
    to those written (LoRA: the adapters merged). Every format's consolidator takes the same arguments."""
    dtype = dev.dtype(dtype_name)
    src = Path(checkpoint) / ckpt.MODEL
    with safe_open(str(src), framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in sorted(f.keys())}
        load = f.get_tensor
        if transform is not None:
            shapes, load = transform(shapes, load)
        specs = [(rename(n), s, dtype) for n, s in shapes.items()]
        lookup = dict(zip((s[0] for s in specs), shapes))
        write_streaming(out_dir / filename, specs, lambda name: load(lookup[name]).to(dtype),
                        metadata={"format": "pt"})
    return {"tensors": len(specs), "params": sum(torch.Size(s[1]).numel() for s in specs)}


# checkpoint format (meta.json "format", a Strategy's `format`) -> the function that streams its weights
CONSOLIDATORS = {"full": consolidate, "dcp": consolidate_dcp, "deepspeed": consolidate_zero}


def run(ctx: StageContext) -> StageResult:
    cfg, out = ctx.cfg.consolidate, ctx.work_dir
    checkpoint = ctx.input_path("train", f"checkpoint/{ckpt.META}").parent  # meta.json: in every format
    problem = ckpt.verify(checkpoint)
    if problem:
        raise StageError(f"consolidate: training checkpoint is not usable: {problem}")
    meta = ckpt.read_meta(checkpoint)
    if meta.get("format") not in CONSOLIDATORS:
        raise StageError(f"consolidate: unsupported checkpoint format {meta.get('format')!r} in {checkpoint}")
    consolidate_fn = CONSOLIDATORS[meta["format"]]
    args = ModelArgs(**meta["model"])
    spec = LoraSpec.of(meta.get("lora"))  # the checkpoint's own record: what was trained
    merge = Merge(spec) if spec is not None else None
    stats = consolidate_fn(checkpoint, out, cfg.dtype, transform=merge)
    model_io.write_args(out, args, cfg.dtype)
    tokenizer = ctx.input_path("prepare_data", "tokenizer")
    shutil.copyfile(tokenizer, out / model_io.TOKENIZER)
    outputs = {"model": model_io.WEIGHTS, "model_config": model_io.CONFIG, "tokenizer": model_io.TOKENIZER}
    template = training_template(ctx)
    data_meta = json.loads(ctx.input_path("prepare_data", "meta").read_text())
    eos_token = data_meta.get("eos_token") or ctx.cfg.data.tokenizer.eos_token
    metrics = {**stats, "step": meta["step"], "dtype": cfg.dtype}
    if template is not None:
        (out / TEMPLATE_FILE).write_text(template, encoding="utf-8")
        outputs["chat_template"] = TEMPLATE_FILE
        chat = data_meta.get("chat") or {}  # what training rendered the conversations with
        metrics[METRIC] = digest(template)
        metrics[RENDER] = {"bos_token": chat.get("bos_token", ""), "eos_token": chat.get("eos_token", eos_token)}
    if cfg.hf_layout:
        (out / "hf").mkdir()
        consolidate_fn(checkpoint, out / "hf", cfg.dtype, rename=hf.to_hf_name, transform=hf_transform(args, merge))
        (out / "hf" / "config.json").write_text(json.dumps(hf_config_json(args, cfg.dtype, data_meta.get("eos_id"),
                                                                          ctx.cfg.model.init_from), indent=2) + "\n")
        shutil.copyfile(tokenizer, out / "hf" / model_io.TOKENIZER)
        write_hf_files(out / "hf", folder_files(tokenizer, eos_token, args, template, ctx.cfg.model.init_from))
        outputs["hf"] = "hf"
    if merge is not None:
        merge.write_adapter(out, ctx.cfg.model.init_from)
        outputs["adapter"] = "adapter"
        metrics["lora"] = {**spec.to_dict(), "adapter_params": sum(t.numel() for t in merge.adapters.values())}
    log.info("consolidated step %d (%d tensors, %.2fM params) -> %s", meta["step"], stats["tensors"],
             stats["params"] / 1e6, out)
    return StageResult(outputs=outputs, metrics={**metrics, "bytes": (out / model_io.WEIGHTS).stat().st_size})


def hf_config_json(args: ModelArgs, dtype: str, eos_id: int | None, init_from: str | None) -> dict:
    """hf/config.json: a model fine-tuned from model.init_from comes out as the source's family (architecture
    class, model_type, special-token ids, RoPE fields, head_dim, bias, tying); one llmpipe pre-trained as
    LlamaForCausalLM (or the family of its options) with the run's eos id."""
    if not init_from:
        return hf.hf_config(args, dtype, eos_id)
    try:
        return hf.source_hf_config(init_from, args, dtype)
    except hf.HFFolderError as err:
        raise StageError(f"consolidate: model.init_from: {err}") from None


def hf_transform(args: ModelArgs, merge):
    """consolidate's transform for hf/: LoRA's merge, and a tied model's head left out (it is the
    embedding; transformers ties lm_head to embed_tokens on load) should a checkpoint carry it."""
    if not args.tie_embeddings:
        return merge

    def drop_head(shapes, load):
        if merge is not None:
            shapes, load = merge(shapes, load)
        return {n: s for n, s in shapes.items() if n != "output.weight"}, load
    return drop_head


def training_template(ctx: StageContext) -> str | None:
    """prepare_data's chat template (None for a text run), checked against the digest it recorded."""
    folder, manifest = ctx.inputs["prepare_data"]
    path = folder / TEMPLATE_FILE
    source = read_template(path) if path.is_file() else None
    if digest(source) != manifest.metrics.get(METRIC):
        raise mismatch(path, digest(source), manifest.metrics.get(METRIC))
    return source


def folder_files(tokenizer: Path, eos_token: str, args: ModelArgs, template: str | None,
                 init_from: str | None) -> dict[str, dict]:
    """hf/'s tokenizer_config.json, special_tokens_map.json and generation_config.json for the run's
    tokenizer, its chat template and model.init_from's own files (carried over, checked)."""
    from llmpipe.data.tokenizer import load_tokenizer

    end_of_turn: list[str] = []
    if template is not None:
        from llmpipe.chat.template import load_template

        end_of_turn = load_template(template, TEMPLATE_FILE).end_of_turn
    try:
        return hf_files(load_tokenizer(tokenizer), eos_token, args.max_seq_len, template, end_of_turn,
                        read_carried(init_from, args.vocab_size))
    except hf.HFFolderError as err:
        raise StageError(f"consolidate: model.init_from: {err}") from None


def fingerprint_extra(cfg) -> dict:
    """What consolidate reads besides its inputs: model.init_from's tokenizer_config.json and
    generation_config.json, whose values hf/ carries over (their sha256; {} without init_from)."""
    if not cfg.model.init_from:
        return {}
    out = {}
    for name in (TOKENIZER_CONFIG, GENERATION_CONFIG):
        path = Path(cfg.model.init_from) / name
        out[name] = sha256_file(path) if path.is_file() else None
    return {"init_from": out}
