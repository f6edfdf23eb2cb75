"""llmpipe's 4-bit kernel (llmpipe/infer/native/q4_kernel.h), alone and as the onnxruntime op llmpipe.Q4Gemv,
against onnxruntime's MatMulNBits on the same weights, in one run: what it gains over MLAS on a decode step's
weight matmuls.

    python benchmarks/q4_kernel.py [--layers 30] [--threads 1,2] [--rounds 5] [--json out.json]

The matrices are SmolLM2-135M's body (per layer q, k, v, o, gate, up, down: 576x576, 192x576 twice, 576x576,
1536x576 twice, 576x1536; 30 layers, 106 M weights, the head excluded), with random 4-bit codes, scales and
zero points, each matrix fed its own random activation as one decode step feeds it its input. Rows:

- `mlas`: one onnxruntime session holding a MatMulNBits node per matrix (4 bits, blocks of 32, integer zero
  points, accuracy level 4: int8 activations in blocks of 32), the fastest form of MatMulNBits (integer zero
  points need no fold); one `run` is one step's matmuls, with its dispatch of each node;
- `q4_op`: the same session with a llmpipe.Q4Gemv node per matrix (llmpipe.infer.native: compiled with `cc`
  on first use, the session's thread count given as native.register gives it), what the int4 graph runs at
  benchmark.quantize.int4.kernel: llmpipe;
- `q4_gemv`: the kernel alone (benchmarks/kernels/q4_gemv.c around the same header, compiled here with
  OpenMP), looping over the matrices in C: the op's speed without onnxruntime's per-node cost.

The op and the kernel take the same codes in their own layout with float zero points (d * q + m: HQQ's zero
points need no fold there). Each row is timed as the fastest of 20 repetitions, `--rounds` times, the rows
alternating; medians and ranges printed, with the ratios. Each row's error against the fp32 product of the
dequantised weights (max |diff| / max |ref| over all matrices) is printed beside it: all quantise the
activation the same way, so all should be near 5e-3. Exit status 1 when the op's or the kernel's error is
more than twice MLAS's (a wrong kernel).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from llmpipe.infer import native

SOURCE = Path(__file__).resolve().parent / "kernels" / "q4_gemv.c"
HEADER = native.SOURCES[1]
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    have = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            break
    return all(f in have for f in flags)


def build_kernel(out_dir: Path) -> Path:
    """Compiles q4_gemv.c into out_dir (argv, no shell); the file name carries the source's hash."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("q4_kernel: no C compiler (cc) on PATH")
    if not cpu_has("avx2", "fma", "f16c"):
        raise SystemExit("q4_kernel: this CPU lacks AVX2, FMA or F16C, which the kernel needs")
    digest = hashlib.sha256(SOURCE.read_bytes() + HEADER.read_bytes()).hexdigest()[:12]
    lib = out_dir / f"libq4_gemv-{digest}.so"
    if not lib.exists():
        tmp = lib.with_suffix(".tmp.so")
        subprocess.run([cc, "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-I",
                        str(HEADER.parent), "-o", str(tmp), str(SOURCE)], check=True)
        tmp.replace(lib)
    return lib


def make_matrix(rng: np.random.Generator, n: int, k: int) -> dict:
    nb = k // 32
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = (rng.random((n, nb), dtype=np.float32) * 0.02 + 0.002).astype(np.float16).astype(np.float32)
    zeros = rng.integers(0, 16, (n, nb), dtype=np.uint8)
    return {"n": n, "k": k, "codes": codes, "scales": scales, "zeros": zeros,
            "x": rng.standard_normal((1, k), dtype=np.float32)}


def dequantised(mat: dict) -> np.ndarray:
    z = np.repeat(mat["zeros"].astype(np.float32), 32, axis=1)
    s = np.repeat(mat["scales"], 32, axis=1)
    return (mat["codes"].astype(np.float32) - z) * s  # [n, k]


def nbits_inputs(mat: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' layout: [n, blocks, 16] bytes (w[2j] low nibble, w[2j+1] high), scales, packed zeros."""
    n, k = mat["n"], mat["k"]
    c = mat["codes"].reshape(n, k // 32, 16, 2)
    packed = (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8)
    z = mat["zeros"]
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
    zp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    return packed, mat["scales"].reshape(-1), zp


def kernel_inputs(mat: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's layout (llmpipe.infer.native.pack): w = d * q + m with m = -zero * d."""
    return native.pack(mat["codes"], mat["scales"], -mat["zeros"].astype(np.float32) * mat["scales"])


def _session(mats: list[dict], threads: int, op: str, domain: str, weights, attrs: dict,
             library: bool) -> ort.InferenceSession:
    """One node `domain.op` per matrix over its `weights(mat)` (three arrays), in one onnxruntime session."""
    nodes, inits, inputs, outputs = [], [], [], []
    for i, mat in enumerate(mats):
        names = [f"w{i}_{j}" for j in range(3)]
        inits += [numpy_helper.from_array(a, n) for a, n in zip(weights(mat), names)]
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, mat["k"]]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, mat["n"]]))
        nodes.append(helper.make_node(op, [f"x{i}", *names], [f"y{i}"], domain=domain, K=mat["k"], N=mat["n"],
                                      **attrs))
    graph = helper.make_graph(nodes, "q4_body", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if library:
        so.add_session_config_entry(native.THREADS_ENTRY, str(threads))  # as native.register sets it
        so.register_custom_ops_library(str(native.library()))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def mlas_session(mats: list[dict], threads: int) -> ort.InferenceSession:
    """MatMulNBits at 4 bits, blocks of 32, integer zero points, accuracy level 4."""
    return _session(mats, threads, "MatMulNBits", "com.microsoft", nbits_inputs,
                    {"bits": 4, "block_size": 32, "accuracy_level": 4}, library=False)


def op_session(mats: list[dict], threads: int) -> ort.InferenceSession:
    """The same matrices as llmpipe.Q4Gemv nodes (the custom op the int4 graph runs at kernel: llmpipe)."""
    return _session(mats, threads, native.OP, native.DOMAIN, kernel_inputs, {"layout": native.LAYOUT}, library=True)


class Kernel:
    def __init__(self, lib: Path, mats: list[dict]):
        self.lib = ctypes.CDLL(str(lib))
        self.lib.q4_run.restype = ctypes.c_double
        self.n = len(mats)
        self.keep = [kernel_inputs(m) for m in mats]
        self.x = [np.ascontiguousarray(m["x"].reshape(-1)) for m in mats]
        self.y = [np.zeros(m["n"], np.float32) for m in mats]
        def ptrs(arrs):
            return (ctypes.c_void_p * self.n)(*[a.ctypes.data for a in arrs])

        self.args = ((ctypes.c_int * self.n)(*[m["n"] for m in mats]), (ctypes.c_int * self.n)(*[m["k"] for m in mats]),
                     ptrs([q for q, _, _ in self.keep]), ptrs([d for _, d, _ in self.keep]),
                     ptrs([m for _, _, m in self.keep]), ptrs(self.x), ptrs(self.y))

    def run(self, reps: int, threads: int) -> float:
        return self.lib.q4_run(self.n, *self.args, reps, threads)


def rel_error(outs: list[np.ndarray], refs: list[np.ndarray]) -> float:
    return max(float(np.abs(o.reshape(-1) - r.reshape(-1)).max()) for o, r in zip(outs, refs)) / max(
        float(np.abs(r).max()) for r in refs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    mats = [make_matrix(rng, n, k) for _ in range(args.layers) for n, k in LAYER_SHAPES]
    refs = [m["x"] @ dequantised(m).T for m in mats]
    weights = sum(m["n"] * m["k"] for m in mats)
    with tempfile.TemporaryDirectory() as tmp:
        kernel = Kernel(build_kernel(Path(tmp)), mats)
        feeds = {f"x{i}": m["x"] for i, m in enumerate(mats)}
        result = {"layers": args.layers, "weights": weights, "rows": {}}
        for threads in [int(t) for t in args.threads.split(",")]:
            sessions = {"mlas": mlas_session(mats, threads), "q4_op": op_session(mats, threads)}
            kernel.run(1, threads)
            err = {name: rel_error(s.run(None, feeds), refs) for name, s in sessions.items()}
            err["q4_gemv"] = rel_error(kernel.y, refs)
            times = {"mlas": [], "q4_op": [], "q4_gemv": []}
            for _ in range(args.rounds):
                for name, sess in sessions.items():
                    best = float("inf")
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        sess.run(None, feeds)
                        best = min(best, time.perf_counter() - t0)
                    times[name].append(best)
                times["q4_gemv"].append(kernel.run(args.reps, threads))
            row = {}
            for name in ("mlas", "q4_op", "q4_gemv"):
                med = statistics.median(times[name])
                row[name] = {"ms_median": med * 1e3, "ms_min": min(times[name]) * 1e3, "ms_max": max(times[name]) * 1e3,
                             "gweights_per_s": weights / med / 1e9, "rel_error": err[name]}
                print(f"{threads} thr  {name:8s} {med * 1e3:6.2f} ms ({min(times[name]) * 1e3:.2f}-"
                      f"{max(times[name]) * 1e3:.2f})  {weights / med / 1e9:5.1f} G weights/s  error {err[name]:.2e}")
            row["ratio"] = row["mlas"]["ms_median"] / row["q4_gemv"]["ms_median"]
            row["op_ratio"] = row["mlas"]["ms_median"] / row["q4_op"]["ms_median"]
            print(f"{threads} thr  speed over mlas: q4_gemv {row['ratio']:.2f}x, q4_op {row['op_ratio']:.2f}x")
            result["rows"][f"{threads}thr"] = row
            for name in ("q4_gemv", "q4_op"):
                if err[name] > 2 * err["mlas"] + 1e-6:
                    print(f"q4_kernel: {name}'s error {err[name]:.2e} is more than twice MLAS's", file=sys.stderr)
                    return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
