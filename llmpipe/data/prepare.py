"""The prepare_data stage: text files -> tokenizer.json + train/val token shards + data_meta.json.

Two passes over the corpus keep memory flat whatever its size: the first trains the tokenizer
(or, with data.tokenizer.path, only counts documents), the second tokenizes in parallel chunks
and streams tokens into the shards. Documents are split train/val by a seeded shuffle of their
indices, and each split keeps corpus order inside its shard (the training sampler shuffles).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from llmpipe.config import DataSection
from llmpipe.data.corpus import Corpus, CorpusStats, Piece, find_inputs
from llmpipe.data.errors import DataError
from llmpipe.data.shards import ShardWriter, token_dtype
from llmpipe.data.tokenizer import eos_id, load_tokenizer, train_tokenizer
from llmpipe.manifest import write_json_atomic
from llmpipe.stages import StageContext, StageResult

log = logging.getLogger("llmpipe.data")

OUTPUTS = {"tokenizer": "tokenizer.json", "train_bin": "train.bin", "train_idx": "train.idx",
           "val_bin": "val.bin", "val_idx": "val.idx", "meta": "data_meta.json"}
CHUNK_DOCS = 1024  # pieces (documents, parts of long ones) per encode_batch call; rayon uses all cores
CHUNK_CHARS = 4 << 20  # ... or fewer, so a chunk's ids (Python ints) stay around 100 MB at most


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _show_progress() -> bool:
    """LLMPIPE_PROGRESS=1 forces the bar on (logs piped to a file), =0 off; otherwise only on a tty."""
    flag = os.environ.get("LLMPIPE_PROGRESS", "")
    return flag == "1" if flag in ("0", "1") else sys.stderr.isatty()


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Mask over documents, True = validation: max(1, round(fraction * n)) of them, by a seeded shuffle."""
    if n_docs < 2:
        raise DataError(f"data.inputs: the corpus has {n_docs} document; need at least 2 "
                         "(one goes to validation)")
    n_val = max(1, round(val_fraction * n_docs))
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


def _chunks(pieces: Iterable[Piece], max_pieces: int = CHUNK_DOCS,
            max_chars: int = CHUNK_CHARS) -> Iterator[list[Piece]]:
    chunk: list[Piece] = []
    chars = 0
    for piece in pieces:
        chunk.append(piece)
        chars += len(piece.text)
        if len(chunk) >= max_pieces or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _changed(done: int, n_docs: int) -> DataError:
    how = f"more than the {n_docs}" if done > n_docs else f"{done} documents, not the {n_docs}"
    return DataError(f"data.inputs: the corpus changed while being read ({how} documents of the first pass)")


def tokenize_to_shards(pieces: Iterable[Piece], tok: Tokenizer, eos: int, is_val: np.ndarray, out_dir: Path,
                       dtype: np.dtype) -> dict[str, int]:
    """Encode documents, given as pieces (EOS after each document's last), into out_dir/train.bin|idx
    and val.bin|idx; returns token counts. A long document's pieces are encoded separately and their
    ids joined (see tokenizer.cut_point for why that equals encoding it whole)."""
    # NOTE: the literal eos text inside a document stays plain text; only our appended id separates documents.
    tok.encode_special_tokens = True
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets: ~3x quicker
    n_docs, doc = len(is_val), -1
    with ShardWriter(out_dir / OUTPUTS["train_bin"], dtype) as train, \
            ShardWriter(out_dir / OUTPUTS["val_bin"], dtype) as val, \
            tqdm(total=n_docs, unit="doc", desc="tokenize", file=sys.stderr, disable=not _show_progress(),
                 mininterval=0.5, dynamic_ncols=True) as bar:
        for chunk in _chunks(pieces):
            splits: tuple[list[list[int]], list[list[int]]] = ([], [])
            continues = [False, False]  # a split's first list in this chunk goes on with an earlier document
            for piece, enc in zip(chunk, encode([p.text for p in chunk], add_special_tokens=False)):
                doc += piece.first
                if doc >= n_docs:
                    raise _changed(doc + 1, n_docs)
                held_out = int(is_val[doc])
                ids = enc.ids
                if piece.last:
                    ids.append(eos)
                docs = splits[held_out]
                if not piece.first and docs:  # the same document's previous piece is docs[-1]
                    docs[-1].extend(ids)
                else:
                    continues[held_out] |= not piece.first
                    docs.append(ids)
            train.add_documents(splits[0], continues=continues[0])
            val.add_documents(splits[1], continues=continues[1])
            bar.update(sum(p.first for p in chunk))
            bar.set_postfix_str(f"{_human(train.n_tokens + val.n_tokens)} tokens", refresh=False)
    if doc + 1 != n_docs:
        raise _changed(doc + 1, n_docs)
    return {"train_tokens": train.n_tokens, "val_tokens": val.n_tokens}


def _tokenizer(corpus: Corpus, data: DataSection, out: Path) -> tuple[Tokenizer, int, float]:
    """Train (the first pass over the corpus) or load the tokenizer; save it to `out`.

    Returns (tokenizer, eos id, seconds spent training)."""
    cfg = data.tokenizer
    if cfg.path is None:
        t0 = time.monotonic()
        tok = train_tokenizer(corpus.texts(), cfg.vocab_size, cfg.min_frequency, cfg.eos_token)
        seconds = time.monotonic() - t0
        tok.save(str(out))
        return tok, eos_id(tok, cfg.eos_token), seconds
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
    for _ in corpus.pieces():  # first pass only counts documents, so the split is known before tokenizing
        pass
    return tok, eos, 0.0


def _check_corpus(stats: CorpusStats, n_files: int) -> None:
    if stats.documents == 0:
        examples = "; ".join(f"{s['path']}: {s['reason']}" for s in stats.skipped[:3]) or "no documents"
        raise DataError(f"data.inputs: no usable documents in {n_files} file(s) (e.g. {examples})")
    if stats.files_skipped:
        shown = "; ".join(f"{Path(s['path']).name}: {s['reason']}" for s in stats.skipped[:3])
        log.warning("skipped %d file(s), e.g. %s", stats.files_skipped, shown)
    if stats.bad_lines:
        log.warning("%d bad .jsonl line(s), e.g. %s", stats.bad_lines, stats.bad_line_examples[0])


def _check_samples(meta: dict[str, Any], data: DataSection) -> None:
    need = data.seq_len + 1
    advice = {"val": f"raise data.val_fraction (now {data.val_fraction}), add data, or lower data.seq_len",
              "train": "add data or lower data.seq_len"}
    for split in ("train", "val"):
        if meta[f"{split}_samples"] < 1:
            tokens = meta[f"{split}_tokens"]
            raise DataError(f"data.seq_len: the {split} split has {tokens} tokens, fewer than one sample "
                             f"of seq_len+1 = {need}; {advice[split]}")


def run(ctx: StageContext) -> StageResult:
    """prepare_data: read data.inputs, train or load the tokenizer, write the train/val shards."""
    data, out = ctx.cfg.data, ctx.work_dir
    inputs = find_inputs(data.inputs, data.max_files)
    if inputs.symlink_loops:
        log.warning("data.inputs: %d symlink loop(s) not followed (each file is read once), e.g. %s",
                    len(inputs.symlink_loops), inputs.symlink_loops[0])
    corpus = Corpus(inputs.files, data.text_field, data.max_file_bytes)
    tok, eos, train_s = _tokenizer(corpus, data, out / OUTPUTS["tokenizer"])
    stats = corpus.stats  # from the first pass
    _check_corpus(stats, len(corpus.files))
    vocab = tok.get_vocab_size()
    trained = data.tokenizer.path is None
    how = f"trained BPE vocab {vocab} in {train_s:.1f}s" if trained else f"loaded vocab {vocab}"
    log.info("read %d files, %.1f MB, %d documents; %s",
             stats.files_read, stats.bytes / 1e6, stats.documents, how)

    is_val = split_documents(stats.documents, data.val_fraction, ctx.cfg.run.seed)
    dtype = token_dtype(vocab)
    t0 = time.monotonic()
    counts = tokenize_to_shards(corpus.pieces(), tok, eos, is_val, out, dtype)
    tok_s = time.monotonic() - t0
    tokens = counts["train_tokens"] + counts["val_tokens"]

    meta = {"vocab_size": vocab, "eos_id": eos, "eos_token": data.tokenizer.eos_token, "dtype": dtype.name,
            "seq_len": data.seq_len, **counts, "symlink_loops": len(inputs.symlink_loops),
            "train_samples": max(0, (counts["train_tokens"] - 1) // data.seq_len),
            "val_samples": max(0, (counts["val_tokens"] - 1) // data.seq_len)}
    _check_samples(meta, data)
    write_json_atomic(out / OUTPUTS["meta"], meta)
    log.info("tokenized %s tokens in %.1fs (%s tokens/s); train %d samples, val %d samples of %d tokens",
             _human(tokens), tok_s, _human(tokens / max(tok_s, 1e-9)), meta["train_samples"],
             meta["val_samples"], data.seq_len)

    metrics = {
        **stats.to_dict(), "symlink_loops": len(inputs.symlink_loops),
        "train_documents": int((~is_val).sum()), "val_documents": int(is_val.sum()), "tokens": tokens,
        **{k: meta[k] for k in ("train_tokens", "val_tokens", "train_samples", "val_samples",
                                "vocab_size", "dtype")},
        "bytes_per_token": round(stats.bytes / max(tokens, 1), 3),
        "tokenizer_trained": trained, "tokenizer_train_s": round(train_s, 3),
        "tokenize_s": round(tok_s, 3), "tokens_per_sec": round(tokens / max(tok_s, 1e-9)),
    }
    return StageResult(outputs=dict(OUTPUTS), metrics=metrics)
