"""The output head's matmul alone, on onnxruntime's CPU kernels: what the int4 default runs it with (an 8-bit
MatMulNBits, blocks of 32, int8 activations) beside the other 8-bit kernels a graph could use, in one run.

    python benchmarks/head_kernels.py --hf HF_FOLDER [--threads 1,2] [--json out.json]

The head of a small model is a large share of its decode step (SmolLM2-135M: a 49152 x 576 tied embedding,
a fifth of the parameters, read once a token; benchmarks/decode_profile.py splits the step's weight matmuls by
module). Each row is a one-node graph (or the few standard ops of one) over the model's own head weight, timed
at batch 1 (one token's hidden state), median of 5 runs of 200 calls after a warm-up, each row's runs
alternating with the others'. Rows:

- `nbits8-b<block>`: MatMulNBits, 8 bits, asymmetric, that block size, accuracy level 4 (onnxruntime's
  quantiser, as llmpipe.infer.ort.quantize_weight_only makes the head);
- `matmulinteger`: DynamicQuantizeLinear (the hidden state to uint8, one scale) + MatMulInteger over int8
  weights with one scale per output column + the rescale: standard ONNX ops, MLAS's QGEMM;
- `fp32`: MatMul, the baseline.

Each row's error against fp32 on the same input (max |diff| / max |fp32|) is printed beside its time: a
faster kernel that moves the logits is no faster kernel for the head.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def head_weight(hf: Path) -> np.ndarray:
    """The model's output head as [hidden, vocab] fp32 (lm_head.weight, or the tied embedding)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(hf / "model.safetensors"))
    w = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    if w is None:
        raise SystemExit(f"{hf / 'model.safetensors'}: no lm_head.weight or model.embed_tokens.weight")
    return np.ascontiguousarray(w.astype(np.float32).T)


def fp32_graph(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def nbits_graph(w: np.ndarray, block: int) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=False, accuracy_level=4, bits=8)
    quantizer = MatMulNBitsQuantizer(fp32_graph(w), algo_config=config)
    quantizer.process()
    return quantizer.model.model


def matmulinteger_graph(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    scale = np.maximum(np.abs(w).max(0), 1e-12).astype(np.float32) / 127
    wq = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "Wq", "xz"], ["yi"]),
             helper.make_node("Cast", ["yi"], ["yf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "scale"], ["s"]),
             helper.make_node("Mul", ["yf", "s"], ["y"])]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(wq, "Wq"), numpy_helper.from_array(scale, "scale")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    from llmpipe.infer.ort import session_options

    return ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"])


def calls_us(s: ort.InferenceSession, x: np.ndarray, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        s.run(None, {"x": x})
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", type=Path, required=True, help="Hugging Face folder (model.safetensors)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--blocks", default="32,128")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    w = head_weight(a.hf)
    # a hidden state of the head's own scale: the final norm's output is about unit RMS per feature
    x = np.random.default_rng(0).standard_normal((1, w.shape[0])).astype(np.float32)
    graphs = {"fp32": fp32_graph(w), "matmulinteger": matmulinteger_graph(w)}
    graphs.update({f"nbits8-b{b}": nbits_graph(w, b) for b in (int(v) for v in a.blocks.split(","))})
    results = {}
    for threads in (int(t) for t in a.threads.split(",")):
        sessions = {name: session(g, threads) for name, g in graphs.items()}
        ref = sessions["fp32"].run(None, {"x": x})[0]
        times = {name: [] for name in sessions}
        for s in sessions.values():
            calls_us(s, x, 20)
        for _ in range(a.repeats):  # alternate the rows: the machine's load drifts between runs
            for name, s in sessions.items():
                times[name].append(calls_us(s, x, a.calls))
        base = statistics.median(times["nbits8-b32"]) if "nbits8-b32" in times else None
        print(f"\n{threads} thread(s), head {w.shape[0]} x {w.shape[1]}")
        print(f"{'kernel':16s} {'us/call':>9s} {'(min-max)':>15s} {'vs nbits8-b32':>14s} {'rel. error':>11s}")
        for name, s in sessions.items():
            y = s.run(None, {"x": x})[0]
            err = float(np.abs(y - ref).max() / np.abs(ref).max())
            med = statistics.median(times[name])
            ratio = f"{base / med:.2f}x" if base else "-"
            print(f"{name:16s} {med:9.0f} {min(times[name]):7.0f}-{max(times[name]):<7.0f} {ratio:>14s} {err:11.2e}")
            results[f"{name} t{threads}"] = {"us": times[name], "rel_error": err}
    if a.json:
        a.json.write_text(json.dumps({"hf": str(a.hf), "shape": list(w.shape), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
