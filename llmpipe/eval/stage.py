"""The evaluate stage: EleutherAI's lm-evaluation-harness on the consolidated model and on every deployed variant.

The reference is the consolidated Hugging Face folder (hf/) through lm_eval's own HFLM (without hf/,
consolidate.hf_layout false: the consolidated weights in PyTorch through llmpipe.eval.lm.EngineLM). Each
variant of benchmark.variants runs through EngineLM over the graphs it is deployed as on the CPU: its
ORT-optimised graph where the run has one (fp32: export_onnx's ort/, int4 / int8w: the benchmark's
variants/<v>/ort/; llmpipe.infer.fused.FusedEngine), else export_onnx's model.onnx + decoder_static.onnx for
fp32 and the benchmark's variants/<v>/ for the others (checked against the decoder's contract first); with
evaluate.torch also the weights in PyTorch eager. The tasks: see
llmpipe.eval.tasks. Everything runs offline.

Outputs: results.json (lm_eval's own output per model, untouched but for its per-sample logs, which are not
kept, and our summary: per task metric the value, stderr, delta against the reference and the verdict),
results.md (task x variant table), scores.png, tasks/ (the local tasks' YAMLs and data). Gates:
evaluate.gates.<variant>.max_drop (or .tasks.<task>): a gated metric (every one but the perplexities,
whose scale is unbounded; bits_per_byte rising counts as a drop) further below the reference than that fails
the stage in one line, or, with evaluate.enforce false, marks the variant rejected (`llmpipe serve` then
refuses it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmpipe.eval import tasks as eval_tasks
from llmpipe.eval.tasks import EvalTaskError
from llmpipe.manifest import write_json_atomic
from llmpipe.stages import StageContext, StageError, StageResult

log = logging.getLogger("llmpipe.eval")

RESULTS_FILE, TABLE_FILE, PLOT_FILE, TASKS_DIR = "results.json", "results.md", "scores.png", "tasks"
REFERENCE = "reference"


def offline() -> None:
    """No hub access from here on: a dataset or model that is not on disk fails at once, never hangs."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    import sys

    for module, names in (("datasets.config", ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")),
                          ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        mod = sys.modules.get(module)
        for name in names:
            if mod is not None and hasattr(mod, name):
                setattr(mod, name, True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def task_manager(plan: eval_tasks.TaskPlan):
    from lm_eval.tasks import TaskManager

    # NOTE: indexing lm_eval's ~15k built-in task YAMLs takes seconds; done only when a name needs it
    return TaskManager(include_defaults=bool(plan.names))


def task_specs(plan: eval_tasks.TaskPlan, local: dict[str, Path], roots: list[Path]) -> list[str | dict]:
    specs: list[str | dict] = [eval_tasks.task_config(p) for p in local.values()]
    specs += [eval_tasks.task_config(p, eval_tasks.read_task_yaml(p, roots)) for p in plan.yamls.values()]
    return specs + list(plan.names)


def check_tasks(specs: list[str | dict], manager) -> None:
    """Each task loaded once (its dataset read from disk) before any model: one line for an unknown name
    or a dataset that is not on this machine."""
    for spec in specs:
        name = spec if isinstance(spec, str) else spec["task"]
        if isinstance(spec, str) and spec not in manager.all_tasks:
            raise EvalTaskError(f"evaluate.tasks: unknown task {spec!r} (not an lm_eval task, group or tag; "
                                "`lm-eval ls tasks` lists them)")
        try:
            manager.load([spec])
        except Exception as err:  # lm_eval and datasets raise many kinds; each becomes one line here
            dataset = spec.get("dataset_path") if isinstance(spec, dict) else _dataset_of(manager, spec)
            raise EvalTaskError(f"evaluate.tasks: {name}: its dataset {dataset or '?'} could not be loaded offline "
                                f"({type(err).__name__}: {_first_line(err)[:200]}); put it in the local Hugging "
                                "Face cache first (docs/guides/evaluate.md)") from None


def _dataset_of(manager, name: str) -> str | None:
    entry = manager.task_index.get(name)
    path = getattr(entry, "yaml_path", None)
    if path is None:
        return None
    try:  # NOTE: read as text: lm_eval's YAMLs carry tags (!function) that safe_load refuses
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("dataset_path:")), None)


@contextlib.contextmanager
def env_info_once():
    """lm_eval adds the environment (torch's collect_env: seconds of subprocesses) to every model's output; in
    one stage it is the same for every model, so it is collected once and the same record given to each."""
    import lm_eval.evaluator as evaluator

    collect, seen = evaluator.add_env_info, {}

    def once(storage: dict) -> None:
        if not seen:
            collect(seen)
        storage.update(seen)

    evaluator.add_env_info = once
    try:
        yield
    finally:
        evaluator.add_env_info = collect


def evaluate(lm, specs: list, manager, e) -> dict[str, Any]:
    """lm_eval's simple_evaluate on one model; its output dict, per-sample logs left out."""
    from lm_eval.evaluator import simple_evaluate

    out = simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=e.limit, num_fewshot=e.num_fewshot,
                          log_samples=False, random_seed=e.seed, numpy_random_seed=e.seed, torch_random_seed=e.seed,
                          fewshot_random_seed=e.seed, bootstrap_iters=1000)
    if out is None:
        raise StageError("evaluate: lm_eval returned no results")
    return out


# --------------------------------------------------------------------------- the models


def _reference(ctx: StageContext, args, e) -> tuple[Callable | None, str]:
    folder, manifest = ctx.inputs["consolidate"]
    if "hf" in {n.split("/")[0] for n in manifest.outputs}:
        hf = folder / "hf"

        def open_hf():
            from lm_eval.models.huggingface import HFLM

            return HFLM(pretrained=str(hf), tokenizer=str(hf), device="cpu", dtype="float32",
                        batch_size=e.batch_size, max_length=args.max_seq_len, trust_remote_code=False)

        return open_hf, "hf/ through lm_eval's HFLM"
    return None, "the consolidated weights in PyTorch (no hf/: consolidate.hf_layout is false)"


def _check_graph(path: Path, session, kind: str, args, length: int) -> None:
    from llmpipe.infer.decode import graph_problem

    problem = graph_problem(session, kind, args, length)
    if problem:
        raise StageError(f"evaluate: {path}: not the {kind} graph export_onnx makes for this model: {problem}")


def variant_graphs(ctx: StageContext, name: str) -> tuple[Path, Path | None]:
    """(prefill graph, static decoder or None) of a deployed variant, as the benchmark made them."""
    folder, manifest = ctx.inputs["export_onnx"]
    static = manifest.path(folder, "decoder_static") if "decoder_static" in manifest.outputs else None
    if name == "fp32":
        return manifest.path(folder, "model"), static
    bench, bm = ctx.inputs["benchmark"]
    prefill = bench / "variants" / name / "model.onnx"
    decoder = bench / "variants" / name / "decoder_static.onnx"
    if f"variants/{name}/model.onnx" not in bm.outputs:
        raise StageError(f"evaluate: {bench}: no {name} variant (its conversion failed in the benchmark stage)")
    return prefill, decoder if f"variants/{name}/decoder_static.onnx" in bm.outputs else None


def ort_graph(ctx: StageContext, name: str) -> Path | None:
    """The variant's ORT-optimised graph folder (fp32: export_onnx's ort/; int4 / int8w: the benchmark's
    variants/<name>/ort/), or None when the run has none."""
    folder, manifest = ctx.inputs["export_onnx"]
    if name == "fp32":
        return manifest.path(folder, "ort_graph/model.onnx").parent if "ort_graph/model.onnx" in manifest.outputs \
            else None
    bench, bm = ctx.inputs["benchmark"]
    return bench / "variants" / name / "ort" if f"variants/{name}/ort/model.onnx" in bm.outputs else None


def engine_lm(ctx: StageContext, name: str, args, tokenizer, eos: int, prefix: int, stop_ids: list[int], e,
              threads: int | None):
    """EngineLM over variant `name` (fp32 / fp16 / int8 / torch)."""
    import torch

    from llmpipe.eval.lm import EngineLM, PrefillEngine, ort_logits, torch_logits

    kw = dict(max_length=args.max_seq_len, eot_id=eos, prefix_id=prefix, stop_ids=stop_ids,
              batch_size=e.batch_size, progress_every_s=e.progress_every_s)
    if name == "torch":
        from llmpipe.infer.decode import TorchEngine
        from llmpipe.models.llama.io import load_model

        model = load_model(ctx.input_path("consolidate", "model").parent, dtype=torch.float32).eval()
        return EngineLM(name, tokenizer, torch_logits(model), TorchEngine(model), **kw)
    from llmpipe import device
    from llmpipe.export.onnx import check_external_data
    from llmpipe.infer.decode import StaticEngine
    from llmpipe.infer.ort import create_session

    cpu = device.ort_providers(["cpu"])[0]
    prefill_path, decoder_path = variant_graphs(ctx, name)
    length = ctx.inputs["export_onnx"][1].metrics.get("static_decoder_cache_len")
    graph = ort_graph(ctx, name)
    if graph is not None:  # what generate and the benchmark deploy for this variant on the CPU
        from llmpipe.infer.fused import FusedEngine, GraphConfig, graph_problem

        session = create_session(graph / "model.onnx", cpu, threads)
        config = GraphConfig.read(graph)
        problem = graph_problem(session, config, args)
        if problem:
            raise StageError(f"evaluate: {graph / 'model.onnx'}: not the ORT-optimised graph of this model: {problem}")
        scorer = FusedEngine(session, config, args.max_seq_len)  # whole windows: up to the model's context
        engine = FusedEngine(session, config, length if isinstance(length, int) and length > 0 else args.max_seq_len)
        return EngineLM(name, tokenizer, scorer.prompt, engine, **kw)
    check_external_data(prefill_path)
    prefill = create_session(prefill_path, cpu, threads)
    _check_graph(prefill_path, prefill, "prefill", args, length or args.max_seq_len)
    if decoder_path is None or not isinstance(length, int) or length < 1:
        engine = PrefillEngine(ort_logits(prefill), args.max_seq_len)
    else:
        check_external_data(decoder_path)
        decoder = create_session(decoder_path, cpu, threads)
        _check_graph(decoder_path, decoder, "decoder", args, length)
        engine = StaticEngine(prefill, decoder, args, length)
    return EngineLM(name, tokenizer, ort_logits(prefill), engine, **kw)


def chat_setup(ctx: StageContext, tokenizer) -> tuple | None:
    """(render(messages) -> prompt, end-of-turn strings, stop ids) of a chat run, its template checked against
    training's digest; None for a text run."""
    from llmpipe.checkpoint.template_digest import consolidated_template
    from llmpipe.models.llama.hf_files import single_token_ids

    found = consolidated_template(ctx.run_dir, *ctx.inputs["consolidate"])
    if found is None:
        return None
    tpl, render = found
    bos, eos = render.get("bos_token", ""), render.get("eos_token", "")

    def render_messages(messages: list[dict]) -> str:
        return tpl.render(messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)

    return render_messages, list(tpl.end_of_turn), single_token_ids(tokenizer, list(tpl.end_of_turn))


def special_ids(ctx: StageContext, tokenizer, vocab_size: int) -> tuple[int, int]:
    """(eos, the prefix an empty context becomes): as HFLM reads them from hf/ (bos if it names one, else eos)."""
    from llmpipe.models.llama.hf_files import read_json

    folder, _ = ctx.inputs["consolidate"]
    special = read_json(folder / "hf" / "special_tokens_map.json") if (folder / "hf").is_dir() else None
    special = special or {}
    eos_token = special.get("eos_token") or ctx.cfg.data.tokenizer.eos_token
    eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
    eos = tokenizer.token_to_id(eos_token)
    if eos is None:
        raise StageError(f"evaluate: the run's eos token {eos_token!r} is not in its tokenizer")
    bos_token = special.get("bos_token")
    bos_token = bos_token.get("content") if isinstance(bos_token, dict) else bos_token
    bos = tokenizer.token_to_id(bos_token) if bos_token else None
    return eos, eos if bos is None else bos


# --------------------------------------------------------------------------- scores, gates, tables


def scores(output: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """{task: {metric: {"value", "stderr"}}} of one lm_eval output (filters other than none kept in the name)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for task, metrics in output.get("results", {}).items():
        row: dict[str, dict[str, float | None]] = {}
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if filt == "none" else f"{metric}({filt})"
            err = metrics.get(f"{metric}_stderr,{filt}")
            row[name] = {"value": float(value), "stderr": float(err) if isinstance(err, (int, float)) and
                         not isinstance(err, bool) and math.isfinite(err) else None}
        out[task] = row
    return out


def higher_is_better(output: dict[str, Any], task: str, metric: str) -> bool | None:
    hib = output.get("higher_is_better", {}).get(task, {})
    return hib.get(metric.split("(")[0])


def gated(metric: str) -> bool:
    return "perplexity" not in metric


def judge(outputs: dict[str, dict], e) -> tuple[dict[str, Any], list[str], list[str]]:
    """(summary, failure lines, rejected variants): every variant's task metrics against the reference's."""
    ref = scores(outputs[REFERENCE])
    summary: dict[str, Any] = {"tasks": {}, "verdicts": {}}
    failures: list[str] = []
    for name, output in outputs.items():
        got = scores(output)
        gate = getattr(e.gates, name, None)
        worst = None
        for task, metrics in got.items():
            for metric, v in metrics.items():
                cell = dict(v)
                r = ref.get(task, {}).get(metric)
                hib = higher_is_better(outputs[REFERENCE], task, metric)
                if name != REFERENCE and r is not None:
                    cell["delta"] = v["value"] - r["value"]
                    limit = None if gate is None else gate.tasks.get(task, gate.max_drop)
                    if limit is not None and hib is not None and gated(metric):
                        drop = -cell["delta"] if hib else cell["delta"]
                        cell["limit"] = limit
                        if drop > limit + 1e-12 and (worst is None or drop - limit > worst[0]):
                            field = f"evaluate.gates.{name}." + (f"tasks.{task}" if task in gate.tasks else "max_drop")
                            worst = (drop - limit, f"{name} fails its evaluation gate: {task} {metric} "
                                     f"{v['value']:.3f} vs {r['value']:.3f} ({cell['delta']:+.3f} > {limit:g}; "
                                     f"{field})")
                summary["tasks"].setdefault(task, {}).setdefault(metric, {})[name] = cell
        if name != REFERENCE:
            summary["verdicts"][name] = "accepted" if worst is None else "rejected"
            if worst is not None:
                failures.append(worst[1])
                summary.setdefault("rejected_because", {})[name] = worst[1]
    rejected = [n for n, v in summary["verdicts"].items() if v == "rejected"]
    return summary, failures, rejected


def benchmark_accepted(ctx: StageContext) -> tuple[list[str], list[str]]:
    """(the variants of benchmark.variants the benchmark accepted, a note for each it rejected): a variant
    rejected by its quality gate is not deployable, so it is not scored here either."""
    bench = ctx.inputs.get("benchmark")
    rejected = set((bench[1].metrics.get("rejected") or []) if bench else [])
    scored = [v for v in ctx.cfg.benchmark.variants if v not in rejected]
    return scored, [f"{v}: not evaluated (rejected by the benchmark's quality gate)" for v in
                    ctx.cfg.benchmark.variants if v in rejected]


def enforce(summary: dict[str, Any], failures: list[str], on: bool, required) -> None:
    """As the benchmark's gates (quality.enforce_gates): with `on`, StageError naming every failing variant
    when a required one (benchmark.require) failed or none is left deployable; otherwise recorded only."""
    verdicts = summary["verdicts"]
    failed = [n for n, v in verdicts.items() if v == "rejected"]
    must = [n for n in failed if n in required]
    if on and failed and (must or len(failed) == len(verdicts)):
        why = f"required {', '.join(must)} (benchmark.require) failed" if must else "no variant is left deployable"
        raise StageError(f"evaluate: {why}; {len(failed)} of {len(verdicts)} failed their evaluation gates: "
                         + "; ".join(failures))


def _fmt(cell: dict | None, digits: int = 4) -> str:
    if not cell:
        return "-"
    s = f"{cell['value']:.{digits}f}"
    if cell.get("stderr") is not None:
        s += f" ± {cell['stderr']:.{digits}f}"
    if cell.get("delta") is not None:
        s += f" ({cell['delta']:+.{digits}f})"
    return s


def markdown(summary: dict[str, Any], names: list[str], reference: str, limit: int | None) -> str:
    """One table, a row per task metric, a column per model: value ± stderr (delta against the reference)."""
    lines = [f"Reference: {reference}. Each cell: score ± stderr (delta against the reference); "
             f"{'all' if limit is None else f'the first {limit}'} documents per task.", "",
             "| task | metric | " + " | ".join(names) + " |", "|---|---|" + "--:|" * len(names)]
    for task, metrics in summary["tasks"].items():
        for metric, cells in metrics.items():
            lines.append(f"| {task} | {metric} | " + " | ".join(_fmt(cells.get(n)) for n in names) + " |")
    verdicts = summary.get("verdicts", {})
    if verdicts:
        lines += ["", "Verdicts: " + ", ".join(f"{n} {v}" for n, v in verdicts.items())]
        lines += [f"- {why}" for why in summary.get("rejected_because", {}).values()]
    return "\n".join(lines) + "\n"


def load_results(folder: str | Path) -> dict[str, Any]:
    """The results dict of a finished evaluate stage folder (its results.json)."""
    return json.loads((Path(folder) / RESULTS_FILE).read_text(encoding="utf-8"))


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per task metric: a column per model (score ± stderr (delta)), for the run report."""
    summary = results["summary"]
    names = [n for n in results.get("lm_eval", {})] or sorted({n for ms in summary["tasks"].values()
                                                               for cells in ms.values() for n in cells})
    rows = [{"task": t, "metric": m, **{n: _fmt(cells.get(n)) for n in names}}
            for t, ms in summary["tasks"].items() for m, cells in ms.items()]
    verdicts = summary.get("verdicts", {})
    if rows and verdicts:
        rows.append({"task": "verdict", "metric": "", **{n: verdicts.get(n, "") for n in names}})
    return rows


def plot(summary: dict[str, Any], names: list[str], path: Path) -> None:
    """A bar per model for each gated task metric, with its stderr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [(t, m, cells) for t, ms in summary["tasks"].items() for m, cells in ms.items() if gated(m)]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * max(1, len(rows))), 3.4), dpi=100)
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        vals = [cells.get(name, {}).get("value", np.nan) for _, _, cells in rows]
        errs = [cells.get(name, {}).get("stderr") or 0 for _, _, cells in rows]
        ax.bar(np.arange(len(rows)) + k * width, vals, width, yerr=errs, label=name, capsize=2)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{t}\n{m}" for t, m, _ in rows], fontsize=8)
    ax.set_ylabel("score")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(ctx: StageContext) -> StageResult:
    """The evaluate stage: results.json, results.md, scores.png and tasks/ in ctx.work_dir."""
    from lm_eval.utils import handle_non_serializable

    from llmpipe.data.tokenizer import load_tokenizer
    from llmpipe.models.llama.io import TOKENIZER, read_args

    e, cfg = ctx.cfg.evaluate, ctx.cfg
    offline()
    plan = eval_tasks.plan(cfg)
    model_dir = ctx.input_path("consolidate", "model").parent
    try:
        args = read_args(model_dir)
    except ValueError as err:
        raise StageError(str(err)) from None
    tokenizer = load_tokenizer(model_dir / TOKENIZER)
    chat = chat_setup(ctx, tokenizer)
    docs = eval_tasks.validation_docs(ctx.input_path("prepare_data", "val_bin"), tokenizer, special=chat is not None) \
        if set(plan.local) & {eval_tasks.CHOICE, eval_tasks.PPL} else []
    skipped: dict[str, str] = {}
    local = eval_tasks.build_local(ctx.work_dir / TASKS_DIR, plan.local, docs=docs, tokenizer=tokenizer, cfg=cfg,
                                   max_tokens=args.max_seq_len, chat=chat[:2] if chat else None, skipped=skipped)
    for task, why in skipped.items():
        log.warning("evaluate: %s %s", task, why)
    specs = task_specs(plan, local, [Path.cwd(), ctx.run_dir])
    if not specs:
        raise StageError(f"evaluate: nothing to evaluate: {'; '.join(f'{t} {w}' for t, w in skipped.items())}")
    manager = task_manager(plan)
    with eval_tasks.sandboxed_templates():
        check_tasks(specs, manager)  # before any model: unknown names, datasets not on disk

    eos, prefix = special_ids(ctx, tokenizer, args.vocab_size)
    stop_ids = chat[2] if chat else []
    threads = ctx.cfg.benchmark.threads
    open_ref, reference = _reference(ctx, args, e)
    models: list[tuple[str, Callable]] = [(REFERENCE, open_ref)]
    if open_ref is None:  # no hf/: PyTorch through EngineLM is the reference
        models = [(REFERENCE, lambda: engine_lm(ctx, "torch", args, tokenizer, eos, prefix, stop_ids, e, threads))]
    elif e.torch:
        models.append(("torch", lambda: engine_lm(ctx, "torch", args, tokenizer, eos, prefix, stop_ids, e, threads)))
    scored, not_scored = benchmark_accepted(ctx)
    for name in scored:
        models.append((name, lambda n=name: engine_lm(ctx, n, args, tokenizer, eos, prefix, stop_ids, e, threads)))

    outputs: dict[str, dict] = {}
    with env_info_once(), eval_tasks.sandboxed_templates():  # a task file's templates are untrusted
        for name, opener in models:
            log.info("evaluate: %s on %s", name, ", ".join(s if isinstance(s, str) else s["task"] for s in specs))
            outputs[name] = evaluate(opener(), specs, manager, e)
    summary, failures, rejected = judge(outputs, e)
    enforce(summary, failures, e.enforce, cfg.benchmark.require)
    names = list(outputs)
    om = "om: not evaluated (an OM model is run through ais_bench by the benchmark stage only)"
    results = {"reference": reference, "limit": e.limit, "num_fewshot": e.num_fewshot, "seed": e.seed,
               "notes": [om, *not_scored, *(f"{t}: {w}" for t, w in skipped.items())],
               "summary": summary, "rejected": rejected, "lm_eval": outputs}
    text = json.dumps(results, indent=2, default=handle_non_serializable)
    write_json_atomic(ctx.work_dir / RESULTS_FILE, json.loads(text))
    (ctx.work_dir / TABLE_FILE).write_text(f"# Evaluation: {cfg.run.name}\n\n"
                                           f"{markdown(summary, names, reference, e.limit)}", encoding="utf-8")
    plot(summary, names, ctx.work_dir / PLOT_FILE)
    flat = {f"{t}/{m}": {n: c["value"] for n, c in cells.items()}
            for t, ms in summary["tasks"].items() for m, cells in ms.items()}
    return StageResult(outputs={"results": RESULTS_FILE, "table": TABLE_FILE, "plot": PLOT_FILE, "tasks": TASKS_DIR},
                       metrics={"scores": flat, "verdicts": summary["verdicts"], "rejected": rejected,
                                "reference": reference})
