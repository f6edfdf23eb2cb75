"""prepare_data at corpus scale, side by side in one run:

1. tokens/s of prepare_data's tokenization (work units, one process and two) against a bare
   `tokenizers` encode_batch loop over the same documents with the same tokenizer (goal >= 0.9),
   and the scaling from 1 to 2 workers;
2. peak RSS (the stage process and its workers) while preparing a generated .jsonl.gz and a
   .parquet corpus at two sizes: it should be flat in the input size (goal < 1 GB);
3. peak RSS with hostile records beside a normal corpus (issue 22): a .jsonl.zst of ~100 KB that
   decompresses to one 3 GB line without a newline, and a plain .jsonl holding one 500 MB record.
   Each should stay under 1.5 GB, with the record counted bad and the rest prepared.

    python benchmarks/prepare_data.py --mb 64 --rss-mb 128,256
    python benchmarks/prepare_data.py --sections hostile --bomb-gb 3 --record-mb 500

Exact and MinHash dedup rates are measured by benchmarks/dedup.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# NOTE: lets `python benchmarks/prepare_data.py` run from a checkout without installing llmpipe.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmpipe.data.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402


def documents(n_bytes: int, seed: int = 0):
    """Generated English-like documents (Zipf-distributed words from a 20k-word lexicon), ~2 KB each."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    lexicon = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20000)]
    total = 0
    while total < n_bytes:
        ids = np.minimum(rng.zipf(1.3, size=int(rng.integers(200, 500))), len(lexicon)) - 1
        text = " ".join(lexicon[i] for i in ids) + "."
        total += len(text) + 16
        yield text


def write_jsonl(path: Path, n_bytes: int, compress: bool = False) -> Path:
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8") as f:
        for text in documents(n_bytes):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_parquet(path: Path, n_bytes: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer, batch = None, []
    for text in documents(n_bytes):
        batch.append(text)
        if len(batch) == 8192:
            table = pa.table({"text": batch})
            writer = writer or pq.ParquetWriter(str(path), table.schema)
            writer.write_table(table, row_group_size=8192)
            batch = []
    if batch:
        table = pa.table({"text": batch})
        writer = writer or pq.ParquetWriter(str(path), table.schema)
        writer.write_table(table)
    writer.close()
    return path


def bare_loop(corpus: Path, tokenizer: Path) -> tuple[int, float]:
    """The baseline: read the jsonl, encode_batch_fast in batches of 512 (rayon on every core)."""
    tok = load_tokenizer(tokenizer)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tokens, batch = 0, []
    t0 = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 512:
                tokens += sum(len(e.ids) + 1 for e in encode(batch, add_special_tokens=False))
                batch = []
    if batch:
        tokens += sum(len(e.ids) + 1 for e in encode(batch, add_special_tokens=False))
    return tokens, time.perf_counter() - t0


def config(folder: Path, inputs: str, tokenizer: Path | None, workers: int, name: str, dedup: str = "none") -> Path:
    import yaml

    tok = {"path": str(tokenizer)} if tokenizer else {"vocab_size": 8192, "sample_docs": 2000}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"name": name, "artifacts_dir": str(folder / "artifacts")},
        "data": {"inputs": [inputs], "seq_len": 256, "val_fraction": 0.01, "tokenizer": tok, "workers": workers,
                 "unit_bytes": 16 << 20, "dedup": dedup}}))
    return path


def stage(cfg: Path) -> dict:
    """`llmpipe stage prepare_data` in a child of a child: returns its metrics and the peak RSS of
    the stage process and its workers (RUSAGE_CHILDREN of a wrapper process)."""
    code = ("import resource, subprocess, sys; "
            f"subprocess.run([sys.executable, '-m', 'llmpipe', 'stage', 'prepare_data', {str(cfg)!r}, '--force'], "
            "check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    rss_kb = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                cwd=ROOT, env={**os.environ, "LLMPIPE_PROGRESS": "0"}).stdout.split()[-1])
    import yaml

    c = yaml.safe_load(cfg.read_text())
    manifest = Path(c["run"]["artifacts_dir"]) / c["run"]["name"] / "01_prepare_data" / "manifest.json"
    return {**json.loads(manifest.read_text())["metrics"], "peak_rss_mb": rss_kb / 1024}


def write_bomb(path: Path, n_bytes: int) -> Path:
    """A .jsonl.zst whose one line (a record that never ends: no closing quote, no newline) decompresses
    to `n_bytes`, written as a stream; repeated text compresses about 30000:1 at level 19."""
    import zstandard

    block = b"ab" * (1 << 19)
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=19).stream_writer(raw) as f:
        f.write(b'{"text": "')
        for _ in range(n_bytes // len(block)):
            f.write(block)
    return path


def write_big_record(path: Path, n_bytes: int) -> Path:
    """A plain .jsonl holding one record of about `n_bytes` of varied words, then a few small ones."""
    words = next(documents(1 << 20, seed=2)).split()
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"text": "')
        written = 0
        while written < n_bytes:
            chunk = " ".join(words) + " "
            f.write(chunk)
            written += len(chunk)
        f.write('"}\n')
        for text in documents(1 << 20, seed=3):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def hostile(folder: Path, normal_mb: int, bomb_gb: float, record_mb: int) -> None:
    """Peak RSS of prepare_data on a normal corpus, then on the same corpus beside each hostile file."""
    corpus = folder / "hostile"
    corpus.mkdir()
    write_jsonl(corpus / "normal.jsonl.gz", normal_mb << 20, compress=True)
    cases = [("normal corpus alone", None),
             (f"+ a {bomb_gb:g} GB one-line .jsonl.zst",
              lambda p: write_bomb(p / "bomb.jsonl.zst", int(bomb_gb * 2**30))),
             (f"+ a {record_mb} MB record in a .jsonl", lambda p: write_big_record(p / "big.jsonl", record_mb << 20))]
    print(f"\nPeak RSS of prepare_data with hostile records beside a {normal_mb} MB corpus (.jsonl.gz), 2 workers, "
          "data.max_record_bytes at its default (goal < 1.5 GB)\n")
    print(f"{'input':>36} {'file MB':>8} {'documents':>10} {'read errors':>12} {'peak RSS MB':>12} {'seconds':>8}")
    for i, (name, make) in enumerate(cases):
        extra = make(corpus) if make else None
        t0 = time.perf_counter()
        m = stage(config(folder, str(corpus / "*"), None, 2, f"hostile{i}", dedup="exact"))
        size = extra.stat().st_size / 2**20 if extra else (corpus / "normal.jsonl.gz").stat().st_size / 2**20
        print(f"{name:>36} {size:>8.2f} {m['documents']:>10,} {m['read_errors']:>12} {m['peak_rss_mb']:>12.0f} "
              f"{time.perf_counter() - t0:>8.1f}")
        if m["read_errors"]:
            print(f"{'':>36} read errors: {m['read_error_counts']}")
        if extra:
            extra.unlink()


def speed(folder: Path, mb: int) -> None:
    """tokens/s of the units against a bare encode_batch loop, 1 and 2 workers."""
    corpus = write_jsonl(folder / "speed.jsonl", mb << 20)
    tok_path = folder / "tokenizer.json"
    sample = [t for _, t in zip(range(2000), documents(8 << 20, seed=1))]
    train_tokenizer(sample, 8192, 2, "<|endoftext|>").save(str(tok_path))
    base_tokens, base_s = bare_loop(corpus, tok_path)
    runs = {w: stage(config(folder, str(corpus), tok_path, w, f"speed{w}")) for w in (1, 2)}
    print(f"\nTokenization, {mb} MB of jsonl, {os.cpu_count()} cores, the same tokenizer (vocab 8192)\n")
    print(f"{'':>34} {'tokens':>12} {'seconds':>8} {'tokens/s':>12} {'vs bare loop':>12}")
    base_rate = base_tokens / base_s
    print(f"{'bare encode_batch loop':>34} {base_tokens:>12,} {base_s:>8.2f} {base_rate:>12,.0f} {'1.00x':>12}")
    for w, m in runs.items():
        rate = m["tokens"] / m["tokenize_s"]
        print(f"{f'prepare_data units, {w} worker(s)':>34} {m['tokens']:>12,} {m['tokenize_s']:>8.2f} "
              f"{rate:>12,.0f} {rate / base_rate:>11.2f}x")
    rate = {w: m["tokens"] / m["tokenize_s"] for w, m in runs.items()}
    print(f"\nscaling 1 -> 2 workers: {rate[2] / rate[1]:.2f}x (the bare loop and one worker already use "
          "every core through the tokenizer's own threads)")


def rss(folder: Path, rss_mb: str) -> None:
    """Peak RSS on generated .jsonl.gz and .parquet corpora of two sizes."""
    print("\nPeak RSS of prepare_data (the stage process and its workers), 2 workers, dedup exact\n")
    print(f"{'input':>28} {'MB of text':>10} {'file MB':>8} {'documents':>10} {'peak RSS MB':>12}")
    for mb in (int(x) for x in rss_mb.split(",")):
        for fmt in ("jsonl.gz", "parquet"):
            path = folder / f"rss{mb}.{fmt}"
            if fmt == "parquet":
                write_parquet(path, mb << 20)
            else:
                write_jsonl(path, mb << 20, compress=True)
            m = stage(config(folder, str(path), None, 2, f"rss{mb}{fmt.replace('.', '')}", dedup="exact"))
            print(f"{path.name:>28} {mb:>10} {path.stat().st_size / 2**20:>8.0f} {m['documents']:>10,} "
                  f"{m['peak_rss_mb']:>12.0f}")
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64, help="corpus size for the speed comparison (MB of text)")
    p.add_argument("--rss-mb", default="128,256", help="two corpus sizes for the memory measurement (MB of text)")
    p.add_argument("--sections", default="speed,rss,hostile", help="which measurements, comma-separated")
    p.add_argument("--bomb-gb", type=float, default=3.0, help="decompressed size of the one-line bomb (GB)")
    p.add_argument("--record-mb", type=int, default=500, help="size of the single huge record (MB)")
    p.add_argument("--normal-mb", type=int, default=32, help="the normal corpus beside them (MB of text)")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="llmpipe-prep-bench-") as tmp:
        folder = Path(tmp)
        if "hostile" in sections:
            hostile(folder, args.normal_mb, args.bomb_gb, args.record_mb)
        if "speed" in sections:
            speed(folder, args.mb)
        if "rss" in sections:
            rss(folder, args.rss_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
