"""Float zero points folded into integer ones: HQQ's accuracy on onnxruntime's fast MatMulNBits path.

A 4-bit MatMulNBits weight with float zero points (what onnxruntime's HQQ quantizer writes) dequantises as
    W[k, n] = (q[k, n] - zf[b, n]) * s[b, n]            (b: k's block of block_size input rows)
and onnxruntime's CPU kernel has no fast path for float zero points: it dequantises every weight on every
call (docs/measurements/quantisation.md: an eighth of fp32's decode speed). The same W is
    W[k, n] = (q[k, n] - zi[b, n]) * s[b, n] + c[b, n],   zi = clip(round(zf), 0, 2^bits - 1),
                                                           c  = (zi - zf) * s   (|c| <= s / 2 inside the range)
so, with S[b] = sum of x[k] over block b (the input's block sums),
    x . W[:, n] = x . ((q - zi) * s)[:, n] + S . c[:, n]
which is one MatMulNBits with integer zero points over the input with its block sums appended:
    x' = concat(x, S),  W' = [W with zi; c quantized in 4 bits, blocks of block_size over b]
The appended rows cost K / block_size more input features (3% at blocks of 32) and their own rounding: c is
rounded to (max c - min c) / 15 per column, a shift of each block by at most 1/30 of a typical step, where
round-to-nearest with integer zero points shifts it by up to half a step (the correlated error that damages
SmolLM2; the measurement is in docs/measurements/quantisation.md). Three standard ops per distinct input
(Reshape, ReduceSum, Concat), shared by the MatMuls that read it (q, k and v; gate and up).

Nothing here is onnxruntime-specific beyond MatMulNBits itself (a com.microsoft contrib op): the result is an
onnxruntime graph, never one for ATC.
"""

from __future__ import annotations

import numpy as np

ZP_BITS = 4


def unpack4(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., m] two 4-bit values per byte (low nibble first) -> uint8 [..., 2m]."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack4(values: np.ndarray) -> np.ndarray:
    """uint8 [..., 2m] values in 0..15 -> [..., m] bytes, low nibble first (values of odd length padded 0)."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def round_blocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks [..., block] in 4 bits, round to nearest of each block's range (0 included) with an integer zero
    point: (q [..., block] uint8, scales [...] fp32, zero points [...] uint8)."""
    levels = (1 << ZP_BITS) - 1
    lo = np.minimum(blocks.min(-1), 0.0)
    hi = np.maximum(blocks.max(-1), 0.0)
    scale = (hi - lo) / levels
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, levels)
    q = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, levels).astype(np.uint8)
    return q, scale, zero.astype(np.uint8)


def fold_weights(packed: np.ndarray, scales: np.ndarray, zf: np.ndarray, k: int, n: int, block: int):
    """One MatMulNBits weight (4 bits; packed [N, nb, block/2], scales and float zero points [N, nb]) as the
    folded node's (packed [N, nb + ne, block/2], scales [N, nb + ne], uint8 zero points [N, ceil((nb+ne)/2)],
    ne: blocks of the appended correction rows). K must be whole blocks."""
    nb = k // block
    q = unpack4(packed.reshape(n, nb, block // 2))
    s = scales.reshape(n, nb).astype(np.float32)
    zf = zf.reshape(n, nb).astype(np.float32)
    levels = (1 << ZP_BITS) - 1
    zi = np.clip(np.round(zf), 0, levels)
    corr = ((zi - zf) * s).astype(np.float32)  # [N, nb]: the per-block constant the integer grid misses
    ne = -(-nb // block)
    padded = np.zeros((n, ne * block), np.float32)
    padded[:, :nb] = corr
    cq, cs, cz = round_blocks(padded.reshape(n, ne, block))
    q_all = np.concatenate([q, cq], axis=1)  # [N, nb + ne, block]
    s_all = np.concatenate([s, cs], axis=1)
    z_all = np.concatenate([zi, cz], axis=1).astype(np.uint8)
    return pack4(q_all), s_all.reshape(-1), pack4(z_all).reshape(-1), ne


def dequantize(packed: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, k: int, n: int, block: int,
               float_zp: bool) -> np.ndarray:
    """The [K, N] float weight a 4-bit MatMulNBits node computes with (for tests and checks)."""
    nb = -(-k // block)
    q = unpack4(packed.reshape(n, nb, block // 2)).astype(np.float32)
    s = scales.reshape(n, nb).astype(np.float32)
    if zp is None:
        z = np.full((n, nb), 8.0, np.float32)
    elif float_zp:
        z = zp.reshape(n, nb).astype(np.float32)
    else:
        z = unpack4(zp.reshape(n, -1))[:, :nb].astype(np.float32)
    w = (q - z[..., None]) * s[..., None]  # [N, nb, block]
    return w.reshape(n, nb * block)[:, :k].T


def fold_model(model, ranks: dict[str, int] | None = None) -> int:
    """Rewrites, in place, every 4-bit MatMulNBits node of `model` (a ModelProto) whose zero points are a float
    initializer, whose K is whole blocks and whose input's rank shape inference knows: integer zero points
    plus the appended block-sum rows (module docstring). Returns how many nodes were folded (the others
    keep their float zero points: slower, never wrong). `ranks`: value name -> rank, from the graph before it
    was quantized (shape inference stops at the first contrib op of a graph that does not declare its values'
    shapes, as torch's exports do not); None: inferred here."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    ranks = ranks if ranks is not None else value_ranks(model)
    sums: dict[tuple[str, int, int], str] = {}  # (input, K, block) -> the input with its block sums appended
    new_nodes = []
    folded = 0
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        zp = inits.get(node.input[3]) if node.op_type == "MatMulNBits" and len(node.input) > 3 else None
        if (zp is None or zp.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                or attrs.get("bits", 4) != 4 or any(node.input[4:]) or attrs["K"] % attrs["block_size"]
                or ranks.get(node.input[0]) is None):
            new_nodes.append(node)
            continue
        k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
        packed, scales = numpy_helper.to_array(inits[node.input[1]]), numpy_helper.to_array(inits[node.input[2]])
        b_q, s_q, z_q, ne = fold_weights(packed, scales, numpy_helper.to_array(zp), k, n, block)
        key = (node.input[0], k, block)
        if key not in sums:
            sums[key] = _block_sums(graph, new_nodes, node.input[0], ranks[node.input[0]], k // block, block)
        for name, arr in ((node.input[1], b_q), (node.input[2], s_q.astype(scales.dtype)), (node.input[3], z_q)):
            inits[name].CopyFrom(numpy_helper.from_array(arr, name))
        node.input[0] = sums[key]
        for a in node.attribute:
            if a.name == "K":
                a.i = k + k // block  # the last block partial: the kernel reads it as zero-padded
        new_nodes.append(node)
        folded += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    return folded


def value_ranks(model) -> dict[str, int]:
    """Value name -> rank, from onnx's shape inference over a copy of the graph without its weights' bytes
    (the dims are what it needs; a 7B graph's bytes would pass protobuf's 2 GB limit)."""
    import onnx

    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import)
    graph = light.graph
    for field in ("node", "input", "output", "value_info"):
        getattr(graph, field).extend(getattr(model.graph, field))
    # each weight as its name, type and dims only: never a second copy of the bytes
    graph.initializer.extend(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
                             for t in model.graph.initializer)
    try:
        light = onnx.shape_inference.infer_shapes(light)
    except Exception:  # noqa: BLE001 - an unknown contrib op's graph: fall back to what the model declares
        pass
    out = {}
    for v in list(light.graph.input) + list(light.graph.value_info) + list(light.graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            out[v.name] = len(v.type.tensor_type.shape.dim)
    return out


def _block_sums(graph, nodes: list, x: str, rank: int, nb: int, block: int) -> str:
    """Appends to `nodes` the ops computing concat(x, S) for an input x [..., nb * block] of `rank` (S: its nb
    block sums). Returns the name of the result."""
    from onnx import helper, numpy_helper

    base = f"{x}_blocksum{block}".replace("/", "_").replace(":", "_")
    consts = [numpy_helper.from_array(np.array([0] * (rank - 1) + [nb, block], np.int64), base + "_shape"),
              numpy_helper.from_array(np.array([-1], np.int64), base + "_axes")]
    graph.initializer.extend(consts)
    nodes += [
        helper.make_node("Reshape", [x, consts[0].name], [base + "_blocks"], name=base + "_reshape"),
        helper.make_node("ReduceSum", [base + "_blocks", consts[1].name], [base + "_sums"], keepdims=0,
                         name=base + "_reducesum"),
        helper.make_node("Concat", [x, base + "_sums"], [base + "_x"], axis=-1, name=base + "_concat"),
    ]
    return base + "_x"
