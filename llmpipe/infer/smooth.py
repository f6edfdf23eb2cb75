"""SmoothQuant's scales: activation outliers moved into the weights before int8 (Xiao et al., 2023).

A weight MatMul y = x W (x [..., K], W [K, N]) is the same function as y = (x / s) (diag(s) W) for any positive
per-channel s [K]. Int8 with activations quantised per tensor (benchmark.quantize's dynamic int8 and int8s) is
broken by a few input channels far larger than the rest (a real model's norms make them; SmolLM2-135M:
docs/measurements/quantisation.md): one range per tensor spends its 256 levels on them. With
    s_j = max|x_j|^alpha / max_n |W_jn|^(1 - alpha)
(max|x_j| from calibration text, alpha 0.5 the paper's) the activations' channels come out even and the weights'
rows absorb the difference, which int8 per output channel holds well.

x / s is folded where it is free, so the graph keeps its ops:
- into the preceding norm's weight: a Mul by a per-channel initializer (RMSNorm in torch's export, which may
  read it through an Identity of an equal one) or the
  builder's (Skip)SimplifiedLayerNormalization, when that output feeds only the scaled MatMuls (q/k/v, gate/up);
- into the up projection's columns when x is silu(gate) * up (the down projection's input);
- elsewhere (the attention's output into o_proj) a Mul by 1 / s is inserted before the MatMuls.
An initializer another node also reads (a tied head's table, which the embedding reads too; identical norm
weights an exporter shared) gets a scaled copy of its own. In fp32 the result equals the source up to rounding
(tested); the weights are then quantised by the caller. Standard ops only: what ATC reads stays readable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
MIN_SCALE = 1e-5


def smooth_file(src: Path, dst: Path, reader, alpha: float, skip: Sequence[str] = ()) -> int:
    """The graph at `src` with SmoothQuant's scales, written to `dst` (external data beside it when `src` has
    some); `reader`: a CalibrationDataReader of this graph (get_next() -> feed dict or None); `skip`: names of
    weight MatMuls left as they are (those the quantiser keeps in fp32). Returns how many inputs were scaled."""
    import onnx

    from llmpipe.infer.graphs import save_model

    model = onnx.load(str(src))
    n = smooth_model(model, activation_maxima(src, model, reader, skip, Path(dst).parent), alpha, skip)
    save_model(model, dst, _external(src))
    return n


def _external(src: Path) -> bool:
    from llmpipe.infer.graphs import EXTERNAL_DATA_BYTES, model_files

    return sum(f.stat().st_size for f in model_files(Path(src))) > EXTERNAL_DATA_BYTES


def scaled_inputs(model, skip: Sequence[str] = ()) -> list[str]:
    """The inputs x of the graph's weight MatMuls (a 2-D initializer as their second input), but `skip`'s."""
    inits = {i.name: i for i in model.graph.initializer}
    return sorted({n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.name not in skip
                   and n.input[1] in inits and len(inits[n.input[1]].dims) == 2})


def activation_maxima(path: Path, model, reader, skip: Sequence[str] = (), work: Path | None = None
                      ) -> dict[str, np.ndarray]:
    """max |x_j| over every calibration feed, per input channel j, of each scaled input x of `model` (the graph
    at `path`); the graph with those as outputs is written to `work` (default: beside `path`) while it runs."""
    import onnx
    import onnxruntime as ort

    xs = scaled_inputs(model, skip)
    if not xs:
        raise ValueError(f"{Path(path).name}: no MatMul with a constant weight to scale")
    aug = onnx.ModelProto()
    aug.CopyFrom(model)
    known = {o.name for o in aug.graph.output}
    aug.graph.output.extend([onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None)
                             for x in xs if x not in known])
    from llmpipe.infer.graphs import save_model

    tmp = Path(work or Path(path).parent) / (Path(path).stem + ".smooth-calibration.onnx")
    try:
        save_model(aug, tmp, _external(path))
        del aug
        opts = ort.SessionOptions()  # not llmpipe.infer.ort's: that module imports this one
        opts.log_severity_level = 3
        session = ort.InferenceSession(str(tmp), opts, providers=["CPUExecutionProvider"])
        maxima: dict[str, np.ndarray] = {}
        feeds = 0
        while (feed := reader.get_next()) is not None:
            feeds += 1
            for x, v in zip(xs, session.run(xs, feed)):
                m = np.abs(v).reshape(-1, v.shape[-1]).max(0)
                maxima[x] = np.maximum(maxima[x], m) if x in maxima else m
        if not feeds:
            raise ValueError(f"{Path(path).name}: the calibration reader gave no feed")
        return maxima
    finally:
        tmp.unlink(missing_ok=True)
        Path(str(tmp) + ".data").unlink(missing_ok=True)


def smooth_model(model, maxima: dict[str, np.ndarray], alpha: float, skip: Sequence[str] = ()) -> int:
    """Scales `model` (a ModelProto, changed in place) with the activation `maxima` of activation_maxima.
    Returns how many inputs were scaled."""
    from onnx import helper, numpy_helper

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha {alpha} is outside [0, 1]")
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def array(name: str) -> np.ndarray:
        return numpy_helper.to_array(inits[name])

    def put(node, index: int, value: np.ndarray) -> None:
        """node.input[index] (an initializer) becomes `value`: in place, or as a copy if another node reads it."""
        name = node.input[index]
        value = value.astype(numpy_helper.to_array(inits[name]).dtype)
        if len(readers[name]) > 1:
            new = f"{name}_smoothed_{len(inits)}"
            g.initializer.append(numpy_helper.from_array(value, new))
            inits[new] = g.initializer[-1]
            readers[name].remove(node)
            readers[new] = [node]
            node.input[index] = new
        else:
            inits[name].CopyFrom(numpy_helper.from_array(value, name))

    weights = {n.name for n in g.node if n.op_type == "MatMul" and n.name not in skip and n.input[1] in inits
               and len(inits[n.input[1]].dims) == 2}
    done = 0
    for x in scaled_inputs(model, skip):
        if x not in maxima:
            continue
        mms = [n for n in readers[x] if n.name in weights]
        wmax = np.max([np.abs(array(n.input[1])).max(1) for n in mms], axis=0)
        s = np.clip(maxima[x], MIN_SCALE, None) ** alpha / np.clip(wmax, MIN_SCALE, None) ** (1 - alpha)
        s = np.clip(s, MIN_SCALE, None).astype(np.float32)
        for n in mms:
            put(n, 1, array(n.input[1]) * s[:, None])
        done += 1
        if _fold(x, s, mms, producer, readers, inits, weights, array, put):
            continue
        name = f"{x}_smooth".replace("/", "_").replace(":", "_")
        g.initializer.append(numpy_helper.from_array((1 / s).astype(np.float32), name + "_inv"))
        inits[name + "_inv"] = g.initializer[-1]
        g.node.append(helper.make_node("Mul", [x, name + "_inv"], [name], name=name))
        for n in mms:
            n.input[0] = name
    _sort(g)
    return done


def _fold(x, s, mms, producer, readers, inits, weights, array, put) -> bool:
    """x / s folded into what makes x (see the module docstring); False when nothing can take it."""
    p = producer.get(x)
    # NOTE: a Shape reads no values (torch's export takes the attention's reshape sizes from the norm's output)
    if p is None or any(n not in mms and n.op_type != "Shape" for n in readers[x]):
        return False
    if p.op_type in NORMS and p.output[0] == x:
        gamma = 2 if p.op_type.startswith("Skip") else 1
        put(p, gamma, array(p.input[gamma]) / s)
        return True
    if p.op_type != "Mul":
        return False
    for i, name in enumerate(p.input):
        const = name
        while const not in inits and producer.get(const) is not None and producer[const].op_type == "Identity":
            const = producer[const].input[0]  # an exporter's shared copy of an equal initializer
        if const in inits and array(const).size == s.size and array(const).shape[-1] == s.size:
            if const != name:  # this Mul reads its own copy from now on
                p.input[i] = const
                readers[const].append(p)
            put(p, i, array(const) / s.reshape(array(const).shape))  # RMSNorm's weight
            return True
    for name in p.input:  # silu(gate) * up: up's columns
        up = producer.get(name)
        if up is not None and up.name in weights and len(readers[up.output[0]]) == 1:
            put(up, 1, array(up.input[1]) / s[None, :])
            return True
    return False


def _sort(g) -> None:
    """The graph's nodes in topological order again (the inserted Muls were appended)."""
    seen = {i.name for i in g.input} | {i.name for i in g.initializer} | {""}
    order, ready = [], list(g.node)
    while ready:
        rest = []
        for n in ready:
            if all(i in seen for i in n.input):
                order.append(n)
                seen.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(ready):
            raise ValueError("SmoothQuant: the graph's nodes could not be ordered (a cycle, or an input never made)")
        ready = rest
    del g.node[:]
    g.node.extend(order)
