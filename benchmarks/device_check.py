"""Device check: one command that says what works on this machine's accelerator, and how fast, in one table.

    python benchmarks/device_check.py [--json OUT]        # or: make device-check

On a CUDA GPU (or an Ascend NPU where torch_npu imports; llmpipe.device decides) it runs, in one process:

- the process group: nccl (hccl), world 1, an all_reduce checked;
- training steps of a ~1B-parameter flavor (llama-1b, dim 2048 x 16 layers; vocabulary --vocab) in bf16
  through the train stage's own loop (llmpipe.train.loop.train: the builder, the strategy, the step,
  metrics, a checkpoint at the end): tokens/s and MFU against the datasheet peak (llmpipe.mfu);
- the same with FSDP2 on one device (train.parallel.data: fsdp), and with train.compile on;
- peak device memory of the eager run against `llmpipe plan`'s estimate for the same config;
- onnxruntime on the accelerator's provider: export_onnx's prefill and static decoder (--ort-flavor,
  random weights) converted to fp16 as the benchmark stage converts them, prefill latency and decode
  tokens/s through llmpipe.infer.decode.StaticEngine (the CPU fp32 graphs beside them), and `generate`
  (the decode loop `llmpipe generate` and the benchmark drive) through it, greedy, against PyTorch fp32.

On a CPU every row that needs the accelerator says "skipped: <why>", and the cheap ones run with small
defaults (debug flavor, gloo, onnxruntime's CPU provider) in well under a minute. Exit status 0 when no
row failed, 1 otherwise; a bad option is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # torch_npu is imported by llmpipe.device alone

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmpipe import device, mfu  # noqa: E402
from llmpipe.models.llama import FLAVORS, model_args  # noqa: E402
from tests.conftest import make_cfg, make_data_dir  # noqa: E402

GIB = 1024 ** 3


@dataclass
class Row:
    key: str
    check: str
    status: str  # ok | skipped | failed
    result: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Settings:
    """What the check runs with: the accelerator's defaults, or the CPU's small ones."""

    device: torch.device
    flavor: str
    vocab: int
    seq: int
    micro: int
    steps: int
    ort_flavor: str
    cache: int
    prompt: int
    new_tokens: int
    batches: list[int]
    compile_on_cpu: bool

    @property
    def accelerated(self) -> bool:
        return self.device.type != "cpu"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    p.add_argument("--flavor", help="training flavor (default: llama-1b on an accelerator, debug on CPU)")
    p.add_argument("--vocab", type=int, help="vocabulary of the synthetic data (default 32000; 512 on CPU)")
    p.add_argument("--seq", type=int, help="training sequence length (default 2048; 64 on CPU)")
    p.add_argument("--micro-batch", type=int, help="training micro-batch (default 4)")
    p.add_argument("--steps", type=int, help="optimizer steps per training row, the first left out (default 8; 3 "
                                             "on CPU)")
    p.add_argument("--ort-flavor", help="flavor exported for onnxruntime (default small; debug on CPU)")
    p.add_argument("--cache", type=int, help="static decoder cache slots (default 1024; 128 on CPU)")
    p.add_argument("--compile-on-cpu", action="store_true",
                   help="also run the train.compile row on CPU (inductor compiles C++: ~20 s or more)")
    p.add_argument("--json", type=Path, help="also write the table as JSON here")
    return p.parse_args(argv)


def settings(a: argparse.Namespace) -> Settings:
    """The resolved settings; SystemExit(2) with one line for an option out of range."""
    def fail(msg: str):
        print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    try:
        dev = device.resolve(a.device)
    except RuntimeError as err:
        fail(f"--device: {err}")
    accel = dev.type != "cpu"
    s = Settings(dev, a.flavor or ("llama-1b" if accel else "debug"), a.vocab or (32000 if accel else 512),
                 a.seq or (2048 if accel else 64), a.micro_batch or 4, a.steps or (8 if accel else 3),
                 a.ort_flavor or ("small" if accel else "debug"), a.cache or (1024 if accel else 128),
                 128 if accel else 16, 128 if accel else 16, [1, 8] if accel else [1], a.compile_on_cpu)
    for opt, name in (("--flavor", s.flavor), ("--ort-flavor", s.ort_flavor)):
        if name not in FLAVORS:
            fail(f"{opt}: unknown flavor {name!r} (known: {', '.join(FLAVORS)})")
    for opt, value, low in (("--vocab", s.vocab, 260), ("--seq", s.seq, 8), ("--micro-batch", s.micro, 1),
                            ("--steps", s.steps, 2), ("--cache", s.cache, 2 * s.prompt)):
        if value < low:
            fail(f"{opt} {value}: must be >= {low}")
    if s.seq > FLAVORS[s.flavor].max_seq_len:
        fail(f"--seq {s.seq}: exceeds {s.flavor}'s max_seq_len {FLAVORS[s.flavor].max_seq_len}")
    if a.json is not None and not a.json.parent.is_dir():
        fail(f"--json: folder {a.json.parent} does not exist")
    return s


def millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def skipped(key: str, check: str, why: str) -> Row:
    return Row(key, check, "skipped", f"skipped: {why}")


# -- the process group ---------------------------------------------------------------------------------

def process_group(s: Settings, folder: Path) -> Row:
    """A single-process group on the device's backend (a file store: no port is opened), one all_reduce."""
    import torch.distributed as dist

    backend = device.dist_backend(s.device)
    device.set_current(s.device)
    t0 = time.perf_counter()
    dist.init_process_group(backend, store=dist.FileStore(str(folder / "pg.store"), 1), rank=0, world_size=1)
    x = torch.arange(1.0, 4.0, device=s.device)
    dist.all_reduce(x)
    device.synchronize(s.device)
    got = x.cpu().tolist()
    dt = time.perf_counter() - t0
    ok = got == [1.0, 2.0, 3.0]
    return Row("process_group", f"process group ({backend})", "ok" if ok else "failed",
               f"{backend}, world {dist.get_world_size()}, all_reduce on {s.device} gave {got}"
               f"{'' if ok else ' (expected [1.0, 2.0, 3.0])'} ({dt:.2f} s)", {"backend": backend, "seconds": dt})


# -- training -------------------------------------------------------------------------------------------

def train_cfg(s: Settings, folder: Path, data: str = "ddp", compiled: bool = False):
    never = 10 ** 6
    return make_cfg(folder, run={"name": "device-check", "artifacts_dir": str(folder / "artifacts"),
                                 "device": s.device.type, "seed": 7},
                    data={"inputs": ["unused"], "seq_len": s.seq, "val_fraction": 0.1,
                          "tokenizer": {"vocab_size": s.vocab}},
                    model={"flavor": s.flavor},
                    train={"nproc_per_node": 1, "micro_batch_size": s.micro, "grad_accum_steps": 1,
                           "max_steps": s.steps, "threads_per_proc": None, "log_every": never, "compile": compiled,
                           "precision": {"dtype": "auto"}, "parallel": {"data": data},
                           "schedule": {"warmup_steps": 1}, "checkpoint": {"every_steps": never, "keep_last": 1},
                           "eval": {"every_steps": never, "batches": 1}})


def train_once(s: Settings, root: Path, data_dir: Path, name: str, **kw) -> dict[str, Any]:
    """One run of the train stage's loop in this process; its steady figures (the first step and any
    step that compiled left out). The run's folder (a checkpoint of the whole state) is removed after."""
    from llmpipe.train import metrics
    from llmpipe.train.loop import train

    out = root / name
    cfg = train_cfg(s, root / f"{name}-cfg", **kw)
    device.reset_peak_memory(s.device)
    summary = train(cfg, data_dir, out)
    recs = [r for r in metrics.read(out / "metrics.jsonl") if "loss" in r]
    steady = [r["tokens_per_s"] for r in recs[1:] if not r.get("compile_s")] or [recs[-1]["tokens_per_s"]]
    stall = [r["checkpoint_stall_s"] for r in metrics.read(out / "metrics.jsonl") if "checkpoint_stall_s" in r]
    shutil.rmtree(out, ignore_errors=True)
    tok_s = statistics.median(steady)
    peak = summary["peak_tflops"]
    fpt = mfu.flops_per_token(model_args(cfg.model, vocab_size=s.vocab), s.seq)
    return {"cfg": cfg, "tokens_per_s": tok_s, "steady_steps": len(steady), "loss": summary["final_loss"],
            "mfu": mfu.mfu(tok_s, fpt, peak * 1e12 if peak else None), "peak_tflops": peak,
            "peak_source": summary["peak_source"], "params": summary["params"],
            "peak_memory_bytes": device.peak_memory_bytes(s.device), "compile_s": summary["compile_time_s"],
            "checkpoint_stall_s": stall[-1] if stall else None}


def rate(r: dict[str, Any]) -> str:
    m = "MFU n/a" if r["mfu"] is None else f"MFU {100 * r['mfu']:.1f}% of {r['peak_tflops']:.4g} TFLOPS"
    return f"{r['tokens_per_s']:,.0f} tokens/s, {m}, loss {r['loss']:.3f}"


def training_rows(s: Settings, root: Path) -> list[Row]:
    precision = device.precision(s.device, "auto")
    what = f"{s.flavor} {precision}, micro-batch {s.micro} x seq {s.seq}, {s.steps} steps"
    data_dir = make_data_dir(root / "data", seq_len=s.seq, vocab=s.vocab, n_docs=max(200, 4 * s.micro * s.steps *
                                                                                        s.seq // 100))
    rows: list[Row] = []
    eager = None
    try:
        eager = train_once(s, root, data_dir, "eager")
        rows.append(Row("train_eager", f"train, eager ({what})", "ok",
                        f"{rate(eager)} ({millions(eager['params'])} parameters; peak: {eager['peak_source']})",
                        {k: v for k, v in eager.items() if k != "cfg"}))
    except Exception as err:  # a device check reports what broke and goes on
        rows.append(Row("train_eager", f"train, eager ({what})", "failed", first_line(err)))
    try:
        fsdp = train_once(s, root, data_dir, "fsdp", data="fsdp")
        ratio = f", {fsdp['tokens_per_s'] / eager['tokens_per_s']:.2f}x eager" if eager else ""
        rows.append(Row("train_fsdp2", "train, FSDP2 on one device", "ok", f"{rate(fsdp)}{ratio}",
                        {k: v for k, v in fsdp.items() if k != "cfg"}))
    except Exception as err:
        rows.append(Row("train_fsdp2", "train, FSDP2 on one device", "failed", first_line(err)))
    rows.append(compile_row(s, root, data_dir, eager))
    rows.append(memory_row(s, eager))
    return rows


def compile_row(s: Settings, root: Path, data_dir: Path, eager: dict | None) -> Row:
    check = "train.compile on vs off"
    if not s.accelerated and not s.compile_on_cpu:
        return skipped("train_compile", check, "on CPU inductor compiles C++ for ~20 s and more (benchmarks/"
                                               "compile.py measures it); pass --compile-on-cpu to run it")
    try:
        device.compile_backend(s.device)
        comp = train_once(s, root, data_dir, "compiled", compiled=True)
    except Exception as err:
        return Row("train_compile", check, "failed", first_line(err))
    vs = f"compiled / eager {comp['tokens_per_s'] / eager['tokens_per_s']:.2f}x, " if eager else ""
    return Row("train_compile", check, "ok", f"{vs}{rate(comp)}, compiling took {comp['compile_s'] or 0:.1f} s",
               {k: v for k, v in comp.items() if k != "cfg"})


def memory_row(s: Settings, eager: dict | None) -> Row:
    check = "peak device memory vs llmpipe plan"
    if not s.accelerated:
        return skipped("memory_vs_plan", check, "no accelerator: a CPU's peak RSS holds the whole runtime "
                                                "(benchmarks/build_memory.py compares it with the plan)")
    if eager is None:
        return Row("memory_vs_plan", check, "failed", "the eager training row failed; nothing to compare")
    from llmpipe.tools.plan import plan

    planned = plan(eager["cfg"], world_size=1).memory.total
    measured = eager["peak_memory_bytes"]
    return Row("memory_vs_plan", check, "ok", f"measured {measured / GIB:.2f} GiB, planned {planned / GIB:.2f} GiB "
                                              f"(measured / planned {measured / planned:.2f})",
               {"measured_bytes": measured, "planned_bytes": planned})


# -- onnxruntime ----------------------------------------------------------------------------------------

def accelerator_provider(s: Settings):
    """(onnxruntime provider of this accelerator, None) or (None, why not)."""
    import onnxruntime as ort

    if not s.accelerated:
        return None, "no accelerator here (torch sees no CUDA or NPU device)"
    try:
        return device.ort_providers([s.device.type])[0], None
    except ValueError:
        return None, (f"this onnxruntime build has no provider for {s.device.type} (available: "
                      f"{', '.join(ort.get_available_providers())})")


def ort_rows(s: Settings, root: Path) -> list[Row]:
    from llmpipe.bench.llm import LlmPlan
    from llmpipe.export.onnx import export_prefill, export_static_decoder
    from llmpipe.infer.decode import StaticEngine
    from llmpipe.infer.ort import convert_fp16, create_session
    from llmpipe.models.llama import Transformer

    base = FLAVORS[s.ort_flavor]
    args = type(base)(**{**base.to_dict(), "vocab_size": s.vocab, "max_seq_len": max(base.max_seq_len, s.cache)})
    model = Transformer(args)
    model.init_weights(seed=0)
    model.eval()
    folder = root / "onnx"
    fp32 = {"prefill": folder / "fp32" / "model.onnx", "decoder": folder / "fp32" / "decoder_static.onnx"}
    fp32["prefill"].parent.mkdir(parents=True)
    export_prefill(model, fp32["prefill"], opset=17)
    export_static_decoder(model, fp32["decoder"], opset=17, length=s.cache)
    plan = LlmPlan(prompt_lens=[s.prompt], batches=s.batches, decode_prompt_len=s.prompt, new_tokens=s.new_tokens,
                   repeats=3, vocab_size=s.vocab)
    what = f"{s.ort_flavor} ({millions(args.num_params())}), cache {s.cache}"
    engines: dict[str, Any] = {}
    rows = []
    cpu = device.ort_providers(["cpu"])[0]
    engines["cpu"] = StaticEngine(create_session(fp32["prefill"], cpu, None),
                                  create_session(fp32["decoder"], cpu, None), args, s.cache)
    rows += measured_rows("cpu_fp32", f"ORT {cpu.name} fp32, {what}", engines["cpu"], plan)
    provider, why = accelerator_provider(s)
    acc = f"ORT {s.device.type if s.accelerated else 'accelerator'} fp16, {what}"
    if provider is None:
        rows += [skipped("ort_prefill_device_fp16", f"{acc}: prefill", why),
                 skipped("ort_decode_device_fp16", f"{acc}: decode", why)]
    else:
        try:
            fp16 = {k: folder / "fp16" / p.name for k, p in fp32.items()}
            fp16["prefill"].parent.mkdir()
            for k in fp32:
                convert_fp16(fp32[k], fp16[k])
            engines["device"] = StaticEngine(create_session(fp16["prefill"], provider, None),
                                             create_session(fp16["decoder"], provider, None), args, s.cache)
            rows += measured_rows("device_fp16", acc, engines["device"], plan)
        except Exception as err:
            rows += [Row("ort_prefill_device_fp16", f"{acc}: prefill", "failed", first_line(err)),
                     Row("ort_decode_device_fp16", f"{acc}: decode", "failed", first_line(err))]
    rows += growing_rows(s, model, args, folder, plan, what)
    rows += optimised_rows(s, model, args, root, plan, what, provider, why)
    rows.append(torch_decode_row(s, model, plan, what))
    rows.append(generate_row(s, model, engines.get("device", engines["cpu"]),
                             f"{s.device.type} fp16" if "device" in engines else "cpu fp32"))
    return rows


def optimised_rows(s: Settings, model, args, root: Path, plan, what: str, provider, why: str | None) -> list[Row]:
    """The ORT-optimised graph (onnxruntime-genai's builder on the model's hf/ folder; fused attention over the
    filled cache, rotary, norms) through FusedEngine: fp32 on the CPU provider, and fp16 on the accelerator's
    provider (the builder's CUDA graph, the cache in the GPU's memory) where there is one. The builder writes
    no graph for CANN: on an NPU that row says so."""
    from llmpipe.data.tokenizer import train_tokenizer
    from llmpipe.export import fused
    from llmpipe.infer.fused import FusedEngine, GraphConfig
    from llmpipe.infer.ort import create_session

    check = "ORT optimised graph (builder: fused attention over the filled cache, rotary, norms)"
    reason = fused.unavailable_reason()
    if reason:
        return [skipped("ort_optimised", check, reason)]
    try:
        hf = fused.write_hf_folder(model, root / "hf", train_tokenizer(["def main():\n    return 0\n"] * 20, 300))
        cpu = device.ort_providers(["cpu"])[0]
        built = fused.build(hf, root / "ort-cpu", "fp32").parent
        engine = FusedEngine(create_session(built / "model.onnx", cpu, None), GraphConfig.read(built), s.cache)
    except Exception as err:
        return [Row("ort_optimised", f"{check}, cpu fp32", "failed", first_line(err))]
    rows = measured_rows("optimised_cpu_fp32", f"{check}, cpu fp32, {what}", engine, plan)
    acc = f"{check}, {s.device.type if s.accelerated else 'accelerator'} fp16, {what}"
    if provider is None:
        return rows + [skipped("ort_optimised_device", acc, why)]
    if provider.name != "cuda":
        return rows + [skipped("ort_optimised_device", acc, f"onnxruntime-genai's builder writes no graph for "
                                                            f"{provider.name}; the NPU runs the portable graphs")]
    try:
        built = fused.build(hf, root / "ort-cuda", "fp16", provider="cuda").parent
        engine = FusedEngine(create_session(built / "model.onnx", provider, None), GraphConfig.read(built), s.cache)
    except Exception as err:
        return rows + [Row("ort_optimised_device", acc, "failed", first_line(err))]
    return rows + measured_rows("optimised_device_fp16", acc, engine, plan) + [
        generate_row(s, model, engine, "cuda fp16, ORT-optimised graph", key="generate_optimised")]


def growing_rows(s: Settings, model, args, folder: Path, plan, what: str) -> list[Row]:
    """decoder_ort.onnx through GrowingEngine on the CPU provider: the cache fed up to the filled bucket."""
    from llmpipe.export.onnx import export_ort_decoder
    from llmpipe.infer.decode import GrowingEngine
    from llmpipe.infer.ort import create_session

    check = f"ORT cpu fp32 growing cache (decoder_ort.onnx), {what}"
    try:
        path = folder / "fp32" / "decoder_ort.onnx"
        export_ort_decoder(model, path, opset=17, length=s.cache)
        cpu = device.ort_providers(["cpu"])[0]
        engine = GrowingEngine(create_session(folder / "fp32" / "model.onnx", cpu, None),
                               create_session(path, cpu, None), args, s.cache)
    except Exception as err:
        return [Row("ort_decode_cpu_growing", f"{check}: decode", "failed", first_line(err))]
    return measured_rows("cpu_growing", check, engine, plan)[1:]


def torch_decode_row(s: Settings, model, plan, what: str) -> Row:
    """PyTorch eager with its KV cache on the device (bf16 on an accelerator), the baseline an engine beats."""
    import copy

    from llmpipe.bench.llm import measure_decode
    from llmpipe.infer.decode import TorchEngine

    dtype = torch.bfloat16 if s.accelerated else torch.float32
    check = f"decode through PyTorch eager on {s.device.type} {str(dtype).split('.')[-1]}, {what}"
    try:
        engine = TorchEngine(copy.deepcopy(model).to(s.device, dtype), s.device)
        rows = measure_decode(engine, plan)
    except Exception as err:
        return Row("torch_decode", check, "failed", first_line(err))
    bad = [r for r in rows if r["error"]]
    if bad:
        return Row("torch_decode", check, "failed", bad[0]["error"])
    text = ", ".join(f"batch {r['batch']}: {r['decode_tokens_per_s']:,.0f} tokens/s (TPOT {r['tpot_ms']:.2f} ms)"
                     for r in rows)
    return Row("torch_decode", check, "ok", text, {"rows": rows})


def measured_rows(key: str, check: str, engine, plan) -> list[Row]:
    from llmpipe.bench.llm import measure_decode, measure_prefill

    prefill = measure_prefill(engine, plan)[0]
    if prefill["error"]:
        out = [Row(f"ort_prefill_{key}", f"{check}: prefill", "failed", prefill["error"])]
    else:
        out = [Row(f"ort_prefill_{key}", f"{check}: prefill", "ok",
                   f"prompt {prefill['prompt_len']}: prefill {prefill['prefill_ms']:.2f} ms, TTFT "
                   f"{prefill['ttft_ms']:.2f} ms", prefill)]
    decode = measure_decode(engine, plan)
    bad = [r for r in decode if r["error"]]
    if bad:
        return out + [Row(f"ort_decode_{key}", f"{check}: decode", "failed", bad[0]["error"])]
    text = ", ".join(f"batch {r['batch']}: {r['decode_tokens_per_s']:,.0f} tokens/s (TPOT {r['tpot_ms']:.2f} ms)"
                     for r in decode)
    return out + [Row(f"ort_decode_{key}", f"{check}: decode", "ok", f"{text}; prompt {plan.decode_prompt_len}, "
                                                                      f"{plan.new_tokens} new tokens",
                      {"rows": decode})]


def generate_row(s: Settings, model, engine, label: str, key: str = "generate") -> Row:
    """`generate` (llmpipe.infer.decode) through the engine, greedy, against PyTorch fp32's KV-cache decoding."""
    from llmpipe.export.onnx import random_ids
    from llmpipe.infer.decode import TorchEngine, generate

    check = f"generate through ORT {label}"
    try:
        prompt = random_ids(1, s.prompt, s.vocab, 3)
        greedy = lambda logits: logits.argmax(-1)  # noqa: E731
        got = generate(engine, prompt, s.new_tokens, greedy)
        ref = generate(TorchEngine(model), prompt, s.new_tokens, greedy).tokens[0]
    except Exception as err:
        return Row(key, check, "failed", first_line(err))
    tokens = got.tokens[0]
    same = int(np.argmin(tokens == ref)) if not (tokens == ref).all() else len(ref)
    return Row(key, check, "ok", f"{len(tokens)} tokens, TTFT {got.ttft_s * 1e3:.1f} ms, "
                                        f"{got.decode_tokens_per_s():,.0f} tokens/s; greedy tokens equal to PyTorch "
                                        f"fp32's for the first {same} of {len(ref)}",
               {"tokens": tokens.tolist(), "torch_tokens": ref.tolist(), "same_prefix": same})


# -- the table ------------------------------------------------------------------------------------------

def table(rows: list[Row]) -> str:
    lines = ["| check | status | result |", "|---|---|---|"]
    lines += [f"| {r.check} | {r.status} | {r.result.replace('|', '/')} |" for r in rows]
    return "\n".join(lines)


def header(s: Settings) -> dict[str, Any]:
    import onnxruntime as ort

    return {"device": str(s.device), "device_name": device.device_name(s.device), "torch": torch.__version__,
            "onnxruntime": ort.__version__, "ort_providers": ort.get_available_providers()}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    s = settings(a)
    t0 = time.perf_counter()
    info = header(s)
    print(f"device check on {info['device']} ({info['device_name']}), torch {info['torch']}, onnxruntime "
          f"{info['onnxruntime']} ({', '.join(info['ort_providers'])})", file=sys.stderr, flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="llmpipe-device-check-") as tmp:
        root = Path(tmp)
        for part in (process_group, training_rows, ort_rows):
            try:
                got = part(s, root)
            except Exception as err:
                got = Row(part.__name__, part.__name__.replace("_", " "), "failed", first_line(err))
            rows += got if isinstance(got, list) else [got]
            print(f"  ... {part.__name__} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    wall = time.perf_counter() - t0
    print(table(rows))
    print(f"\n{sum(r.status == 'ok' for r in rows)} ok, {sum(r.status == 'skipped' for r in rows)} skipped, "
          f"{sum(r.status == 'failed' for r in rows)} failed in {wall:.0f} s")
    if a.json is not None:
        from llmpipe.manifest import write_json_atomic

        write_json_atomic(a.json, {**info, "settings": {k: str(v) for k, v in asdict(s).items()}, "wall_s": wall,
                                   "rows": [asdict(r) for r in rows]})
    return 1 if any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
