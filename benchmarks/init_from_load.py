"""model.init_from: time to load a Hugging Face folder's weights into llmpipe's model, against reading
the same safetensors files once, in the same run.

    python benchmarks/init_from_load.py [--dim 1024 --layers 8] [--repeat 3]

The folder is written here by transformers (random weights, sharded safetensors). Both sides read
from the page cache (the files were just written, and each measurement reads them once before).

    raw read     reading every safetensors file's bytes (open + read, in 64 MiB chunks)
    llmpipe      checking the folder (config.json, headers), building the model on the meta device,
                 allocating it and filling every parameter from the memory-mapped files
                 (llmpipe.parallel.builder.build_part, the DDP / one-process path)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_folder(folder: Path, dim: int, layers: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(vocab_size=32000, hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 64 * 64,
                    num_hidden_layers=layers, num_attention_heads=dim // 64, num_key_value_heads=dim // 128,
                    max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(c)
    model.save_pretrained(folder, max_shard_size="200MB")
    (folder / "tokenizer.json").write_text("{}")  # not read here
    return sum(p.numel() for p in model.parameters())


def raw_read(folder: Path) -> float:
    t0 = time.perf_counter()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def llmpipe_load(folder: Path) -> float:
    from llmpipe.device import Env
    from llmpipe.models.llama import hf
    from llmpipe.parallel.builder import BuildOptions, build_part
    from tests.conftest import make_cfg

    t0 = time.perf_counter()
    cfg = make_cfg(folder.parent / "cfg", model={"init_from": str(folder)}, data={"seq_len": 32})
    args = hf.read_config(folder)[0]
    model = build_part(BuildOptions.from_config(cfg), Env(0, 1, torch.device("cpu"), "fp32"), args)
    elapsed = time.perf_counter() - t0
    del model
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        n = write_folder(folder, a.dim, a.layers)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        raw_read(folder)  # warm the page cache for both sides
        raw, ours = [], []
        for _ in range(a.repeat):  # alternating, so drift hits both alike
            raw.append(raw_read(folder))
            ours.append(llmpipe_load(folder))
    r, o = statistics.median(raw), statistics.median(ours)
    print(f"\n{n / 1e6:.0f}M parameters, {size / 2**30:.2f} GiB of safetensors, median of {a.repeat}\n")
    print(f"raw read         {r:7.3f} s   ({size / 2**30 / r:.2f} GiB/s)")
    print(f"llmpipe load     {o:7.3f} s   (check + build on meta + allocate + fill)")
    print(f"ratio            {o / r:7.2f}x  (goal <= 1.5x)")


if __name__ == "__main__":
    main()
