"""The prepare_data stage: corpus files -> tokenizer.json + train/val token shards + data_meta.json.

1. find the inputs and split them into work units (llmpipe.data.readers: txt, jsonl, json,
   parquet, compressed streams, datasets folders; big record files into row-group or line-aligned
   byte ranges);
2. train the BPE tokenizer on the documents (or a seeded sample of them, data.tokenizer.sample_docs
   / sample_bytes), or load data.tokenizer.path;
3. tokenize every unit into its own shard (llmpipe.data.units.process_unit), on the engine the
   caller gives (ctx.executor: Prefect's task runners, local processes or Dask) or a local process
   pool; units already done by an interrupted attempt are reused;
4. merge the units in corpus order: drop duplicates (data.dedup), split train/val by a seeded
   shuffle of the kept documents, write the shards.

The result depends on the corpus and the result-defining config only: not on the number of
workers, the unit size or the order units finish in. Work units live in
`artifacts/<run>/.01_prepare_data.units/` until the stage succeeds.
"""

from __future__ import annotations

import heapq
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from llmpipe import attempts, console
from llmpipe.config import DataSection
from llmpipe.data import units as unit_mod
from llmpipe.data.chat import special_markers
from llmpipe.data.corpus import find_inputs
from llmpipe.data.errors import DataError
from llmpipe.data.shards import token_dtype
from llmpipe.data.tokenizer import TRAIN_PIECE_CHARS, eos_id, load_tokenizer, split_text, train_tokenizer, training_text
from llmpipe.manifest import write_json_atomic
from llmpipe.stages import StageContext, StageResult, stage_dir

log = logging.getLogger("llmpipe.data")

OUTPUTS = {"tokenizer": "tokenizer.json", "train_bin": "train.bin", "train_idx": "train.idx",
           "val_bin": "val.bin", "val_idx": "val.idx", "meta": "data_meta.json"}
# data.format: chat adds the template (its source; the digest is in the manifest's metrics) and the labels
CHAT_OUTPUTS = {"chat_template": "chat_template.jinja", "train_labels": "train.labels", "val_labels": "val.labels"}
LOG_EVERY_S = 30.0  # progress lines when stderr is not a terminal
FINGERPRINT = ".fingerprint"


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _show_progress() -> bool:
    """LLMPIPE_PROGRESS=1 forces the bar on (logs piped to a file), =0 off; otherwise only on a tty."""
    flag = os.environ.get("LLMPIPE_PROGRESS", "")
    return flag == "1" if flag in ("0", "1") else console.terminal().isatty()


class Progress:
    """A tqdm bar on a terminal, else a log line every LOG_EVERY_S: done/total, rate, ETA."""

    def __init__(self, desc: str, total: float, unit: str, rate_of: str = "tokens"):
        self.desc, self.total, self.unit, self.rate_of = desc, total, unit, rate_of
        self.done, self.count, self.t0, self.last = 0.0, 0.0, time.monotonic(), time.monotonic()
        self.bar = tqdm(total=total, unit=unit, desc=desc, file=console.terminal(), mininterval=0.5, dynamic_ncols=True,
                        unit_scale=True, disable=False) if _show_progress() else None  # (TQDM_DISABLE: libraries')

    def update(self, n: float, count: float = 0) -> None:
        self.done += n
        self.count += count
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(n)
            if count:
                self.bar.set_postfix_str(f"{_human(self.count)} {self.rate_of}, {_human(self.count / elapsed)}/s",
                                         refresh=False)
        elif time.monotonic() - self.last >= LOG_EVERY_S:
            self.last = time.monotonic()
            eta = (self.total - self.done) * elapsed / self.done if self.done else float("nan")
            log.info("%s: %s/%s %s, %s %s (%s/s), ETA %.0fs", self.desc, _human(self.done), _human(self.total),
                     self.unit, _human(self.count), self.rate_of, _human(self.count / elapsed), eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def chat_template(cfg):
    """The run's chat template (llmpipe.chat.template.resolve_template) when data.format is chat, else None.
    (config load already checked that it loads; a TemplateError here is one line too.)"""
    if cfg.data.format != "chat":
        return None
    from llmpipe.chat.template import TemplateError, resolve_template

    try:
        tpl = resolve_template(cfg.model.init_from, cfg.data.chat_template)
    except TemplateError as err:
        raise DataError(f"data.chat_template: {err}") from None
    if tpl is None:
        raise DataError("data.chat_template: data.format is chat but there is no chat template")
    return tpl


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Mask over documents, True = validation: max(1, round(fraction * n)) of them, by a seeded shuffle."""
    if n_docs < 2:
        raise DataError(f"data.inputs: the corpus has {n_docs} usable document(s) after filters and dedup; "
                         "need at least 2 (one goes to validation)")
    n_val = max(1, round(val_fraction * n_docs))
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


# --------------------------------------------------------------------------- the tokenizer


def _documents(units: list, data: DataSection, tpl=None) -> Iterator[str]:
    """Every document that passes the filters, in corpus order (the tokenizer's training text); with a
    chat template `tpl`, every conversation rendered with it."""
    from llmpipe.data.chat import content_text
    from llmpipe.data.dedup import Filters
    from llmpipe.data.readers import ChatRecords, ErrorLog, read_unit

    filters = Filters.from_config(data.filters)
    errors = ErrorLog()  # the units count errors again when they tokenize; not reported twice
    progress = Progress("read for the tokenizer", sum(u.size for u in units), "B", "documents")
    field = ChatRecords(data.messages_field) if tpl is not None else data.text_field
    try:
        for unit in units:
            for text in read_unit(unit, field, data.max_file_bytes, errors,
                                  max_record_bytes=data.max_record_bytes):
                if tpl is not None:
                    messages = field.last[0]
                    if not filters.kind(content_text(messages)):
                        progress.update(0, 1)
                        yield tpl.render(messages, eos_token=data.tokenizer.eos_token)
                elif not filters.kind(text):
                    progress.update(0, 1)
                    yield text
            progress.update(unit.size)
    finally:
        progress.close()


def sample_documents(docs: Iterator[str], n_docs: int | None, n_bytes: int | None, seed: int) -> list[str]:
    """A seeded uniform sample without replacement (bottom-k by a random priority per document):
    at most `n_docs` documents and at most `n_bytes` bytes of text in all, in corpus order."""
    rng = np.random.default_rng(seed)
    heap: list[tuple[float, int, str, int]] = []  # (-priority, index, text, bytes): the largest priority on top
    total = 0
    for i, text in enumerate(docs):
        size = len(text.encode("utf-8", "surrogatepass"))
        priority = float(rng.random())
        heapq.heappush(heap, (-priority, i, text, size))
        total += size
        while heap and ((n_docs is not None and len(heap) > n_docs) or (n_bytes is not None and total > n_bytes)):
            total -= heapq.heappop(heap)[3]
    return [text for _, _, text, _ in sorted(heap, key=lambda e: e[1])]


def _tokenizer(units: list, data: DataSection, out: Path, cache: Path, seed: int,
               tpl=None) -> tuple[Tokenizer, int, dict]:
    """Train (or load) the tokenizer, save it to `out`; an interrupted attempt's (in the units
    cache) is reused, since its units were tokenized with it. Returns (tokenizer, eos id, info).
    A chat run's tokenizer is trained on the rendered conversations, the template's markers special tokens."""
    cfg = data.tokenizer
    cached = cache / OUTPUTS["tokenizer"]
    if cfg.path is not None:
        path = Path(cfg.path).expanduser()
        try:
            tok = load_tokenizer(path)  # its message starts with the path
        except DataError as err:
            raise DataError(f"data.tokenizer.path: {err}") from None
        try:
            eos = eos_id(tok, cfg.eos_token)
        except DataError as err:
            raise DataError(f"data.tokenizer.path: {path}: {err}") from None
        shutil.copyfile(path, out)
        return tok, eos, {"trained": False}
    if cached.is_file():
        log.info("tokenizer: reusing the one trained by the interrupted attempt (%s)", cached)
        shutil.copyfile(cached, out)
        tok = load_tokenizer(out)
        return tok, eos_id(tok, cfg.eos_token), {"trained": True, "reused": True}
    t0 = time.monotonic()
    # NOTE: each document's start only (data.tokenizer.doc_chars): the trainer's memory grows with the
    # distinct words it sees, about 100 bytes a character, so a 16 MB record of unique words took 1.9 GB
    docs: Iterator[str] | list[str] = (training_text(d, cfg.doc_chars) for d in _documents(units, data, tpl))
    info: dict[str, Any] = {"trained": True}
    if cfg.sample_docs is not None or cfg.sample_bytes is not None:
        docs = sample_documents(docs, cfg.sample_docs, cfg.sample_bytes, seed)
        info.update(sample_documents=len(docs), sample_bytes=sum(len(d.encode("utf-8", "surrogatepass"))
                                                                  for d in docs))
        log.info("tokenizer: training on a seeded sample of %d documents (%s bytes)", len(docs),
                 _human(info["sample_bytes"]))
    # NOTE: in pieces cut at whitespace (tokenizer.split_text): the same words for BPE, bounded memory
    markers = special_markers(tpl.source) if tpl is not None else []
    tok = train_tokenizer((p for d in docs for p in split_text(d, TRAIN_PIECE_CHARS)), cfg.vocab_size,
                          cfg.min_frequency, cfg.eos_token, markers)
    info["seconds"] = round(time.monotonic() - t0, 3)
    tok.save(str(out))
    shutil.copyfile(out, cached)
    return tok, eos_id(tok, cfg.eos_token), info


# --------------------------------------------------------------------------- units


def units_cache(ctx: StageContext) -> Path:
    """`<run>/.01_prepare_data.units/`, for this fingerprint: another fingerprint's units (paid-for
    tokenization) are moved to superseded/ like any replaced attempt, never deleted."""
    folder = ctx.run_dir / f".{stage_dir(ctx.run_dir, 'prepare_data').name}.units"
    marker = folder / FINGERPRINT
    if folder.exists():
        old = marker.read_text().strip() if marker.is_file() else ""
        if old == ctx.fingerprint:
            return folder
        if any(p.name != FINGERPRINT for p in folder.iterdir()):
            attempts.supersede(folder, ctx.run_dir, stage_dir(ctx.run_dir, "prepare_data").name, old or "0" * 12)
        else:
            shutil.rmtree(folder)
    folder.mkdir(parents=True)
    marker.write_text(ctx.fingerprint + "\n")
    return folder


def _spec(data: DataSection, tok_path: Path, eos: int, dtype: np.dtype, fingerprint: str,
          tpl=None) -> dict[str, Any]:
    spec = {"tokenizer": str(tok_path), "eos": eos, "dtype": dtype.name, "text_field": data.text_field,
            "max_file_bytes": data.max_file_bytes, "max_record_bytes": data.max_record_bytes,
            "filters": data.filters.model_dump(), "dedup": data.dedup,
            "minhash": {"num_perm": data.minhash.num_perm, "ngram": data.minhash.ngram},
            "fingerprint": fingerprint}
    if tpl is not None:
        spec.update(format="chat", messages_field=data.messages_field, chat_template=tpl.source,
                    chat_template_origin=tpl.origin, chat=_chat_meta(data, tpl))
    return spec


def _chat_meta(data: DataSection, tpl) -> dict[str, Any]:
    """What a chat run's later stages need to render as training rendered (also in data_meta.json)."""
    return {"template_sha256": tpl.sha256, "template_origin": tpl.origin, "end_of_turn": tpl.end_of_turn,
            "bos_token": "", "eos_token": data.tokenizer.eos_token, "train_on": data.train_on,
            "seq_len": data.seq_len, "messages_field": data.messages_field}


def _fail_after() -> int | None:
    """Test hook, off by default: LLMPIPE_FAIL_AFTER_UNITS=N interrupts the stage after N new units."""
    value = os.environ.get("LLMPIPE_FAIL_AFTER_UNITS", "")
    return int(value) if value.isdigit() else None


def tokenize_units(units: list, spec: dict, cache: Path, executor, workers: int) -> list[dict]:
    """Every unit's meta, in corpus order; runs the units not done yet."""
    metas = {u.index: m for u in units if (m := unit_mod.done(cache, u.index, spec["fingerprint"])) is not None}
    todo = [u for u in units if u.index not in metas]
    if metas:
        log.info("prepare_data: resuming, %d of %d work units already done", len(metas), len(units))
    progress = Progress("tokenize", sum(u.size for u in todo), "B")
    stop_after = _fail_after()

    def on_done(meta: dict) -> None:
        metas[meta["unit"]["index"]] = meta
        progress.update(meta["unit"]["size"], meta["tokens"])
        if stop_after is not None and len(metas) - (len(units) - len(todo)) >= stop_after:
            # NOTE: not a DataError: an interruption keeps the units done (a DataError is a
            # deterministic input problem, whose units cache is dropped).
            raise InterruptedError(f"prepare_data: interrupted after {stop_after} work units "
                                   "(LLMPIPE_FAIL_AFTER_UNITS, a test hook)")

    items = [{"unit": u.to_dict(), "units": str(cache), "spec": spec} for u in todo]
    t0 = time.monotonic()
    try:
        (executor or unit_mod.local_executor(workers))(unit_mod.process_unit, items, on_done)
    finally:
        progress.close()
    seconds = time.monotonic() - t0
    tokens = sum(metas[u.index]["tokens"] for u in todo)
    log.info("tokenized %d work units: %s tokens in %.1fs (%s tokens/s)", len(todo), _human(tokens), seconds,
             _human(tokens / max(seconds, 1e-9)))
    return [metas[u.index] for u in units]


def _external_links(inputs) -> Any:
    """Log the matches that resolve outside their pattern's folder; an ErrorLog of the refused ones
    (listed like unreadable files). DataError when nothing else is left to read."""
    from llmpipe.data.readers import ErrorLog

    refused = ErrorLog()
    if not inputs.external:
        return refused
    path, target, root = inputs.external[0]
    if not inputs.refused:
        log.warning("data.inputs: %d symlink(s) read from outside the folder their pattern starts from "
                    "(data.external_symlinks: follow), e.g. %s -> %s", len(inputs.external), path, target)
        return refused
    for link, real, top in inputs.external:
        refused.add("skipped_file", link, "file", f"a symlink to {real}, outside {top} "
                    "(data.external_symlinks: refuse)")
    if not inputs.files:
        raise DataError(f"data.inputs: every match is a symlink out of the folder its pattern starts from, e.g. "
                        f"{path} -> {target}, outside {root}; set data.external_symlinks: follow to read them")
    log.warning("data.inputs: %d symlink(s) to files outside the folder their pattern starts from not read "
                "(data.external_symlinks: refuse), e.g. %s -> %s", len(inputs.external), path, target)
    return refused


def _totals(metas: list[dict], first=None) -> tuple[dict[str, int], dict]:
    """Summed counts of the units and their read errors, merged in corpus order after `first` (an
    ErrorLog of problems found before reading)."""
    from llmpipe.data.readers import ErrorLog

    counts: dict[str, int] = {}
    errors = first or ErrorLog()
    for m in metas:
        for key, value in m.items():
            if key in ("documents_read", "bytes_read", "documents", "tokens") or key.startswith("filtered_"):
                counts[key] = counts.get(key, 0) + value
        errors.merge(m["errors"])
    return counts, errors.to_dict()


def _check_corpus(counts: dict[str, int], errors: dict, n_files: int) -> None:
    if counts.get("documents", 0) == 0:
        examples = "; ".join(f"{e['path']}{' ' + e['where'] if e['kind'] == 'bad_record' else ''}: {e['reason']}"
                             for e in errors.get("examples", [])[:3]) or "no documents"
        raise DataError(f"data.inputs: no usable documents in {n_files} input(s) (e.g. {examples})")
    if errors.get("total"):
        first = errors["examples"][0]
        log.warning("data: %d read problem(s) (%s), e.g. %s: %s (all in data_meta.json)", errors["total"],
                    ", ".join(f"{k} {v}" for k, v in errors["counts"].items()), first["path"], first["reason"])


def _check_samples(meta: dict[str, Any], data: DataSection) -> None:
    if data.format == "chat":
        for split in ("train", "val"):
            if meta[f"{split}_documents"] < 1:
                raise DataError(f"data.inputs: no conversation left for the {split} split; add conversations"
                                + (f" or raise data.val_fraction (now {data.val_fraction})" if split == "val" else ""))
        return
    need = data.seq_len + 1
    advice = {"val": f"raise data.val_fraction (now {data.val_fraction}), add data, or lower data.seq_len",
              "train": "add data or lower data.seq_len"}
    for split in ("train", "val"):
        if meta[f"{split}_samples"] < 1:
            tokens = meta[f"{split}_tokens"]
            raise DataError(f"data.seq_len: the {split} split has {tokens} tokens, fewer than one sample "
                             f"of seq_len+1 = {need}; {advice[split]}")


def run(ctx: StageContext) -> StageResult:
    """prepare_data: read data.inputs, train or load the tokenizer, tokenize the work units, merge.
    An input problem (DataError) leaves nothing behind; any other failure (an interruption, a lost
    worker) keeps the units done for the next attempt."""
    try:
        return _run(ctx)
    except DataError:
        folder = ctx.run_dir / f".{stage_dir(ctx.run_dir, 'prepare_data').name}.units"
        marker = folder / FINGERPRINT
        if marker.is_file() and marker.read_text().strip() == ctx.fingerprint:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _run(ctx: StageContext) -> StageResult:
    from llmpipe.data.dedup import Deduper
    from llmpipe.data.readers import plan_units

    data, out, seed = ctx.cfg.data, ctx.work_dir, ctx.cfg.run.seed
    inputs = find_inputs(data.inputs, data.max_files, data.external_symlinks)
    if inputs.symlink_loops:
        log.warning("data.inputs: %d symlink loop(s) not followed (each file is read once), e.g. %s",
                    len(inputs.symlink_loops), inputs.symlink_loops[0])
    refused = _external_links(inputs)
    units = plan_units(inputs.files, data.unit_bytes)
    cache = units_cache(ctx)
    workers = data.workers or os.cpu_count() or 1
    log.info("prepare_data: %d input(s), %s bytes, %d work unit(s), engine %s", len(inputs.files),
             _human(sum(u.size for u in units)), len(units), data.engine if ctx.executor else f"local x{workers}")
    tpl = chat_template(ctx.cfg)
    tok, eos, tok_info = _tokenizer(units, data, out / OUTPUTS["tokenizer"], cache, seed, tpl)
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)
    spec = _spec(data, cache / OUTPUTS["tokenizer"] if tok_info.get("trained") else out / OUTPUTS["tokenizer"],
                 eos, dtype, ctx.fingerprint, tpl)
    if not tok_info.get("trained"):
        shutil.copyfile(out / OUTPUTS["tokenizer"], cache / OUTPUTS["tokenizer"])
        spec["tokenizer"] = str(cache / OUTPUTS["tokenizer"])
    t0 = time.monotonic()
    metas = tokenize_units(units, spec, cache, ctx.executor, workers)
    tok_s = time.monotonic() - t0
    counts, errors = _totals(metas, refused)
    _check_corpus(counts, errors, len(inputs.files))
    deduper = Deduper(data.dedup, data.minhash.threshold, data.minhash.num_perm)
    merged = unit_mod.merge(cache, metas, out, (OUTPUTS["train_bin"], OUTPUTS["val_bin"]), dtype,
                            lambda n: split_documents(n, data.val_fraction, seed), data.dedup, deduper,
                            labels=tpl is not None)
    tokens = merged["train_tokens"] + merged["val_tokens"]
    filtered = {k.removeprefix("filtered_"): v for k, v in counts.items() if k.startswith("filtered_")}
    meta = {"vocab_size": vocab, "eos_id": eos, "eos_token": data.tokenizer.eos_token, "dtype": dtype.name,
            "seq_len": data.seq_len, "train_tokens": merged["train_tokens"], "val_tokens": merged["val_tokens"],
            "train_samples": max(0, (merged["train_tokens"] - 1) // data.seq_len),
            "val_samples": max(0, (merged["val_tokens"] - 1) // data.seq_len),
            "inputs": len(inputs.files), "units": len(units), "symlink_loops": len(inputs.symlink_loops),
            "external_symlinks": len(inputs.external),
            "documents_read": counts.get("documents_read", 0), "filtered": filtered,
            "dedup": data.dedup, "duplicates_removed": merged["duplicates_removed"],
            "documents": merged["documents_kept"], "train_documents": merged["train_documents"],
            "val_documents": merged["val_documents"], "read_errors": errors,
            # NOTE: no timings in data_meta.json: its bytes must depend on the corpus and config only
            "tokenizer": {k: v for k, v in tok_info.items() if k not in ("seconds", "reused")}}
    outputs = dict(OUTPUTS)
    if tpl is not None:  # a conversation is a sample (packed or padded at training)
        meta.update(format="chat", chat=_chat_meta(data, tpl), train_samples=merged["train_documents"],
                    val_samples=merged["val_documents"])
        (out / CHAT_OUTPUTS["chat_template"]).write_text(tpl.source, encoding="utf-8")
        outputs.update(CHAT_OUTPUTS)
    _check_samples(meta, data)
    write_json_atomic(out / OUTPUTS["meta"], meta)
    log.info("prepare_data: %d documents read, %d filtered, %d duplicates removed, %d kept; %s tokens; "
             "train %d samples, val %d samples of %d tokens", meta["documents_read"], sum(filtered.values()),
             merged["duplicates_removed"], merged["documents_kept"], _human(tokens), meta["train_samples"],
             meta["val_samples"], data.seq_len)
    metrics = {k: meta[k] for k in ("inputs", "units", "documents_read", "filtered", "duplicates_removed",
                                    "documents", "train_documents", "val_documents", "train_tokens", "val_tokens",
                                    "train_samples", "val_samples", "vocab_size", "dtype", "symlink_loops")}
    skipped = errors.get("counts", {}).get("skipped_file", 0)
    metrics.update(files_read=len(inputs.files) - skipped, files_skipped=skipped, tokens=tokens,
                   bytes_read=counts.get("bytes_read", 0), read_errors=errors.get("total", 0),
                   read_error_counts=errors.get("counts", {}), tokenizer_trained=bool(tok_info.get("trained")),
                   tokenizer_train_s=tok_info.get("seconds", 0.0), tokenize_s=round(tok_s, 3),
                   tokens_per_sec=round(tokens / max(tok_s, 1e-9)),
                   bytes_per_token=round(counts.get("bytes_read", 0) / max(tokens, 1), 3),
                   workers=workers if ctx.executor is None else None)
    if tpl is not None:
        metrics.update(format="chat", chat_template_sha256=tpl.sha256, chat_template_origin=tpl.origin)
    shutil.rmtree(cache, ignore_errors=True)  # merged into the shards written above
    return StageResult(outputs=outputs, metrics=metrics)
