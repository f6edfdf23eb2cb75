"""llmpipe's own 4-bit matmul kernel, as an onnxruntime custom op: `llmpipe.Q4Gemv` (native/q4op.c).

onnxruntime's MatMulNBits (MLAS) streams a 4-bit decode step's weights at about half of one core's read
rate; llmpipe's kernel (native/q4_kernel.h: AVX2, tiles of 8 output rows sharing each int8 activation
block, each row in a lane of its own: layout 2) streams them 1.4x faster on the same codes (benchmarks/q4_kernel.py,
docs/measurements/quantisation.md). It takes HQQ's float zero points as they are (w = d * q + m, d and m
fp16), so the graph needs no fold nodes either.

`swap_model` rewrites an ORT-only graph's 4-bit MatMulNBits nodes (blocks of 32, N a multiple of 8) into
Q4Gemv nodes, and with `eight` its 8-bit ones (the head at 8 bits: two nibble planes of the same kernel);
the others (any other shape or width) stay MatMulNBits; a separate LoRA adapter's x A^T node and its Concat
(llmpipe.infer.lora_rows) go into their readers' optional inputs (`_fuse_adapters`). The portable graphs ATC
reads never get this op. `library()` compiles the op with the machine's C compiler the first time it is needed
(argv list, no shell; cached by a hash of the sources and flags, written to a temporary name and renamed, so
two processes never read a half-written file), and `register(options, graph)` adds it to a session's
options when the graph uses it (with the session's thread count, which the op splits its tiles by). Where
it cannot be built (no `cc`, a CPU without AVX2 / FMA / F16C, not
Linux x86-64) `unavailable()` says why, before any variant is made.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

DOMAIN = "llmpipe"
OP = "Q4Gemv"
BLOCK = 32  # weights per block along K
TILE = 8  # output rows per tile
LAYOUT = 2  # the weights' layout the op reads (native/q4_kernel.h; a node without the attribute is layout 1)
SOURCES = (Path(__file__).resolve().parent / "native" / "q4op.c",
           Path(__file__).resolve().parent / "native" / "q4_kernel.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-fvisibility=hidden")
CPU_FLAGS = ("avx2", "fma", "f16c")
CACHE_ENV = "LLMPIPE_NATIVE_CACHE"
THREADS_ENTRY = "llmpipe.q4.threads"  # session config entry the op reads when it registers (q4op.c)


class NativeUnavailable(RuntimeError):
    """llmpipe's kernel cannot be built or loaded on this machine (the message says why)."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def unavailable() -> str | None:
    """Why llmpipe's kernel cannot run here, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"llmpipe's 4-bit kernel is written for Linux x86-64 (this is {platform.system()} {platform.machine()})"
    missing = [f for f in CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"llmpipe's 4-bit kernel needs AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}"
    if compiler() is None:
        return "llmpipe's 4-bit kernel is compiled on first use and no C compiler (cc, gcc, clang) is on PATH"
    return None


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmpipe" / "native"


def library() -> Path:
    """The compiled op library (built on first use; NativeUnavailable when it cannot be)."""
    reason = unavailable()
    if reason:
        raise NativeUnavailable(reason)
    cc = compiler()
    digest = hashlib.sha256()
    for src in SOURCES:
        digest.update(src.read_bytes())
    digest.update(" ".join((cc, *FLAGS)).encode())
    folder = cache_dir()
    lib = folder / f"libllmpipe_q4-{digest.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCES[0])], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["?"])[0]
            raise NativeUnavailable(f"compiling llmpipe's 4-bit kernel with {cc} failed: {first}")
        os.replace(tmp, lib)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib


def uses(model) -> bool:
    """Whether a graph (a ModelProto, or the path of one) imports llmpipe's op domain. A path is read for its
    opset imports only (opset_domains: the graph's bytes are skipped, not parsed)."""
    if hasattr(model, "opset_import"):
        return any(o.domain == DOMAIN for o in model.opset_import)
    return DOMAIN in opset_domains(Path(model))


def _varint(f) -> int | None:
    shift = value = 0
    while True:
        b = f.read(1)
        if not b:
            return None
        value |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def opset_domains(path: Path) -> set[str]:
    """The domains a .onnx file's ModelProto imports (its field 8, OperatorSetIdProto's field 1), read from the
    protobuf wire format with every other top-level field skipped by its length: a session's check costs a few
    reads whatever the graph's size. ValueError on bytes that are not a protobuf message."""
    domains: set[str] = set()
    size = path.stat().st_size
    with open(path, "rb") as f:
        while True:
            tag = _varint(f)
            if tag is None:
                return domains
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                _varint(f)
            elif wire == 1:
                f.seek(8, 1)
            elif wire == 5:
                f.seek(4, 1)
            elif wire == 2:
                length = _varint(f)
                if length is None or f.tell() + length > size:
                    raise ValueError(f"{path}: not an ONNX model (a field runs past the end of the file)")
                if field != 8:
                    f.seek(length, 1)
                    continue
                entry, domain = f.read(length), ""
                i = 0
                while i < len(entry):  # OperatorSetIdProto: 1 domain (string), 2 version (varint)
                    t, i = _entry_varint(entry, i)
                    if t & 7 == 2:
                        n, i = _entry_varint(entry, i)
                        if t >> 3 == 1:
                            domain = entry[i:i + n].decode("utf-8", "replace")
                        i += n
                    elif t & 7 == 0:
                        _, i = _entry_varint(entry, i)
                    else:
                        raise ValueError(f"{path}: an opset import of wire type {t & 7}")
                domains.add(domain)
            else:
                raise ValueError(f"{path}: not an ONNX model (wire type {wire})")


def _entry_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while i < len(buf):
        value |= (buf[i] & 0x7F) << shift
        i += 1
        if not buf[i - 1] & 0x80:
            return value, i
        shift += 7
    raise ValueError("a varint cut short")


def register(options, graph) -> None:
    """Adds llmpipe's op library to onnxruntime SessionOptions `options` when `graph` (path) uses it."""
    try:
        used = uses(graph)
    except (OSError, ValueError):  # not a readable model: onnxruntime's own load says so
        return
    if used:
        # the op splits its tiles into one chunk per thread when it knows how many the session has
        threads = options.intra_op_num_threads or os.cpu_count() or 1
        options.add_session_config_entry(THREADS_ENTRY, str(threads))
        options.register_custom_ops_library(str(library()))


# ---- weights ------------------------------------------------------------------------------------------


def pack(codes: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes uint8 [N, K] in 0..2^bits - 1, d and m float [N, K / 32] (w = d * q + m) -> the op's (Q, D, M)
    inputs: uint8 [N/8, K/32, 32 * bits], float16 [N/8, K/32, 8] twice (native/q4_kernel.h's layout 2: in a
    tile's block, load i's 32-bit lane r is row r, its byte c w[8i + c] low and w[8i + 4 + c] high; 8 bits:
    the low nibbles' plane, then the high nibbles')."""
    n, k = codes.shape
    nb, tiles = k // BLOCK, n // TILE
    if bits == 8:
        planes = [pack(codes & 0x0F, d, m)[0], pack(codes >> 4, d, m)[0]]
        q = np.concatenate(planes, axis=-1)
    else:
        c = codes.reshape(tiles, TILE, nb, 4, 2, 4)  # [tile, row, block, load i, half, byte c]
        q = (c[:, :, :, :, 0, :] | (c[:, :, :, :, 1, :] << 4)).astype(np.uint8)  # [tile, row, block, i, c]
        q = np.ascontiguousarray(q.transpose(0, 2, 3, 1, 4)).reshape(tiles, nb, TILE * 16)

    def rows(v):
        v = np.asarray(v, np.float32).reshape(tiles, TILE, nb).transpose(0, 2, 1)
        return np.ascontiguousarray(v.astype(np.float16))

    return q, rows(d), rows(m)


def unpack(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pack's inverse (the width from Q's last dim): (codes [N, K], d [N, K/32], m [N, K/32]) as float32 where
    float."""
    tiles, nb = q.shape[:2]
    if q.shape[-1] == 2 * TILE * 16:  # 8 bits: two nibble planes
        lo, dd, mm = unpack(q[..., :TILE * 16], d, m)
        hi = unpack(q[..., TILE * 16:], d, m)[0]
        return (lo | (hi << 4)).astype(np.uint8), dd, mm
    b = q.reshape(tiles, nb, 4, TILE, 4).transpose(0, 3, 1, 2, 4)  # [tile, row, block, i, c]
    codes = np.stack([b & 0x0F, b >> 4], axis=-2).reshape(tiles * TILE, nb * BLOCK)

    def rows(v):
        return v.astype(np.float32).transpose(0, 2, 1).reshape(tiles * TILE, nb)

    return codes.astype(np.uint8), rows(d), rows(m)


def dequantize(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The [K, N] float weight a Q4Gemv node computes with (for tests and checks)."""
    codes, dd, mm = unpack(q, d, m)
    w = codes.reshape(codes.shape[0], -1, BLOCK) * dd[..., None] + mm[..., None]
    return w.reshape(codes.shape[0], -1).T


def _nbits_weight(node, inits, attrs) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A MatMulNBits node's (codes [N, K], d, m) when the op can take it (4 or 8 bits, blocks of 32, K and N
    whole tiles, no g_idx or bias), else None."""
    from onnx import numpy_helper

    from llmpipe.infer.fold import unpack4

    k, n, bits = attrs.get("K"), attrs.get("N"), attrs.get("bits", 4)
    if (bits not in (4, 8) or attrs.get("block_size") != BLOCK or not k or not n or k % BLOCK or n % TILE
            or any(node.input[4:]) or node.input[1] not in inits or node.input[2] not in inits
            or (len(node.input) > 3 and node.input[3] and node.input[3] not in inits)):
        return None
    nb = k // BLOCK
    b = numpy_helper.to_array(inits[node.input[1]])
    codes = (unpack4(b.reshape(n, nb, BLOCK // 2)) if bits == 4 else b.reshape(n, nb, BLOCK)).reshape(n, k)
    s = numpy_helper.to_array(inits[node.input[2]]).astype(np.float32).reshape(n, nb)
    if len(node.input) > 3 and node.input[3]:
        zp = numpy_helper.to_array(inits[node.input[3]])
        if zp.dtype != np.uint8:
            z = zp.astype(np.float32).reshape(n, nb)
        elif bits == 4:
            z = unpack4(zp.reshape(n, -1))[:, :nb].astype(np.float32)
        else:
            z = zp.reshape(n, -1)[:, :nb].astype(np.float32)
    else:
        z = np.full((n, nb), float(1 << (bits - 1)), np.float32)
    return codes, s, -z * s


def swap_model(model, eight: bool = True) -> int:
    """Rewrites, in place, every MatMulNBits node of `model` (a ModelProto) the op can take (_nbits_weight;
    8-bit ones only with `eight`) into a Q4Gemv node over the same weights, and imports llmpipe's domain.
    Returns how many it rewrote."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    swapped, dead, new_inits = 0, set(), []
    for i, node in enumerate(graph.node):
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = _nbits_weight(node, inits, attrs) if eight or attrs.get("bits", 4) == 4 else None
        if weight is None:
            continue
        bits = attrs.get("bits", 4)
        q, d, m = pack(*weight, bits=bits)
        base = (node.name or node.output[0]).replace("/", "_").replace(":", "_") + "_q4"
        new_inits += [numpy_helper.from_array(q, base + "_q"), numpy_helper.from_array(d, base + "_d"),
                      numpy_helper.from_array(m, base + "_m")]
        dead.update(x for x in node.input[1:4] if x and readers.get(x) == 1)
        new = helper.make_node(OP, [node.input[0], base + "_q", base + "_d", base + "_m"], list(node.output),
                               name=node.name, domain=DOMAIN, K=attrs["K"], N=attrs["N"], bits=bits,
                               layout=LAYOUT)
        graph.node[i].CopyFrom(new)
        swapped += 1
    if swapped:
        kept = [t for t in graph.initializer if t.name not in dead]
        del graph.initializer[:]
        graph.initializer.extend(kept + new_inits)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
        _fuse_adapters(graph)
    return swapped


def _fuse_adapters(graph) -> int:
    """A separate LoRA adapter's nodes (llmpipe.infer.lora_rows on unfolded nodes: xa = x . A^T, an 8-bit
    Q4Gemv, and concat(x, xa) read by 4-bit Q4Gemv nodes) folded into each reader's optional inputs, so the op
    computes xa itself from the x it quantises anyway: two nodes fewer per adapted input (on SmolLM2-135M at 2
    threads the Concats alone were 8.5% of a decode step). Readers that share one input (gate and up) each
    compute the small product (K x the adapters' ranks at 8 bits) again, cheaper than its two nodes. Left as
    they are when anything else reads the concat or xa. Returns how many nodes took their adapter in."""
    from onnx import helper

    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    drop: set[str] = set()
    fused = 0
    for cat in [n for n in graph.node if n.op_type == "Concat" and len(n.input) == 2]:
        a_node = producers.get(cat.input[1])
        users = readers.get(cat.output[0], [])
        if a_node is None or a_node.op_type != OP or a_node.domain != DOMAIN or len(a_node.input) != 4:
            continue
        bits = {x.name: helper.get_attribute_value(x) for x in a_node.attribute}.get("bits")
        if (bits != 8 or a_node.input[0] != cat.input[0] or len(readers.get(a_node.output[0], [])) != 1
                or cat.output[0] in outputs or a_node.output[0] in outputs or not users
                or any(u.op_type != OP or u.domain != DOMAIN or len(u.input) != 4 or u.input[0] != cat.output[0]
                       for u in users)):
            continue
        rows_a = _live_rows(graph, a_node)
        for user in users:
            user.input[0] = cat.input[0]
            user.input.extend(a_node.input[1:4])
            if rows_a:
                user.attribute.append(helper.make_attribute("rows_a", rows_a))
            fused += 1
        drop.update((cat.name or cat.output[0], a_node.name or a_node.output[0]))
    if drop:
        kept = [n for n in graph.node if (n.name or n.output[0]) not in drop]
        del graph.node[:]
        graph.node.extend(kept)
    return fused


def _live_rows(graph, node) -> int:
    """The rows of a Q4Gemv node's weight before its zero padding (whole tiles of 8), or 0 when none is zero:
    the adapter's x A^T is padded to whole blocks of 32 (llmpipe.infer.lora_rows), rows the op need not compute."""
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    d, m = (numpy_helper.to_array(inits[name]) for name in node.input[2:4])  # [R/8, KA/32, 8] each
    live = np.flatnonzero((d != 0).any(axis=(1, 2)) | (m != 0).any(axis=(1, 2)))
    tiles = int(live[-1]) + 1 if live.size else 1
    return tiles * TILE if tiles < d.shape[0] else 0
