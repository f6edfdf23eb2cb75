"""OM models through Ascend's ais_bench: an onnxruntime-like session, and timing.

ais_bench (https://gitee.com/ascend/tools/tree/master/ais-bench_workload/tool/ais_bench) runs .om
models on an Ascend NPU through its `aclruntime` backend (CANN). Its Python API, as documented in the
"interface python API" guide, https://gitee.com/ascend/ait/blob/master/ait/docs/benchmark/API_GUIDE.md
(InferSession(device_id, model_path, acl_json_path=None, debug=False, loop=1); infer(feeds,
mode='static', custom_sizes=100000, out_array=True); mode one of static, dymbatch, dymhw, dymdims,
dymshape):

  from ais_bench.infer.interface import InferSession
  session = InferSession(device_id, model_path)          # loads the model on that NPU
  session.get_inputs() / get_outputs()                   # .name .datatype .shape ... in model order
  outputs = session.infer(feeds, mode="static")          # feeds: a list in input order -> [ndarray]
  session.summary().exec_time_list                       # per inference (start, end), milliseconds
  session.free_resource()

- `unavailable_reason()`: why ais_bench cannot run here (None when it can be imported);
- `OmSession(path, device_id, dynamic)`: `run(output_names, feeds)` like onnxruntime's, so that
  llmpipe.infer.decode drives an OM model exactly like an ORT session;
- `time_om(session, feeds, warmup, iters)`: wall time per call, and the device's own times.

ais_bench is imported only when used: it needs CANN's libraries, and this module is imported where
there are none. Nothing here names the device type; ais_bench and the OM file decide it.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from llmpipe.errors import UserError

INTERFACE = "ais_bench.infer.interface"
INSTALL_HINT = "pip package from Ascend/tools: ais-bench_workload/tool/ais_bench, with its aclruntime backend"
STATIC, DYMDIMS = "static", "dymdims"  # ais_bench's infer modes: fixed shapes; ATC --dynamic_dims gears

# aclruntime.dtype names that are not numpy's
_DTYPE_ALIASES = {"double": "float64", "double64": "float64", "bool": "bool"}


class OmInputError(UserError, ValueError):
    """An OM model does not take what it is fed (names, dtypes, shapes, gears) or lacks an output asked
    for: a model folder that does not match the graph contract; the message names the file."""


class AisUnavailable(RuntimeError):
    """ais_bench cannot be imported here (not installed, or its CANN libraries are missing)."""


def _interface():
    """ais_bench's interface module; AisUnavailable (one line) when it cannot be imported."""
    try:
        return importlib.import_module(INTERFACE)
    except ModuleNotFoundError as err:
        if err.name and (err.name == "ais_bench" or err.name.startswith("ais_bench.")):
            raise AisUnavailable(f"ais_bench not installed ({INSTALL_HINT})") from None
        # NOTE: ais_bench is there but a module it imports is not: aclruntime, most often.
        raise AisUnavailable(f"ais_bench installed but cannot be imported: {err.name} is missing "
                             f"({INSTALL_HINT})") from None
    except (ImportError, OSError) as err:  # aclruntime present, CANN's shared libraries not loadable
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise AisUnavailable(f"ais_bench installed but cannot be imported: {first} "
                             "(source CANN's set_env.sh)") from None


def unavailable_reason() -> str | None:
    """None when ais_bench's InferSession can be imported, else why not (one line).

    Whether an NPU is usable is known only when a session opens (InferSession raises then): asking
    earlier would need CANN itself.
    """
    try:
        module = _interface()
    except AisUnavailable as err:
        return str(err)
    if not hasattr(module, "InferSession"):
        return f"{INTERFACE} has no InferSession (an ais_bench too old or too new for llmpipe)"
    return None


def _np_dtype(datatype) -> np.dtype:
    """aclruntime.dtype (a pybind11 enum: .name "int64", "float32", "double", ...) -> numpy's dtype."""
    name = getattr(datatype, "name", None) or str(datatype).rpartition(".")[2]
    return np.dtype(_DTYPE_ALIASES.get(name, name))


def _dims(shape: Sequence[int]) -> str:
    return str(tuple(int(d) for d in shape))  # numpy's way: (1, 4), (4,)


class OmSession:
    """An OM model through ais_bench's InferSession, with onnxruntime's `run(output_names, feeds)`.

    `dynamic`: the model was compiled with --dynamic_dims gears (ais_bench's mode "dymdims"); None
    detects it from -1 dims in the model's inputs. Feeds are checked against the model's inputs before
    ais_bench sees them: ais_bench passes raw bytes, so a wrong dtype of the same size would run and
    give wrong numbers.
    """

    def __init__(self, path: str | os.PathLike, device_id: int = 0, dynamic: bool | None = None):
        infer_session = _interface().InferSession
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no OM model at {self.path}")
        # Positional (device_id, model_path), the documented order: InferSession(device_id, model_path)
        self._session = infer_session(device_id, str(self.path))
        self._inputs = [(d.name, tuple(int(x) for x in d.shape), _np_dtype(d.datatype))
                        for d in self._session.get_inputs()]
        self._outputs = [d.name for d in self._session.get_outputs()]
        detected = any(x < 0 for _, shape, _ in self._inputs for x in shape)
        self.mode = DYMDIMS if (detected if dynamic is None else dynamic) else STATIC

    @property
    def input_names(self) -> list[str]:
        return [name for name, _, _ in self._inputs]

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    def _ordered(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """`feeds` in the model's input order, each checked: name, dtype, rank and fixed dims."""
        where = self.path.name
        unknown = [name for name in feeds if name not in self.input_names]
        if unknown:
            raise OmInputError(f"{where}: no input named {', '.join(map(repr, unknown))} "
                               f"(the model's inputs: {', '.join(self.input_names)})")
        arrays = []
        for name, shape, dtype in self._inputs:
            if name not in feeds:
                raise OmInputError(f"{where}: input {name!r} is missing (the model's inputs: "
                                   f"{', '.join(self.input_names)})")
            array = np.asarray(feeds[name])
            if array.dtype != dtype:
                raise OmInputError(f"{where}: input {name!r} expects {dtype}, got {array.dtype}")
            if array.ndim != len(shape) or any(d >= 0 and d != a for d, a in zip(shape, array.shape)):
                gears = " (-1: a dim the model's gears set)" if min(shape, default=0) < 0 else ""
                raise OmInputError(f"{where}: input {name!r} expects shape {_dims(shape)}{gears}, "
                                   f"got {_dims(array.shape)}")
            # NOTE: older ais_bench versions copy the buffer without making it contiguous first.
            arrays.append(np.ascontiguousarray(array))
        return arrays

    def _infer(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        if self._session is None:
            raise RuntimeError(f"{self.path.name}: the session is closed")
        try:
            return list(self._session.infer(arrays, mode=self.mode))
        except RuntimeError as err:
            if self.mode != DYMDIMS:
                raise
            shapes = ", ".join(f"{n} {_dims(a.shape)}" for n, a in zip(self.input_names, arrays))
            raise OmInputError(f"{self.path.name}: ais_bench refused input shapes {shapes} in mode {DYMDIMS} "
                               f"(a model compiled with --dynamic_dims runs only its gears): {err}") from err

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Like onnxruntime's InferenceSession.run: the outputs named (all when None), in that order."""
        wanted = list(output_names) if output_names else self.output_names
        unknown = [n for n in wanted if n not in self._outputs]
        if unknown:
            raise OmInputError(f"{self.path.name}: no output named {', '.join(map(repr, unknown))} "
                               f"(the model's outputs: {', '.join(self._outputs)})")
        outputs = self._infer(self._ordered(feeds))
        return [outputs[self._outputs.index(n)] for n in wanted]

    def close(self) -> None:
        """Free the model's device resources (ais_bench's free_resource); idempotent."""
        if self._session is not None:
            self._session.free_resource()
            self._session = None

    def __enter__(self) -> OmSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- timing


def _reset_summary(session) -> None:
    # NOTE: ais_bench spells it reset_summaryinfo; releases before 2023 spelled it reset_sumaryinfo.
    for name in ("reset_summaryinfo", "reset_sumaryinfo"):
        if hasattr(session, name):
            getattr(session, name)()
            return


def _device_seconds(session, iters: int) -> list[float] | None:
    """The last `iters` device execution times from summary().exec_time_list, in seconds; None if absent.

    ais_bench's own report takes each entry as a (start, end) pair in milliseconds
    (npu_compute_time_list = [end - start for start, end in exec_time_list]); a plain number is taken
    as a duration in milliseconds.
    """
    summary = getattr(session, "summary", None) or getattr(session, "sumary", None)  # NOTE: older spelling
    if summary is None:
        return None
    entries = list(getattr(summary(), "exec_time_list", None) or [])[-iters:]
    if len(entries) < iters:
        return None
    return [((e[1] - e[0]) if isinstance(e, (tuple, list)) else e) / 1e3 for e in entries]


def time_om(session: OmSession, feeds: Mapping[str, np.ndarray], warmup: int,
            iters: int) -> dict[str, list[float] | None]:
    """`warmup` untimed calls, then `iters` timed ones, as llmpipe.bench.run.time_calls times them.

    Returns {"wall_s": perf_counter seconds around each ais_bench infer call, "device_s": the model's
    execution time on the device for each of those calls from ais_bench's summary(), or None}.
    Feeds are checked and ordered once, outside the timed calls.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"time_om: iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    arrays = session._ordered(feeds)
    for _ in range(warmup):
        session._infer(arrays)
    _reset_summary(session._session)
    wall = []
    for _ in range(iters):
        t0 = time.perf_counter()
        session._infer(arrays)  # NOTE: synchronous: infer returns host arrays copied from the device
        wall.append(time.perf_counter() - t0)
    return {"wall_s": wall, "device_s": _device_seconds(session._session, iters)}
