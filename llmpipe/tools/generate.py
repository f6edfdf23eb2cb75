"""`llmpipe generate RUN --prompt TEXT`: text from a finished run, streamed as it is produced.
`llmpipe generate RUN --chat QUESTION [--system TEXT]`: a chat run's answer, and only the answer.

The run's tokenizer (consolidate's tokenizer.json) and one model variant:

    torch   the consolidated weights in PyTorch eager (Transformer.forward_cached)
    fp32    export_onnx's ort/ graph (export.ort_graph: onnxruntime-genai's builder, fused attention over the
            filled cache) in onnxruntime, else its model.onnx + decoder_static.onnx
    fp16    the benchmark stage's FP16 variants of both graphs (benchmark/variants/fp16/)
    int8    the benchmark stage's dynamic-INT8 variants (benchmark/variants/int8/)
    int4 / int8w / int8s  the benchmark stage's weight-only int4 / int8 (MatMulNBits) and static
            calibrated int8 variants (benchmark/variants/<name>/; benchmark.quantize); int4 and int8w
            through their ORT-optimised graph (benchmark/variants/<name>/ort/) when the run has one
    om      convert_om's model.om + decoder.om through ais_bench (where CANN and an NPU exist)

Every file read is first checked against its stage's manifest (size and sha256), and every graph
against what the decoding engine feeds and reads (llmpipe.infer.decode.graph_contract: a graph that
matches a rewritten manifest is still refused when it is not the one export_onnx makes). The options
are checked before anything is loaded (`check_options`, a ConfigError naming the option).

The chat template is checked first of all, whatever the mode: every copy the chosen variant comes with
(consolidate's chat_template.jinja and hf/tokenizer_config.json, export_onnx's chat_template.jinja)
against training's digest (llmpipe.checkpoint.template_digest), so a drifted template is refused in one
line before any model loads. --chat renders the system message (if any) and the question with the
template and its generation prompt, with the bos/eos tokens training rendered with; generation stops at
eos or an end-of-turn token (the template's end-of-turn strings that are one token), or when the text
shows an end-of-turn string; only the answer is printed (the closing numbers go to stderr).
"""

from __future__ import annotations

import io
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import numpy as np

from llmpipe.config import ConfigError
from llmpipe.errors import UserError
from llmpipe.export.fused import ORT_VARIANTS

VARIANTS = ("torch", "fp32", "fp16", "int8", "int4", "int8w", "int8s", "om")
ORT_GRAPH = "ort_graph/model.onnx"  # export_onnx's ORT-optimised graph (export.ort_graph), fp32 runs it
log = logging.getLogger("llmpipe.generate")
MAX_THREADS = 1024  # --threads: above any machine's cores; bounds the threads a typo makes onnxruntime start


class GenerateError(UserError):
    """A run that cannot generate (a stage missing, a file changed), or a prompt that does not fit."""


@dataclass
class Loaded:
    engine: object
    tokenizer: object
    eos_ids: list[int]  # what ends a generation: the run's eos token(s)
    describe: str


def _stage(run_dir: Path, name: str, output: str, why: str) -> tuple[Path, object]:
    """(stage folder, manifest) of a completed stage whose files verify."""
    from llmpipe.manifest import Manifest
    from llmpipe.stages import stage_dir

    folder = stage_dir(run_dir, name)
    manifest = Manifest.read(folder)
    if manifest is None or manifest.status != "completed" or output not in manifest.outputs:
        raise GenerateError(f"{run_dir}: stage {name} has not completed with {output!r}; {why}")
    problem = manifest.verify(folder)
    if problem:
        raise GenerateError(f"{folder}: {problem}; refusing to use it (re-run the stage)")
    return folder, manifest


def _check_graph(path: Path, session, kind: str, args, length: int) -> None:
    from llmpipe.infer.decode import graph_problem

    problem = graph_problem(session, kind, args, length)
    if problem:
        what = "prefill" if kind == "prefill" else f"static decoder (cache of {length})"
        raise GenerateError(f"{path}: not the {what} graph export_onnx makes for this model: {problem}; "
                            "refusing to use it")


def _sessions(prefill: Path, decoder: Path, threads: int | None, args, length: int):
    from llmpipe import device
    from llmpipe.export.onnx import check_external_data
    from llmpipe.infer.ort import create_session

    cpu = device.ort_providers(["cpu"])[0]
    sessions = []
    for path, kind in ((prefill, "prefill"), (decoder, "decoder")):
        check_external_data(path)
        sessions.append(create_session(path, cpu, threads))
        _check_graph(path, sessions[-1], kind, args, length)
    return sessions


def _cache_len(folder: Path, manifest) -> int:
    length = manifest.metrics.get("static_decoder_cache_len")
    if type(length) is not int or length < 1:
        raise GenerateError(f"{folder}: the manifest's static_decoder_cache_len is {length!r}, not a positive "
                            "integer; refusing to use it (re-run export_onnx)")
    return length


def _eos_ids(consolidated: Path, tokenizer, vocab_size: int) -> list[int]:
    """The run's eos ids as consolidate wrote them for transformers (hf/generation_config.json: training's
    eos, a model.init_from folder's, the chat template's end-of-turn), else llmpipe's own eos token."""
    from llmpipe.models.llama.hf_files import read_carried

    try:
        ids = read_carried(consolidated / "hf", vocab_size).ids.get("eos_token_id")
    except UserError as err:
        raise GenerateError(str(err)) from None
    if ids:
        return ids
    own = tokenizer.token_to_id("<|endoftext|>")
    return [own] if own is not None else []


def open_run(run_dir: Path, variant: str, threads: int | None = None, ort_graph: bool = True) -> Loaded:
    """The tokenizer and a decoding engine of `variant` for the finished run in `run_dir`. `ort_graph`: fp32 runs
    export_onnx's ort/ graph when there is one (False: the portable graphs, whose StaticEngine serve batches)."""
    import torch

    from llmpipe.data.tokenizer import load_tokenizer
    from llmpipe.infer.decode import StaticEngine, TorchEngine
    from llmpipe.models.llama.io import TOKENIZER, load_model, read_args

    if variant not in VARIANTS:
        raise GenerateError(f"--variant: {variant!r} is not one of {', '.join(VARIANTS)}")
    consolidated, _ = _stage(run_dir, "consolidate", "model", "run the pipeline first")
    tokenizer = load_tokenizer(consolidated / TOKENIZER)
    try:
        args = read_args(consolidated)
    except ValueError as err:
        raise GenerateError(str(err)) from None
    eos = _eos_ids(consolidated, tokenizer, args.vocab_size)
    if threads:
        torch.set_num_threads(threads)
    if variant == "torch":
        return Loaded(TorchEngine(load_model(consolidated, dtype=torch.float32)), tokenizer, eos,
                      "PyTorch eager, fp32, KV cache")
    if variant == "om":
        return Loaded(_om_engine(run_dir, args), tokenizer, eos, "OM through ais_bench")
    folder, manifest = _stage(run_dir, "export_onnx", "decoder_static",
                              "export it with export.static_decoder: true")
    length = _cache_len(folder, manifest)
    if variant == "fp32" and ort_graph and ORT_GRAPH in manifest.outputs:
        return Loaded(_fused_engine(manifest.path(folder, ORT_GRAPH).parent, threads, args, length), tokenizer, eos,
                      f"onnxruntime fp32, ORT-optimised graph (export_onnx's ort/), KV cache of {length}")
    if variant in ORT_VARIANTS and ort_graph:
        bench, bm = _stage(run_dir, "benchmark", "results", f"the benchmark stage makes the {variant} variant")
        if f"variants/{variant}/ort/model.onnx" in bm.outputs:
            return Loaded(_fused_engine(bench / "variants" / variant / "ort", threads, args, length), tokenizer, eos,
                          f"onnxruntime {variant}, ORT-optimised graph (benchmark/variants/{variant}/ort/), "
                          f"KV cache of {length}")
    if variant == "fp32":
        prefill, decoder = manifest.path(folder, "model"), manifest.path(folder, "decoder_static")
    else:
        bench, bm = _stage(run_dir, "benchmark", "results", f"the benchmark stage makes the {variant} variant")
        prefill = bench / "variants" / variant / "model.onnx"
        decoder = bench / "variants" / variant / "decoder_static.onnx"
        if not decoder.is_file() or not prefill.is_file():
            raise GenerateError(f"{bench}: no {variant} variant of both graphs (is {variant} in "
                                "benchmark.variants?)")
    return Loaded(StaticEngine(*_sessions(prefill, decoder, threads, args, length), args, length), tokenizer, eos,
                  f"onnxruntime {variant}, static KV cache of {length}")


def _fused_engine(folder: Path, threads: int | None, args, length: int):
    """FusedEngine over export_onnx's ort/ graph (llmpipe.export.fused), checked against the model first."""
    from llmpipe import device
    from llmpipe.infer.fused import FusedEngine, GraphConfig, graph_problem
    from llmpipe.infer.ort import create_session

    try:
        config = GraphConfig.read(folder)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise GenerateError(f"{folder}: unreadable genai_config.json ({type(err).__name__}: {err}); "
                            "refusing to use it") from None
    session = create_session(folder / "model.onnx", device.ort_providers(["cpu"])[0], threads)
    problem = graph_problem(session, config, args)
    if problem:
        raise GenerateError(f"{folder / 'model.onnx'}: not the ORT-optimised graph export_onnx makes for this "
                            f"model: {problem}; refusing to use it")
    return FusedEngine(session, config, length)


def _om_engine(run_dir: Path, args):
    from llmpipe.export.atc import prefill_gears
    from llmpipe.infer import ais
    from llmpipe.infer.decode import StaticEngine

    reason = ais.unavailable_reason()
    if reason:
        raise GenerateError(f"--variant om: {reason}")
    folder, manifest = _stage(run_dir, "convert_om", "decoder_om", "convert_om must have compiled both graphs")
    export_folder, export_manifest = _stage(run_dir, "export_onnx", "decoder_static", "")
    cfg = manifest.config.get("convert_om", {})
    gears = prefill_gears(cfg.get("dynamic_dims"))
    length = _cache_len(export_folder, export_manifest)
    device_id = int(manifest.config.get("benchmark", {}).get("device_id", 0))
    prefill = ais.OmSession(manifest.path(folder, "om"), device_id=device_id, dynamic=bool(gears))
    decoder = ais.OmSession(manifest.path(folder, "decoder_om"), device_id=device_id)
    _check_graph(prefill.path, prefill, "prefill", args, length)
    _check_graph(decoder.path, decoder, "decoder", args, length)
    return StaticEngine(prefill, decoder, args, length, prefill_lens=gears or None,
                        batch=int(cfg.get("decode_batch", 1)))


def _check_prompt(prompt: str, option: str = "--prompt") -> None:
    """ConfigError unless `prompt` is text UTF-8 can carry: argv bytes that are not UTF-8 reach
    Python as lone surrogates (U+DC80..U+DCFF, the surrogateescape of each byte)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(prompt[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ConfigError(f"{option}: not valid UTF-8 ({what} at character {err.start})") from None


def check_options(prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                  seed: int | None, threads: int | None, chat: str | None = None, system: str | None = None) -> None:
    """ConfigError naming the first option out of its range; nothing is loaded before this."""
    if chat is None:
        _check_prompt(prompt)
        if system is not None:
            raise ConfigError("--system: only with --chat (a system message for the chat template)")
    else:
        _check_prompt(chat, "--chat")
        if system is not None:
            _check_prompt(system, "--system")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature {temperature:g}: must be a finite number >= 0 (0: greedy)")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k}: must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:  # NaN included
        raise ConfigError(f"--top-p {top_p:g}: must be in (0, 1]")
    if seed is not None and seed < 0:
        raise ConfigError(f"--seed {seed}: must be >= 0")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"--threads {threads}: must be between 1 and {MAX_THREADS} (leave it out for all cores)")


class Streamer:
    """Prints text as tokens arrive: decodes everything so far and writes what is new, so a
    character split over several byte-level tokens appears once it is whole."""

    def __init__(self, tokenizer, out: TextIO):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], ""

    def __call__(self, tokens: np.ndarray) -> None:
        self.ids.append(int(tokens[0]))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return
        self.out.write(text[len(self.shown):])
        self.out.flush()
        self.shown = text


class ChatStreamer(Streamer):
    """Prints an answer as it arrives and never an end-of-turn: a stop token is not printed, the text
    stops before a stop string, and text that may still become one is held back until the next token
    tells (`finish` prints what is held when generation ends otherwise)."""

    def __init__(self, tokenizer, out: TextIO, stop_ids: list[int], stop_strings: list[str]):
        super().__init__(tokenizer, out)
        self.stop_ids, self.stop_strings, self.done = set(stop_ids), [t for t in stop_strings if t], False

    def _held(self, text: str) -> int:
        """How many characters at the end of `text` begin a stop string (one pass per stop string)."""
        from llmpipe.infer.stops import held_back

        return held_back(text, self.stop_strings)

    def _show(self, text: str) -> None:
        if len(text) > len(self.shown):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def __call__(self, tokens: np.ndarray) -> None:
        token = int(tokens[0])
        if self.done or token in self.stop_ids:
            self.done = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        cuts = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if cuts:
            self.done = True
            self._show(text[:min(cuts)])
        else:
            self._show(text[:len(text) - self._held(text)])

    def stop(self) -> bool:
        return self.done

    def finish(self) -> str:
        if not self.done:
            self._show(self.tokenizer.decode(self.ids))
        return self.shown


@dataclass
class RunTemplate:
    """A run's chat template and the bos/eos tokens training rendered conversations with."""

    template: object  # llmpipe.chat.template.ChatTemplate
    bos_token: str
    eos_token: str


def run_template(run_dir: Path, variant: str) -> RunTemplate | None:
    """The run's chat template (None for a text run), after every copy `variant` comes with is checked
    against training's digest: consolidate's, and export_onnx's for the graphs' variants."""
    from llmpipe.chat.template import load_template
    from llmpipe.checkpoint.template_digest import METRIC, RENDER, check_folder, mismatch, training_digest
    from llmpipe.manifest import Manifest
    from llmpipe.stages import stage_dir

    folder, manifest = _stage(run_dir, "consolidate", "model", "run the pipeline first")
    training = training_digest(run_dir, manifest.metrics.get(METRIC), folder / "manifest.json")
    source = check_folder(folder, training)
    export = stage_dir(run_dir, "export_onnx")
    exported = Manifest.read(export) if variant != "torch" else None
    if exported is not None:
        if exported.metrics.get(METRIC) != training:
            raise mismatch(export / "manifest.json", exported.metrics.get(METRIC), training)
        check_folder(export, training)
    if source is None:
        return None
    render = manifest.metrics.get(RENDER) or {}
    return RunTemplate(load_template(source, str(folder / "chat_template.jinja")), str(render.get("bos_token", "")),
                       str(render.get("eos_token", "")))


def chat_prompt(chat: RunTemplate, question: str, system: str | None) -> str:
    """The conversation so far as the model was trained to read it, up to where the assistant's answer begins."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return chat.template.render([*messages, {"role": "user", "content": question}], add_generation_prompt=True,
                                bos_token=chat.bos_token, eos_token=chat.eos_token)


def chat_stops(loaded: Loaded, chat: RunTemplate) -> tuple[list[int], list[str]]:
    """What ends an answer: eos and the template's single-token end-of-turn (ids), its end-of-turn strings."""
    from llmpipe.models.llama.hf_files import single_token_ids

    end = chat.template.end_of_turn
    return list(dict.fromkeys([*loaded.eos_ids, *single_token_ids(loaded.tokenizer, end)])), end


def ask(loaded: Loaded, chat: RunTemplate, question: str, system: str | None = None,
        max_new_tokens: int = 32) -> str:
    """The greedy answer of an opened run to one question in the chat template `chat` (what
    `generate --chat` prints), for evaluations that ask many."""
    from llmpipe.infer.decode import generate

    ids = loaded.tokenizer.encode(chat_prompt(chat, question, system)).ids
    new = min(max_new_tokens, loaded.engine.capacity + 1 - len(ids))
    if not ids or new < 1:
        raise GenerateError(f"{question[:40]!r}: {len(ids)} prompt tokens do not leave room for an answer in the "
                            f"model's context ({loaded.engine.capacity})")
    stop_ids, stop_strings = chat_stops(loaded, chat)
    stream = ChatStreamer(loaded.tokenizer, io.StringIO(), stop_ids, stop_strings)
    generate(loaded.engine, np.array([ids], dtype=np.int64), new, pick_greedy, stream, stop_id=stop_ids,
             stop=stream.stop)
    return stream.finish()


def pick_greedy(logits: np.ndarray) -> np.ndarray:
    return logits.argmax(-1)


def run_generate(run_dir: Path, prompt: str | None, max_new_tokens: int = 64, variant: str = "fp32",
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, threads: int | None = None, out: TextIO | None = None, *,
                 chat: str | None = None, system: str | None = None, allow_ungated: bool = False) -> dict:
    """Stream a continuation of `prompt` to `out` (default: sys.stdout at the call), or with `chat` the
    answer to that question alone; returns the numbers of the closing line. A variant a gate rejected (for
    the model in the folder now: llmpipe.verdicts) is refused unless `allow_ungated`, as serve refuses it."""
    from llmpipe.infer.decode import CapacityError, generate, pick_tokens
    from llmpipe.verdicts import rejection

    check_options(prompt or "", max_new_tokens, temperature, top_k, top_p, seed, threads, chat, system)
    refused = rejection(Path(run_dir), variant)
    if refused and not allow_ungated:
        raise GenerateError(f"{refused}; refusing to generate with it (--allow-ungated to generate anyway)")
    if refused:
        log.warning("generate: UNGATED (--allow-ungated): %s", refused)
    option = "--prompt" if chat is None else "--chat"
    template = run_template(Path(run_dir), variant)
    if chat is not None and template is None:
        raise GenerateError(f"--chat: {run_dir} has no chat template (it was trained on text, data.format: text); "
                            "use --prompt")
    loaded = open_run(Path(run_dir), variant, threads)
    out = sys.stdout if out is None else out
    text = prompt if chat is None else chat_prompt(template, chat, system)
    ids = loaded.tokenizer.encode(text).ids
    if not ids:
        raise GenerateError(f"{option}: empty after tokenization")
    if len(ids) >= loaded.engine.capacity:
        raise GenerateError(f"{option}: {len(ids)} tokens, but the model's context ({loaded.describe}) holds "
                            f"{loaded.engine.capacity}; shorten the prompt")
    new = min(max_new_tokens, loaded.engine.capacity + 1 - len(ids))
    pick: Callable = partial(pick_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             rng=np.random.default_rng(seed))
    if chat is None:
        out.write(prompt)
        stops = loaded.eos_ids
        stream, stop = Streamer(loaded.tokenizer, out), None
    else:
        stops, end = chat_stops(loaded, template)
        stream = ChatStreamer(loaded.tokenizer, out, stops, end)
        stop = stream.stop
    try:
        gen = generate(loaded.engine, np.array([ids], dtype=np.int64), new, pick, stream, stop_id=stops, stop=stop)
    except CapacityError as err:
        raise GenerateError(str(err)) from None
    n = gen.tokens.shape[1]
    answer = stream.finish() if chat is not None else stream.tokenizer.decode(stream.ids)
    stats = {"variant": variant, "prompt_tokens": len(ids), "new_tokens": n, "ttft_ms": gen.ttft_s * 1e3,
             "tokens_per_s": gen.decode_tokens_per_s(), "tokens": gen.tokens[0].tolist() if chat is not None
             else list(stream.ids), "text": answer}
    rate = f"{stats['tokens_per_s']:.1f} tokens/s" if stats["tokens_per_s"] else "- tokens/s"
    closing = (f"[{loaded.describe}] prompt {len(ids)} tokens, {n} new tokens, time to first token "
               f"{stats['ttft_ms']:.1f} ms, {rate} (decode, first token excluded)\n")
    if chat is None:
        out.write("\n" + closing)
    else:  # only the answer on `out`
        out.write("\n")
        sys.stderr.write(closing)
    return stats
