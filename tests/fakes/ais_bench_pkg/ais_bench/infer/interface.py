"""A stand-in for `ais_bench.infer.interface.InferSession`, for tests only.

ais_bench and an NPU cannot exist here (ais_bench's `aclruntime` backend needs CANN and an Ascend
device), so this class only lets the tests check how llmpipe drives ais_bench. It follows ais_bench's
documented interface (ait benchmark API_GUIDE.md, "interface python API"; the same InferSession ships
in Ascend/tools ais-bench_workload/tool/ais_bench/ais_bench/infer/interface.py):

  InferSession(device_id, model_path, acl_json_path=None, debug=False, loop=1)
  get_inputs() / get_outputs() -> descriptions with .name .datatype .format .shape .size .realsize
  infer(feeds, mode='static', custom_sizes=100000, out_array=True) -> list of numpy arrays
  summary() -> an object whose exec_time_list holds one (start_ms, end_ms) pair per inference
  reset_summaryinfo(), free_resource(), finalize()

The "model" is an .om file written by tests/fakes/atc (LLMPIPE-FAKE-OM v1: a magic line, then one
JSON line naming the ONNX model and ATC's --input_shape/--dynamic_dims); it runs that ONNX model with
onnxruntime on the CPU. Like a real OM:

- feeds are a list in the model's input order, passed as raw bytes: a feed's byte size must match
  the input's, and its bytes are read as the input's declared type (no conversion, no check);
- a static model (no -1 dims) runs only its compiled shapes;
- a model compiled with --dynamic_dims runs, in mode "dymdims", only shapes matching one gear;
- a file that is not such a model fails to load with RuntimeError, as aclruntime's load does.

Errors are RuntimeError, as aclruntime raises (pybind11's translation of std::runtime_error).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field

import numpy as np

OM_MAGIC = "LLMPIPE-FAKE-OM v1"
MODES = ("static", "dymbatch", "dymhw", "dymdims", "dymshape")


class dtype(enum.Enum):  # noqa: N801 - aclruntime's spelling
    """aclruntime.dtype: the element types an OM input or output can declare."""

    int8 = "int8"
    uint8 = "uint8"
    int16 = "int16"
    uint16 = "uint16"
    int32 = "int32"
    uint32 = "uint32"
    int64 = "int64"
    uint64 = "uint64"
    float16 = "float16"
    float32 = "float32"
    double = "float64"
    bool = "bool"

    @classmethod
    def of(cls, np_dtype: np.dtype) -> dtype:
        return cls(np.dtype(np_dtype).name)

    def numpy(self) -> np.dtype:
        return np.dtype(self.value)


@dataclass
class tensor_desc:  # noqa: N801 - aclruntime's spelling
    """aclruntime.tensor_desc: one input or output of the model (-1 in shape: a dynamic dim)."""

    name: str
    datatype: dtype
    shape: list[int]
    format: int = 0  # 0 NCHW, 1 NHWC; ND inputs report 0 too
    size: int = 0  # bytes at `shape`; 0 when the shape has dynamic dims
    realsize: int = 0


@dataclass
class sumary_info:  # noqa: N801 - aclruntime's spelling
    """What summary() returns: exec_time_list, one (start_ms, end_ms) pair per inference."""

    exec_time_list: list[tuple[float, float]] = field(default_factory=list)


def _invalid_model(path: str, why: str) -> RuntimeError:
    return RuntimeError(f"[ERROR] load model from file failed, model file is {path}: {why}")


def _shape_specs(text: str | None) -> dict[str, list[int]]:
    """ATC's --input_shape "a:1,-1;b:1,4" -> {"a": [1, -1], "b": [1, 4]}."""
    specs = {}
    for spec in filter(None, (s.strip() for s in (text or "").split(";"))):
        name, _, dims = spec.rpartition(":")
        specs[name] = [int(d) for d in dims.split(",")]
    return specs


def _gears(text: str | None) -> list[tuple[int, ...]]:
    """ATC's --dynamic_dims "4,4;8,8" -> [(4, 4), (8, 8)]: one value per -1 dim, inputs in order."""
    return [tuple(int(v) for v in g.split(",")) for g in (text or "").strip().strip(";").split(";") if g.strip()]


class InferSession:
    """ais_bench's single-process session over one OM model on one device (here: the CPU)."""

    def __init__(self, device_id: int, model_path: str, acl_json_path: str = None, debug: bool = False,
                 loop: int = 1):
        import onnx
        import onnxruntime as ort

        self.device_id, self.model_path, self.loop = device_id, model_path, loop
        spec = self._read_spec(model_path)
        try:
            graph = onnx.load(spec["onnx"], load_external_data=False).graph
            self._ort = ort.InferenceSession(spec["onnx"], providers=["CPUExecutionProvider"])
        except Exception as err:  # the ONNX file behind the OM: unreadable means the OM is invalid
            raise _invalid_model(model_path, f"its ONNX model {spec['onnx']} cannot be loaded ({err})") from None
        given = _shape_specs(spec.get("input_shape"))
        weights = {t.name for t in graph.initializer}
        self._inputs = [self._desc(v, given.get(v.name)) for v in graph.input if v.name not in weights]
        self._outputs = [self._desc(v, None) for v in graph.output]
        self._gears = _gears(spec.get("dynamic_dims"))
        self._summary = sumary_info()
        self.freed = False

    @staticmethod
    def _read_spec(path: str) -> dict:
        try:
            with open(path, encoding="utf-8") as f:
                magic, line = f.readline().rstrip("\n"), f.readline()
            spec = json.loads(line) if magic == OM_MAGIC else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _invalid_model(path, str(err)) from None
        if not isinstance(spec, dict) or not isinstance(spec.get("onnx"), str):
            raise _invalid_model(path, "not an OM model")
        return spec

    @staticmethod
    def _desc(value_info, shape: list[int] | None) -> tensor_desc:
        import onnx

        t = value_info.type.tensor_type
        if shape is None:  # no --input_shape for it: the graph's dims, symbolic ones dynamic
            shape = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        kind = dtype.of(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
        size = 0 if min(shape, default=0) < 0 else int(np.prod(shape)) * kind.numpy().itemsize
        return tensor_desc(value_info.name, kind, list(shape), size=size, realsize=size)

    def get_inputs(self) -> list[tensor_desc]:
        return list(self._inputs)

    def get_outputs(self) -> list[tensor_desc]:
        return list(self._outputs)

    def _resolve(self, shapes: list[tuple[int, ...]], mode: str) -> list[list[int]]:
        """The shape each input runs at: its compiled one, or in "dymdims" the gear the feeds name."""
        if mode == "static":
            return [d.shape for d in self._inputs]
        if mode != "dymdims":
            raise RuntimeError(f"fake ais_bench: mode {mode!r} is not modelled (only static and dymdims)")
        dyshapes = ";".join(f"{d.name}:{','.join(map(str, s))}" for d, s in zip(self._inputs, shapes))
        if not self._gears:
            raise RuntimeError(f"set_dynamic_dims {dyshapes} failed: the model was compiled without dynamic_dims")
        values = []
        for desc, shape in zip(self._inputs, shapes):
            if len(shape) != len(desc.shape) or any(d >= 0 and d != s for d, s in zip(desc.shape, shape)):
                raise RuntimeError(f"set_dynamic_dims {dyshapes} failed: {desc.name} must be "
                                   f"{tuple(desc.shape)} with -1 dims from a gear")
            values += [s for d, s in zip(desc.shape, shape) if d < 0]
        if tuple(values) not in self._gears:
            gears = ";".join(",".join(map(str, g)) for g in self._gears)
            raise RuntimeError(f"set_dynamic_dims {dyshapes} failed: dims {','.join(map(str, values))} "
                               f"match no gear of the model ({gears})")
        return [list(s) for s in shapes]

    def infer(self, feeds, mode="static", custom_sizes=100000, out_array=True):
        """One inference of a list of feeds (numpy arrays or numpy scalars) in the model's input order."""
        if mode not in MODES:
            raise RuntimeError(f"wrong infer_mode:{mode}, only support {', '.join(MODES)}")
        if self.freed:
            raise RuntimeError("the session's resources were freed (free_resource)")
        arrays = [np.ascontiguousarray(np.asarray(f)) for f in feeds]
        if len(arrays) != len(self._inputs):
            raise RuntimeError("input datas and intensors nums not matched!")
        shapes = self._resolve([a.shape for a in arrays], mode)
        ort_feeds = {}
        for i, (desc, array, shape) in enumerate(zip(self._inputs, arrays, shapes)):
            want = int(np.prod(shape)) * desc.datatype.numpy().itemsize
            if array.nbytes != want:
                raise RuntimeError(f"input {i} ({desc.name}) size {array.nbytes} bytes does not match the "
                                   f"model's {want} bytes ({tuple(shape)} {desc.datatype.name})")
            # NOTE: an OM takes bytes: a feed of another type but the same size is read as the
            # declared type, which is what the real device does too.
            ort_feeds[desc.name] = np.frombuffer(array.tobytes(), desc.datatype.numpy()).reshape(shape)
        start = time.perf_counter() * 1e3
        outputs = self._ort.run([d.name for d in self._outputs], ort_feeds)
        self._summary.exec_time_list.append((start, time.perf_counter() * 1e3))
        return outputs

    def summary(self) -> sumary_info:
        return self._summary

    def reset_summaryinfo(self) -> None:
        self._summary = sumary_info()

    def free_resource(self) -> None:
        self.freed = True

    def finalize(self) -> None:
        self.free_resource()
