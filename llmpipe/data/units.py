"""Work units of prepare_data: tokenize one unit into its own small shard, then merge them all.

A unit is a file or part of one (llmpipe.data.readers.Unit). `process_unit(item)` is the library
function for one unit, Prefect-free, run wherever the engine sends it (a local process, a Dask
worker: the units folder must be on a filesystem every worker sees). It reads the unit's documents,
drops those the filters reject, tokenizes the rest (EOS after each) into
`<units>/<index>/tokens.bin|.idx`, and stores each kept document's dedup key (`keys.npy`: exact
hashes (n,) uint64, or MinHash signatures (n, num_perm) uint32) and `meta.json` (counts, read
errors). It writes into a temporary folder renamed into place at the end, so a unit folder is
complete or absent: an interrupted stage resumes with the units already done.

`merge(...)` then walks the units in corpus order, decides duplicates sequentially (the first
occurrence stays), splits the kept documents train/val by a seeded shuffle, and copies their tokens
into train.bin/val.bin. Every decision depends on corpus order only, so the shards are
byte-identical whatever the number of workers or the order units finished in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.data.chat import LabelWriter, labels_path
from llmpipe.data.errors import DataError
from llmpipe.data.shards import ShardWriter, TokenShard

log = logging.getLogger("llmpipe.data")

META = "meta.json"
TOKENS = "tokens.bin"
KEYS = "keys.npy"
ENCODE_DOCS = 512  # pieces per encode_batch call
ENCODE_CHARS = 4 << 20  # ... or fewer, so one call's ids stay around 100 MB

LABELS = "tokens.labels"  # data.format: chat: one uint8 per token, 1 = a trained target
_TOKENIZERS: dict[tuple[str, bool], Any] = {}  # (path, chat) -> Tokenizer, loaded once per worker process


def unit_dir(units: Path, index: int) -> Path:
    return Path(units) / f"{index:06d}"


def _tokenizer(path: str, chat: bool = False):
    tok = _TOKENIZERS.get((path, chat))
    if tok is None:
        from llmpipe.data.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        # NOTE: the literal EOS text inside a document stays plain text; only the appended id separates documents.
        # A chat template's markers (<|im_end|>, the EOS it writes) are its special tokens: encoded as such.
        tok.encode_special_tokens = not chat
        _TOKENIZERS[(path, chat)] = tok
    return tok


def _chat_records(spec: dict):
    """data.format: chat: the readers' ChatRecords, encoding each conversation with the run's template."""
    from llmpipe.chat.template import load_template
    from llmpipe.data import chat
    from llmpipe.data.readers import ChatRecords

    tok = _tokenizer(spec["tokenizer"], chat=True)
    tpl = load_template(spec["chat_template"], spec["chat_template_origin"])
    c = spec["chat"]

    def encoder(messages):
        return chat.encode(tok, tpl, messages, c["seq_len"], c["train_on"], c["bos_token"], c["eos_token"])

    return ChatRecords(spec["messages_field"], encoder)


def done(units: Path, index: int, fingerprint: str) -> dict | None:
    """The meta of a completed unit made for this run's `fingerprint`, else None."""
    path = unit_dir(units, index) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if meta.get("fingerprint") == fingerprint else None


def _documents(unit, spec: dict, errors, counts: dict[str, int], field=None,
               encoded: list | None = None) -> Iterator[str]:
    """The unit's documents that pass the filters; counts what was read and what was dropped. With a
    ChatRecords `field`, the filters judge a conversation's contents and each kept one's (ids, labels)
    go to `encoded`."""
    from llmpipe.data.chat import content_text
    from llmpipe.data.dedup import Filters
    from llmpipe.data.readers import read_unit

    filters = Filters(**spec["filters"])
    chat = field is not None
    for text in read_unit(unit, field if chat else spec["text_field"], spec["max_file_bytes"], errors,
                          max_record_bytes=spec["max_record_bytes"]):
        counts["documents_read"] += 1
        # NOTE: no encoded copy of a (possibly huge) ASCII document just to count its bytes
        counts["bytes_read"] += len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        kind = filters.kind(content_text(field.last[0]) if chat else text)
        if kind:
            counts[f"filtered_{kind}"] = counts.get(f"filtered_{kind}", 0) + 1
            continue
        if chat:
            encoded.append(field.last[1:])
        yield text


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for text in docs:
        batch.append(text)
        chars += len(text)
        if len(batch) >= ENCODE_DOCS or chars >= ENCODE_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encode(tok, texts: list[str], eos: int) -> list[np.ndarray]:
    """Token ids of each text plus EOS (uint32 arrays). Texts are encoded in pieces (tokenizer.split_text,
    exact for the byte-level BPE), at most ENCODE_CHARS per call, so a huge document never has all
    its Encoding objects alive at once."""
    from llmpipe.data.tokenizer import split_text

    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets: ~3x quicker
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    pieces: list[str] = []
    owner: list[int] = []

    def flush() -> None:
        for i, enc in zip(owner, encode(pieces, add_special_tokens=False)):
            parts[i].append(np.asarray(enc.ids, dtype=np.uint32))
        pieces.clear()
        owner.clear()

    chars = 0
    for i, text in enumerate(texts):
        for piece in split_text(text):
            pieces.append(piece)
            owner.append(i)
            chars += len(piece)
            if chars >= ENCODE_CHARS:
                flush()
                chars = 0
    if pieces:
        flush()
    end = np.array([eos], dtype=np.uint32)
    return [np.concatenate([*p, end]) for p in parts]


def _keys(texts: list[str], spec: dict, hasher) -> np.ndarray:
    from llmpipe.data.dedup import exact_key

    if spec["dedup"] == "minhash":
        return np.stack([hasher.signature(t) for t in texts])  # (n, num_perm) uint32
    return np.fromiter((exact_key(t) for t in texts), dtype=np.uint64, count=len(texts))


def process_unit(item: dict[str, Any]) -> dict[str, Any]:
    """Tokenize one unit (see the module docstring). `item`: {"unit": Unit.to_dict(), "units": folder,
    "spec": {tokenizer, eos, dtype, text_field, max_file_bytes, max_record_bytes, filters, dedup, minhash,
    fingerprint}}.
    Returns the unit's meta (also in its meta.json); a unit already done is not redone."""
    from llmpipe.data.dedup import MinHasher
    from llmpipe.data.readers import ErrorLog, Unit

    unit, spec, units = Unit.from_dict(item["unit"]), item["spec"], Path(item["units"])
    finished = done(units, unit.index, spec["fingerprint"])
    if finished is not None:
        return finished
    final = unit_dir(units, unit.index)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.monotonic()
    tok = _tokenizer(spec["tokenizer"])
    hasher = MinHasher(**spec["minhash"]) if spec["dedup"] == "minhash" else None
    errors = ErrorLog()
    counts = {"documents_read": 0, "bytes_read": 0}
    keys: list[np.ndarray] = []
    chat = spec.get("format") == "chat"
    field, encoded = (_chat_records(spec), []) if chat else (None, None)
    with ShardWriter(tmp / TOKENS, spec["dtype"]) as shard, \
            (LabelWriter(tmp / LABELS) if chat else contextlib.nullcontext()) as labels:
        for texts in _batches(_documents(unit, spec, errors, counts, field, encoded)):
            if chat:  # encoded as they were read (a bad one is listed where it was found)
                shard.add_documents([ids for ids, _ in encoded])
                labels.add([lab for _, lab in encoded])
                encoded.clear()
            else:
                shard.add_documents(_encode(tok, texts, spec["eos"]))
            if spec["dedup"] != "none":
                keys.append(_keys(texts, spec, hasher))
    if spec["dedup"] != "none":
        empty = np.zeros((0, spec["minhash"]["num_perm"]), np.uint32) if spec["dedup"] == "minhash" else \
            np.zeros(0, np.uint64)
        np.save(tmp / KEYS, np.concatenate(keys) if keys else empty)
    meta = {"unit": unit.to_dict(), "fingerprint": spec["fingerprint"], **counts, "documents": shard.n_docs,
            "tokens": shard.n_tokens, "errors": errors.to_dict(), "seconds": round(time.monotonic() - t0, 3)}
    (tmp / META).write_text(json.dumps(meta), encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)  # an incomplete folder from an older attempt: never read
    os.replace(tmp, final)
    return meta


# --------------------------------------------------------------------------- running units


Executor = Callable[[Callable[[dict], dict], list[dict], Callable[[dict], None]], None]


def local_executor(workers: int, retries: int = 1) -> Executor:
    """Run items on a local process pool (spawned processes), calling `on_done(result)` as each
    finishes; a failed item is retried alone up to `retries` times, then the error is raised."""

    def execute(fn: Callable[[dict], dict], items: list[dict], on_done: Callable[[dict], None]) -> None:
        if workers <= 1 or len(items) <= 1:  # no pool for one worker: same process, same results
            for item in items:
                on_done(_with_retries(fn, item, retries))
            return
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                                 initializer=one_thread_per_worker) as pool:
            pending: dict[Future, tuple[dict, int]] = {pool.submit(fn, it): (it, 0) for it in items}
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    item, tries = pending.pop(fut)
                    err = fut.exception()
                    if err is None:
                        on_done(fut.result())
                    elif tries < retries:
                        log.warning("unit %s failed (%s); retrying it", item["unit"]["index"], _line(err))
                        pending[pool.submit(fn, item)] = (item, tries + 1)
                    else:
                        raise _unit_failed(item, err)

    return execute


def one_thread_per_worker() -> None:
    """In a worker process: the tokenizer's thread pool gets one thread, since the workers already
    use every core (rayon reads RAYON_NUM_THREADS when its pool starts, at the first encode)."""
    os.environ["RAYON_NUM_THREADS"] = "1"


def _with_retries(fn, item: dict, retries: int) -> dict:
    for attempt in range(retries + 1):
        try:
            return fn(item)
        except DataError:
            raise
        except Exception as err:
            if attempt == retries:
                raise _unit_failed(item, err) from err
            log.warning("unit %s failed (%s); retrying it", item["unit"]["index"], _line(err))
    raise AssertionError("unreachable")


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _unit_failed(item: dict, err: BaseException) -> Exception:
    if isinstance(err, DataError):
        return err
    u = item["unit"]
    return DataError(f"data: work unit {u['index']} ({u['path']} [{u['start']}:{u['stop']}]) failed: {_line(err)}")


# --------------------------------------------------------------------------- merging


def _decide(units: Path, metas: list[dict], dedup: str, deduper) -> tuple[list[np.ndarray], int]:
    """Per unit, which documents stay (bool arrays), deciding duplicates in corpus order."""
    keep, removed = [], 0
    for meta in metas:
        n = meta["documents"]
        if dedup == "none" or n == 0:
            keep.append(np.ones(n, dtype=bool))
            continue
        keys = np.load(unit_dir(units, meta["unit"]["index"]) / KEYS)
        mask = np.fromiter((not deduper.is_duplicate(k if keys.ndim > 1 else int(k)) for k in keys),
                           dtype=bool, count=n)
        removed += int(n - mask.sum())
        keep.append(mask)
    return keep, removed


def merge(units: Path, metas: list[dict], out_dir: Path, names: tuple[str, str], dtype, is_val_of: Callable,
          dedup: str, deduper, labels: bool = False) -> dict[str, int]:
    """Write train/val shards from the units, in corpus order. `is_val_of(n_kept)` gives the
    validation mask over the kept documents; `labels`: each shard's .labels file too (chat). Returns counts."""
    keep, removed = _decide(units, metas, dedup, deduper)
    n_kept = int(sum(int(k.sum()) for k in keep))
    is_val = is_val_of(n_kept)
    k = 0
    with ShardWriter(out_dir / names[0], dtype) as train, ShardWriter(out_dir / names[1], dtype) as val, \
            _labels(out_dir / names[0], labels) as train_labels, _labels(out_dir / names[1], labels) as val_labels:
        for meta, mask in zip(metas, keep):
            if not mask.any():
                continue
            shard = TokenShard(unit_dir(units, meta["unit"]["index"]) / TOKENS)
            unit_labels = (np.memmap(unit_dir(units, meta["unit"]["index"]) / LABELS, np.uint8, "r",
                                     shape=(shard.n_tokens,)) if labels and shard.n_tokens else None)
            bounds = np.append(np.asarray(shard.doc_offsets), shard.n_tokens)
            for split, writer, lab in ((False, train, train_labels), (True, val, val_labels)):
                chosen = np.flatnonzero(mask)[is_val[k:k + int(mask.sum())] == split]
                _copy_documents(shard, bounds, chosen, writer)
                if lab is not None:
                    lab.add([unit_labels[int(bounds[j]):int(bounds[j + 1])] for j in chosen])
            k += int(mask.sum())
    return {"duplicates_removed": removed, "documents_kept": n_kept, "train_documents": int((~is_val).sum()),
            "val_documents": int(is_val.sum()), "train_tokens": train.n_tokens, "val_tokens": val.n_tokens}


def _labels(bin_path: Path, wanted: bool):
    return LabelWriter(labels_path(bin_path)) if wanted else contextlib.nullcontext()


def _copy_documents(shard: TokenShard, bounds: np.ndarray, docs: np.ndarray, writer: ShardWriter,
                    batch_tokens: int = 1 << 24) -> None:
    """Append documents `docs` (ascending) of `shard` to `writer`, in batches of about 16M tokens."""
    batch, size = [], 0
    for j in docs:
        a, b = int(bounds[j]), int(bounds[j + 1])
        batch.append(shard.tokens[a:b])
        size += b - a
        if size >= batch_tokens:
            writer.add_documents(batch)
            batch, size = [], 0
    writer.add_documents(batch)
