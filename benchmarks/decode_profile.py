"""Where a decode step's time goes: onnxruntime's own profiler over FusedEngine's decode, summed by op type.

    python benchmarks/decode_profile.py GRAPH_FOLDER [--threads 1] [--prompt 100] [--new 64] [--repeats 3]

GRAPH_FOLDER is one of the builder's graph folders (the benchmark stage's variants, or quant_recipes.py's
--work folders). Prints decode tokens/s without the profiler (median of --repeats), then, from a second session
with onnxruntime's profiler on, each op type's microseconds per decode step and its share of the step's
kernel time. The profiler slows every node by about the same few microseconds, so the shares of many small
nodes read high; the tokens/s line is the unprofiled speed. docs/measurements/quantisation.md reads it to say
how close the weight matmuls are to the memory's bandwidth and what the rest of the step costs.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmpipe.infer import native
from llmpipe.infer.fused import FusedEngine, GraphConfig
from llmpipe.infer.ort import session_options


def engine(folder: Path, threads: int, cache: int, profile_prefix: str | None = None) -> FusedEngine:
    opts = session_options(threads)
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    native.register(opts, folder / "model.onnx")  # llmpipe.Q4Gemv, when the graph uses it
    session = ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    return FusedEngine(session, GraphConfig.read(folder), cache)


def decode(e: FusedEngine, prompt: np.ndarray, new: int) -> float:
    """Greedy decode of `new` tokens after `prompt`; tokens/s of the steps after the first."""
    e.reserve(prompt.shape[1] + new)
    tok = e.start(prompt).argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new - 1):
        tok = e.step(tok).argmax(-1)
    return (new - 1) / (time.perf_counter() - t0)


def by_op(trace: list[dict], steps: int) -> list[tuple[str, float, int]]:
    """(op type, microseconds per step, nodes per step) from an onnxruntime profile, most expensive first."""
    total, count = collections.Counter(), collections.Counter()
    for event in trace:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event["args"]["op_name"]
            total[op] += event["dur"]
            count[op] += 1
    return [(op, us / steps, round(count[op] / steps)) for op, us in total.most_common()]


WEIGHT_OPS = ("MatMulNBits", "MatMul", "MatMulInteger")
_MODULE = re.compile(r"/(lm_head|[a-z_]+_proj)/")


def by_weight(trace: list[dict], steps: int) -> list[tuple[str, float, int]]:
    """The weight matmuls' time by module (lm_head, qkv_proj, gate_proj, ...: the builder's node names), summed
    over the layers: (module, microseconds per step, nodes per step), most expensive first."""
    total, count = collections.Counter(), collections.Counter()
    for event in trace:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time") \
                and event["args"]["op_name"] in WEIGHT_OPS:
            match = _MODULE.search(event["name"])
            module = match.group(1) if match else "other"
            total[module] += event["dur"]
            count[module] += 1
    return [(m, us / steps, round(count[m] / steps)) for m, us in total.most_common()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    prompt = np.random.default_rng(0).integers(100, 40000, (1, a.prompt))
    cache = a.prompt + a.new + 8

    plain = engine(a.folder, a.threads, cache)
    speeds = [decode(plain, prompt, a.new) for _ in range(a.repeats)]
    print(f"decode: {statistics.median(speeds):.1f} tok/s (median of {a.repeats}: "
          f"{min(speeds):.1f}-{max(speeds):.1f}), {a.threads} thread(s), batch 1")

    profiled = engine(a.folder, a.threads, cache, profile_prefix=str(a.folder / "decode_profile"))
    # profile only decode steps: the prompt's pass is one run among them and is left out by counting steps
    decode(profiled, prompt, a.new)
    trace_path = Path(profiled.session.end_profiling())
    trace = json.loads(trace_path.read_text())
    trace_path.unlink()
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    steps = [e for e in trace if e.get("cat") == "Node"]
    first_step = runs[1]["ts"] if len(runs) > 1 else 0
    decode_events = [e for e in steps if e["ts"] >= first_step]
    rows = by_op(decode_events, max(len(runs) - 1, 1))
    weights = by_weight(decode_events, max(len(runs) - 1, 1))
    kernel = sum(us for _, us, _ in rows) or 1.0
    print(f"{'op type':36s} {'us/step':>9s} {'share':>6s} {'nodes':>6s}")
    for op, us, nodes in rows:
        print(f"{op:36s} {us:9.1f} {us / kernel:6.1%} {nodes:6d}")
    matmuls = sum(us for _, us, _ in weights) or 1.0
    print(f"\n{'weight matmuls by module':36s} {'us/step':>9s} {'share':>6s} {'nodes':>6s}")
    for module, us, nodes in weights:
        print(f"{module:36s} {us:9.1f} {us / matmuls:6.1%} {nodes:6d}")
    if a.json:
        a.json.write_text(json.dumps({"folder": str(a.folder), "threads": a.threads, "tok_s": speeds,
                                      "ops": [{"op": op, "us_per_step": us, "nodes": n} for op, us, n in rows],
                                      "weights": [{"module": m, "us_per_step": us, "nodes": n}
                                                  for m, us, n in weights]},
                                     indent=1))


if __name__ == "__main__":
    main()
