"""The convert_om stage: ONNX -> Ascend OM through CANN's ATC compiler.

Two graphs, each compiled on its own (argv, log, .om):

- model.onnx (prefill, `input_ids` (batch, seq)) -> model.om, shaped by convert_om.input_shape and,
  for -1 dims, dynamic_dims gears;
- decoder_static.onnx (KV-cache decoder over a fixed cache) -> decoder.om, static: its --input_shape
  comes from the graph's own inputs, "batch" -> decode_batch, "chunk" -> decode_chunk.

The pieces, each testable alone:

- `build_argv(section, atc, onnx, prefix)`: ATC's command line as a list, a pure function;
- `graph_inputs`, `check_prefill`, `decoder_input_shape`: the shapes against the ONNX graph (read
  without its weights), so a combination ATC cannot compile is refused before ATC runs;
- `run_atc(argv, log_path, timeout_s)`: runs it (no shell) in its own process group, output to a log;
- `parse_errors(text)`: ATC's "E10001: ..." blocks -> `AtcError`s, so a failure reads as one line.

`run(ctx)` ties them together. Without ATC the stage records "skipped" with the reason, or fails
when `convert_om.required` is true. This module imports nothing heavy: `fingerprint_extra` runs
whenever fingerprints are computed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from llmpipe.config import ConvertOmSection, RunConfig
from llmpipe.errors import UserError
from llmpipe.export.atc_args import AtcArgsError, check_dynamic_dims
from llmpipe.stages import StageContext, StageError, StageResult

log = logging.getLogger("llmpipe.atc")


class AtcInputError(UserError, ValueError):
    """export_onnx's graph and convert_om's shapes do not fit (or the graph cannot be read); the message
    names the field or the file."""


# Graph names: each prefixes its files (<name>.om: ATC appends ".om" to --output) and keys its metrics.
PREFILL, DECODER = "model", "decoder"
DECODER_INPUT = "decoder_static"  # export_onnx's output name for decoder_static.onnx
SUCCESS_LINE = "ATC run success"
FRAMEWORK_ONNX = 5  # ATC's --framework: 0 Caffe, 1 MindSpore, 3 TensorFlow, 5 ONNX

# An error code at the start of a line: E10001, EZ3003, EE9999, EI0006 ... At least one digit after
# the optional letter, so that a plain "ERROR:" or "EXAMPLE:" line is not taken for a code.
_CODE_RE = re.compile(r"^(E[A-Z]?[0-9][0-9A-Z]{3,4})\b:\s*(.*)$")


# --------------------------------------------------------------------------- argv


def prefill_gears(dynamic_dims: str | None) -> list[int]:
    """The sequence lengths a prefill OM was compiled for: the last value of each --dynamic_dims gear
    (input_ids:1,-1 has one -1 dim, the sequence); [] for a static model."""
    return [int(g.split(",")[-1]) for g in (dynamic_dims or "").split(";") if g.strip()]


def build_argv(section: ConvertOmSection, atc: str, onnx_path: str | os.PathLike,
               output_prefix: str | os.PathLike) -> list[str]:
    """ATC's argv for `section`: ONNX at `onnx_path` -> `<output_prefix>.om`. Pure; raises AtcArgsError."""
    # NOTE: config validates this too, but a section built with model_construct skips validation,
    # and ATC's own complaint about both flags is far less clear.
    if section.precision_mode and section.precision_mode_v2:
        raise AtcArgsError("convert_om: set precision_mode or precision_mode_v2, not both (ATC rejects both)")
    check_dynamic_dims(section.input_shape, section.dynamic_dims)
    argv = [
        str(atc),
        f"--framework={FRAMEWORK_ONNX}",
        f"--model={onnx_path}",
        f"--output={output_prefix}",
        f"--soc_version={section.soc_version}",
        "--input_format=ND",  # token ids are not images; ND is also what --dynamic_dims requires
    ]
    if section.input_shape:
        argv.append(f"--input_shape={section.input_shape}")
    if section.dynamic_dims:
        argv.append(f"--dynamic_dims={section.dynamic_dims}")
    if section.precision_mode:
        argv.append(f"--precision_mode={section.precision_mode}")
    elif section.precision_mode_v2:
        argv.append(f"--precision_mode_v2={section.precision_mode_v2}")
    if section.op_select_implmode:
        argv.append(f"--op_select_implmode={section.op_select_implmode}")
    argv.append(f"--log={section.log}")
    return argv


# --------------------------------------------------------------------------- finding ATC


def _toolkit_dirs() -> list[str]:
    """CANN toolkit roots, from llmpipe.device (the one module that knows the hardware).

    NOTE: imported here, not at the top: llmpipe.device imports torch, and this module must stay
    cheap to import because fingerprint_extra runs whenever fingerprints are computed.
    """
    from llmpipe.device import cann_toolkit_dirs

    return cann_toolkit_dirs()


def _is_executable(path: str | Path) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_atc(section: ConvertOmSection) -> str | None:
    """Path to `atc`: convert_om.atc_path, else PATH, else the CANN toolkit's bin folders; or None."""
    if section.atc_path:
        path = os.path.expanduser(section.atc_path)
        if not _is_executable(path):
            raise StageError(f"convert_om.atc_path: {section.atc_path!r} is not an executable file")
        return os.path.abspath(path)
    found = shutil.which("atc")
    if found:
        return found
    for root in _toolkit_dirs():
        for candidate in (Path(root) / "bin" / "atc", Path(root) / "compiler" / "bin" / "atc"):
            if _is_executable(candidate):
                return str(candidate)
    return None


def fingerprint_extra(cfg: RunConfig) -> dict[str, str | None]:
    """{"atc": real path of ATC or None}: a machine that gains (or upgrades) ATC re-runs the stage.

    The real path goes through CANN's `latest` symlink, so a toolkit upgrade changes it too. A bad
    convert_om.atc_path counts as "not found" here; the stage itself reports it when it runs.
    """
    try:
        atc = find_atc(cfg.convert_om)
    except StageError:
        atc = None
    return {"atc": os.path.realpath(atc) if atc else None}


# --------------------------------------------------------------------------- ATC's errors


@dataclass(frozen=True)
class AtcError:
    """One ATC error block: its code, ATC's message, and its "Solution:" line when it gives one."""

    code: str
    message: str
    solution: str = ""

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}"
        return f"{text} Solution: {self.solution}" if self.solution else text


def parse_errors(log_text: str) -> list[AtcError]:
    """ATC's error blocks, in order. The traceback under each block is ATC's internals: dropped.

    A block is a code line at column 0 ("E10001: Value [x] for parameter [--y] is invalid. ...")
    followed by indented lines, among them "Solution: ..." and "TraceBack (most recent call last):".
    """
    errors: list[AtcError] = []
    block: dict[str, str] | None = None  # the block being read: code, message, solution
    in_traceback = False
    for line in log_text.splitlines():
        m = _CODE_RE.match(line)
        if m:
            if block:
                errors.append(AtcError(**block))
            block, in_traceback = {"code": m.group(1), "message": m.group(2).strip(), "solution": ""}, False
            continue
        text = line.strip()
        if block is None or not text:
            continue
        if not line[:1].isspace():  # an unindented line ends the block
            errors.append(AtcError(**block))
            block = None
        elif text.startswith("TraceBack"):
            in_traceback = True
        elif text.startswith("Solution:") and not in_traceback and not block["solution"]:
            block["solution"] = text.removeprefix("Solution:").strip()
    if block:
        errors.append(AtcError(**block))
    return errors


def failure_summary(log_text: str) -> str:
    """The first ATC error as one line, else the last non-empty line of the log."""
    errors = parse_errors(log_text)
    if errors:
        return str(errors[0])
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(ATC printed nothing)"


# --------------------------------------------------------------------------- running ATC


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill ATC and whatever it spawned (it forks compiler workers), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_atc(argv: list[str], log_path: str | Path, timeout_s: float,
            cwd: str | Path | None = None) -> tuple[int, str]:
    """Run ATC, stdout and stderr into `log_path`; returns (exit code, log text).

    The environment is inherited untouched (ATC needs CANN's ASCEND_* and LD_LIBRARY_PATH). It runs
    in `cwd` (default: the log's folder) because ATC writes fusion_result.json and kernel_meta/ into
    its working directory. Past `timeout_s` its whole process group is killed -> StageError.
    """
    log_path = Path(log_path)
    cwd = Path(cwd) if cwd is not None else log_path.parent
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise StageError(f"convert_om.timeout_s={timeout_s:g} exceeded: ATC was killed "
                             f"(log: {log_path})") from None
        except BaseException:  # KeyboardInterrupt, a cancelled flow: leave no compiler behind
            _kill_group(proc)
            raise
    return returncode, log_path.read_text(encoding="utf-8", errors="replace")


def _om_file(prefix: Path) -> Path | None:
    """`<prefix>.om`; or the one `<prefix>_<os>_<arch>.om` some ATC versions write instead."""
    exact = prefix.with_name(prefix.name + ".om")
    if exact.is_file():
        return exact
    variants = sorted(prefix.parent.glob(f"{prefix.name}_*.om"))
    return variants[0] if len(variants) == 1 else None


def convert(argv: list[str], prefix: Path, log_path: Path, timeout_s: float) -> Path:
    """Run ATC and check all three signs of success; returns `<prefix>.om`, else StageError."""
    returncode, text = run_atc(argv, log_path, timeout_s, cwd=prefix.parent)
    if returncode != 0 or SUCCESS_LINE not in text:
        raise StageError(f"ATC failed (exit {returncode}): {failure_summary(text)} (log: {log_path})")
    om = _om_file(prefix)
    if om is None:
        raise StageError(f"ATC reported success but wrote no {prefix.name}.om in {prefix.parent} "
                         f"(log: {log_path})")
    target = prefix.with_name(prefix.name + ".om")
    if om != target:
        log.info("ATC wrote %s; renaming it to %s", om.name, target.name)
        os.replace(om, target)
    return target


# --------------------------------------------------------------------------- the graphs


def graph_inputs(onnx_path: str | os.PathLike) -> dict[str, list[int | str]]:
    """The graph's declared inputs (initializers excluded): name -> dims, a fixed dim as its int, a
    symbolic one as its dim_param ("?" when it has neither). Reads the graph only, never the weights."""
    import onnx  # NOTE: here, not at the top: this module must stay cheap to import

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as err:  # protobuf's DecodeError, a truncated file: the file's fault, not a bug
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise AtcInputError(f"export_onnx's {Path(onnx_path).name} is not a readable ONNX model ({first})") from None
    weights = {t.name for t in model.graph.initializer}
    return {v.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                     for d in v.type.tensor_type.shape.dim]
            for v in model.graph.input if v.name not in weights}


def _shape_specs(input_shape: str) -> dict[str, list[str]]:
    """ATC's --input_shape "name:1,-1;name2:1,8" -> {"name": ["1", "-1"], "name2": ["1", "8"]}."""
    specs = {}
    for spec in filter(None, (s.strip() for s in input_shape.split(";"))):
        name, _, dims = spec.rpartition(":")  # input names may themselves contain ':'
        specs[name] = [d.strip() for d in dims.split(",")]
    return specs


def _dims(dims: list[int | str]) -> str:
    return ",".join(map(str, dims))


def check_prefill(section: ConvertOmSection, inputs: dict[str, list[int | str]], onnx_name: str) -> None:
    """convert_om.input_shape against the prefill graph's inputs: names it has, their ranks, and every
    symbolic dim given a size, -1 (gears) or a range. Raises AtcInputError, one line."""
    given = _shape_specs(section.input_shape) if section.input_shape else {}
    for name, dims in given.items():
        spec = f"{name}:{','.join(dims)}"
        if name not in inputs:
            raise AtcInputError(f"convert_om.input_shape: {spec!r} names input {name!r}, which {onnx_name} does "
                                f"not have (its inputs: {', '.join(inputs)})")
        if len(dims) != len(inputs[name]):
            raise AtcInputError(f"convert_om.input_shape: {spec!r} gives {len(dims)} dims, but {onnx_name}'s "
                                f"{name} has {len(inputs[name])} ({_dims(inputs[name])})")
    open_dims = [f"{n}: {_dims(d)}" for n, d in inputs.items()
                 if n not in given and any(isinstance(x, str) for x in d)]
    if open_dims:
        what = (f"is null, but {onnx_name} has" if not given
                else f"{section.input_shape!r} leaves out {onnx_name}'s inputs with")
        raise AtcInputError(f"convert_om.input_shape {what} symbolic dims ({'; '.join(open_dims)}): set "
                            "input_shape with fixed dims, or -1 dims plus dynamic_dims gears")


def decoder_input_shape(section: ConvertOmSection, inputs: dict[str, list[int | str]], onnx_name: str) -> str:
    """The static decoder's --input_shape: its declared inputs with "batch" -> decode_batch and "chunk"
    -> decode_chunk; fixed dims (cache length, heads, head_dim) as the graph has them."""
    sizes = {"batch": section.decode_batch, "chunk": section.decode_chunk}
    specs = []
    for name, dims in inputs.items():
        for d in dims:
            if isinstance(d, str) and d not in sizes:
                raise AtcInputError(f"convert_om.decoder=true: {onnx_name}'s input {name} ({_dims(dims)}) has "
                                    f"symbolic dim {d!r}; only 'batch' (convert_om.decode_batch="
                                    f"{section.decode_batch}) and 'chunk' (convert_om.decode_chunk="
                                    f"{section.decode_chunk}) are fixed at compile time")
        specs.append(f"{name}:{_dims([sizes.get(d, d) for d in dims])}")
    return ";".join(specs)


@dataclass(frozen=True)
class Graph:
    """One ATC compile: `name` prefixes its files (<name>.om, .atc.log, .argv.json) and keys its
    metrics; `section` carries the --input_shape/--dynamic_dims that apply to it."""

    name: str
    onnx: Path
    section: ConvertOmSection

    @property
    def log_name(self) -> str:
        return f"{self.name}.atc.log"

    @property
    def argv_name(self) -> str:
        return f"{self.name}.argv.json"

    def outputs(self) -> dict[str, str]:
        """Manifest output -> file: om/log/argv for the prefill, decoder_om/... for the decoder."""
        key = "" if self.name == PREFILL else f"{self.name}_"
        return {f"{key}om": f"{self.name}.om", f"{key}log": self.log_name, f"{key}argv": self.argv_name}


def plan(ctx: StageContext) -> tuple[list[Graph], str | None]:
    """The graphs to compile, each checked against its ONNX file; and why the decoder is not among them
    (None when it is or was not asked for). Raises AtcInputError on a combination ATC cannot compile."""
    section = ctx.cfg.convert_om
    model = ctx.input_path("export_onnx", "model").resolve()
    check_prefill(section, graph_inputs(model), model.name)
    graphs = [Graph(PREFILL, model, section)]
    if not section.decoder:
        return graphs, None
    if DECODER_INPUT not in ctx.inputs["export_onnx"][1].outputs:
        return graphs, (f"export_onnx published no {DECODER_INPUT} (export.static_decoder false, or an "
                        "older export), so decoder.om was not built; set convert_om.decoder: false to silence this")
    decoder = ctx.input_path("export_onnx", DECODER_INPUT).resolve()
    shape = decoder_input_shape(section, graph_inputs(decoder), decoder.name)
    # Static shapes: the gears of the prefill do not apply.
    graphs.append(Graph(DECODER, decoder, section.model_copy(update={"input_shape": shape, "dynamic_dims": None})))
    return graphs, None


# --------------------------------------------------------------------------- the stage


def required_but_missing() -> str:
    """The error when convert_om.required is true and ATC is not here: the stage's, and the pre-flight's
    (llmpipe.config_checks), which finds it before training."""
    return (f"convert_om.required is true but ATC was not found (PATH, CANN toolkit in "
            f"{', '.join(_toolkit_dirs())}); install CANN and source set_env.sh, or set convert_om.atc_path")


def _not_found(section: ConvertOmSection) -> StageResult:
    where = ", ".join(_toolkit_dirs())
    if section.required:
        raise StageError(required_but_missing())
    names = [PREFILL, DECODER] if section.decoder else [PREFILL]
    built = "model.om and decoder.om were" if section.decoder else "model.om was"
    reason = (f"ATC (CANN toolkit) not found on PATH or in {where}: {built} not built; "
              "set convert_om.required: true to make this an error")
    log.warning("convert_om skipped: %s", reason)
    # NOTE: a skipped manifest may list no outputs, but it may carry metrics.
    return StageResult(status="skipped", reason=reason, outputs={},
                       metrics={"graphs": {n: "skipped" for n in names}})


def _compile(graph: Graph, argv: list[str], work: Path, timeout_s: float) -> dict:
    """Run ATC for one graph: its argv json, log and .om in `work`; returns its metrics."""
    (work / graph.argv_name).write_text(json.dumps(argv, indent=2) + "\n", encoding="utf-8")
    log.info("running ATC for %s: %s", graph.onnx.name, shlex.join(argv))  # quoting for display only
    t0 = time.monotonic()
    om = convert(argv, work / graph.name, work / graph.log_name, timeout_s)
    seconds = round(time.monotonic() - t0, 3)
    log.info("ATC wrote %s (%d bytes) in %.1fs", om.name, om.stat().st_size, seconds)
    return {"seconds": seconds, "om_bytes": om.stat().st_size, "argv": argv}


def run(ctx: StageContext) -> StageResult:
    """Compile export_onnx's graphs with ATC (model.onnx -> model.om; decoder_static.onnx ->
    decoder.om), or record why not. Every graph is checked before ATC runs for any."""
    section = ctx.cfg.convert_om
    atc = find_atc(section)
    if atc is None:
        return _not_found(section)
    work = Path(ctx.work_dir).resolve()
    try:
        graphs, no_decoder = plan(ctx)
        argvs = [build_argv(g.section, atc, g.onnx, work / g.name) for g in graphs]
    except ValueError as err:
        raise StageError(str(err)) from None
    if no_decoder:
        log.warning("convert_om: %s", no_decoder)
    outputs: dict[str, str] = {}
    metrics: dict = {"atc": atc, "graphs": {}}
    for graph, argv in zip(graphs, argvs):
        metrics["graphs"][graph.name] = _compile(graph, argv, work, section.timeout_s)
        outputs.update(graph.outputs())
    if no_decoder:
        metrics["graphs"][DECODER] = "skipped"
        metrics["skipped"] = {DECODER: no_decoder}
    metrics["seconds"] = round(sum(m["seconds"] for m in metrics["graphs"].values() if m != "skipped"), 3)
    return StageResult(outputs=outputs, metrics=metrics)
