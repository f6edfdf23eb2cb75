"""`llmpipe` command line.

    llmpipe run CONFIG [--run-name N] [--set k=v ...] [--from-stage S] [--only S1,S2] [--force]
    llmpipe stage STAGE CONFIG [--run-name N] [--set k=v ...] [--force]     (no Prefect)
    llmpipe status RUN [--artifacts-dir DIR] [--config CONFIG [--set k=v ...]]
    llmpipe report RUN [--artifacts-dir DIR]
    llmpipe generate RUN|models:/NAME@ALIAS --prompt TEXT [--max-new-tokens N]
                     [--variant torch|fp32|fp16|int8|int4|int8w|int8s|om] [--temperature T] [--top-k K] [--top-p P]
                     [--seed S] [--artifacts-dir DIR]     (streams text to stdout)
    llmpipe generate RUN --chat QUESTION [--system TEXT] [options as above]     (a chat run's answer alone)
    llmpipe serve RUN|models:/NAME@ALIAS|--latest-passing [--variant V] [--host 127.0.0.1] [--port 8000]
                      [--max-batch N] [--max-queue N] [--api-key-file F] [--allow-ungated]   (an OpenAI endpoint)
    llmpipe bench serve RUN [--url URL] [--concurrency 1,4,8,16] [--rate R] [--requests N] [--max-tokens N]
                      [--json OUT]     (an OpenAI-compatible endpoint under load: TTFT, TPOT, tokens/s)
    llmpipe clean RUN [--keep N] [--artifacts-dir DIR]     remove superseded training folders (checkpoints)
    llmpipe track RUN [--tracking-uri URI] [--artifacts-dir DIR]     log (back-fill) a run folder to MLflow
    llmpipe promote RUN|NAME/VERSION [--alias production] [--force] [--tracking-uri URI]   (gates must have passed)
    llmpipe runs [--experiment E] [--tracking-uri URI] [--artifacts-dir DIR]     the runs logged to MLflow
    llmpipe dryrun CONFIG [--world-size N] [--set k=v ...] [--all-ranks]     (fake process group, meta model)
    llmpipe plan CONFIG [--world-size N] [--set k=v ...] [--memory-gib M] [--json] ...   (arithmetic only)
    llmpipe plan CONFIG --deploy [--soc S] [--memory-bandwidth-gbs B] [--memory-gib M]     (inference sizing)
    llmpipe tune buckets CONFIG [--values 1,5,10,25,50,100] [--steps N] [--nproc N] [--repeats R] [--write]
                     [--set k=v ...]
                     (short DDP trainings per bucket_cap_mb: tokens/s, exposed communication, the plan's estimate)

User errors print one line, `error: ...`, and exit with status 2 (config) or 1 (a stage failed).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from llmpipe import config as config_mod
from llmpipe.config import STAGES, ConfigError

# generate/serve --variant (llmpipe.tools.generate.VARIANTS, kept here so that --help imports no engine)
ONNX_VARIANTS = ("torch", "fp32", "fp16", "int8", "int4", "int8w", "int8s", "om")


# `llmpipe --help`, grouped by what a user does. A new command is one line here (its group and one example,
# shown in its own --help) beside its add_parser; tests/unit/test_docs.py holds every command to a line and
# parses every example.
RUN, INSPECT, DEPLOY, TRACK, PLAN = ("run the pipeline", "inspect a run", "deploy and serve", "track and promote",
                                     "plan and tune")
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("run", RUN, "llmpipe run configs/tiny.yaml --set train.max_steps=50"),
    ("stage", RUN, "llmpipe stage export_onnx configs/tiny.yaml --force"),
    ("synth-chat", RUN, "llmpipe synth-chat artifacts/chat_demo"),
    ("import-gguf", RUN, "llmpipe import-gguf SmolLM2-135M-Instruct.Q4_1.gguf artifacts/smollm2-135m-instruct"),
    ("status", INSPECT, "llmpipe status tiny"),
    ("report", INSPECT, "llmpipe report tiny"),
    ("generate", INSPECT, 'llmpipe generate tiny --prompt "def main(" --variant int8'),
    ("clean", INSPECT, "llmpipe clean tiny --keep 1"),
    ("serve", DEPLOY, "llmpipe serve tiny --variant int8 --port 8000"),
    ("bench", DEPLOY, "llmpipe bench serve tiny --concurrency 1,4 --requests 16"),
    ("track", TRACK, "llmpipe track tiny"),
    ("promote", TRACK, "llmpipe promote tiny --alias production"),
    ("runs", TRACK, "llmpipe runs"),
    ("plan", PLAN, "llmpipe plan configs/llama7b_64dev.yaml"),
    ("dryrun", PLAN, "llmpipe dryrun configs/llama7b_64dev.yaml --world-size 64"),
    ("job", PLAN, "llmpipe job configs/llama7b_64dev.yaml --set train.launcher=slurm --dry-run"),
    ("tune", PLAN, "llmpipe tune buckets configs/tiny.yaml --values 5,25 --steps 6"),
)


def _grouped(sub: argparse._SubParsersAction) -> str:
    """The commands by group, each with its one-line help, for the top-level --help."""
    import textwrap

    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    lines = []
    for group in dict.fromkeys(g for _, g, _ in COMMANDS):
        lines.append(f"{group}:")
        for name, g, _ in COMMANDS:
            if g == group:
                lines += textwrap.wrap(helps.get(name, ""), 100, initial_indent=f"  {name:<12}",
                                       subsequent_indent=" " * 14)
    return "\n".join(lines)


def _finish(p: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    """Each command's --help ends with its example; the top-level --help lists the commands by group."""
    examples = {name: example for name, _, example in COMMANDS}
    for name, sp in sub.choices.items():
        nested = [c for a in sp._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
        for one in ([sp, *nested] if name in examples else []):  # bench serve, tune buckets: their command's
            one.epilog = f"example:\n  {examples[name]}"
            one.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (f"{p.description}\n\n{_grouped(sub)}\n\n`llmpipe COMMAND --help`: a command's options and an "
                     "example. Documentation: docs/ (docs/index.md).")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmpipe", description="LLaMA training-to-deployment pipeline.",
                                usage="llmpipe [-h] COMMAND ...", formatter_class=argparse.RawDescriptionHelpFormatter)
    # the commands are listed by group in the description (_finish), not in argparse's flat list
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="llmpipe")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", help="run config YAML, e.g. configs/tiny.yaml")
        sp.add_argument("--run-name", help="override run.name (the folder under artifacts/)")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.max_steps=100 (repeatable)")
        sp.add_argument("--force", action="store_true", help="re-run even when up to date")

    run = sub.add_parser("run", help="run the pipeline as a Prefect flow")
    common(run)
    run.add_argument("--from-stage", choices=STAGES, help="re-run this stage and every later one")
    run.add_argument("--only", help="comma-separated stages to run, e.g. export_onnx,benchmark")
    run.add_argument("--verbose", action="store_true",
                     help="print every log line on the terminal too (Prefect's task-run lines, each stage's detail, "
                     "lm_eval's notices, tracebacks of a failed stage); always in <run>/logs/ and the Prefect UI")

    stage = sub.add_parser("stage", help="run one stage without Prefect")
    stage.add_argument("stage", choices=STAGES)
    common(stage)

    job = sub.add_parser("job", help="the train stage's job on a cluster (train.launcher slurm or kubernetes): "
                         "submit and follow it (the train stage, as `llmpipe stage train`), or print it")
    common(job)
    job.add_argument("--dry-run", action="store_true", help="print the sbatch script or the manifest; submit nothing")

    status = sub.add_parser("status", help="each stage's state, fingerprint match and duration")
    status.add_argument("run", help="run name (folder under the artifacts dir)")
    status.add_argument("--artifacts-dir", default="artifacts")
    status.add_argument("--config", help="compare against this config instead of the recorded one")
    status.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    dry = sub.add_parser("dryrun", help="build the dp x tp x pp mesh, TP plan and PP stages at full world size "
                         "without hardware; print per-rank parameters and model-state memory")
    dry.add_argument("config")
    dry.add_argument("--world-size", type=int, help="default: dp * tp * pp from the config")
    dry.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    dry.add_argument("--all-ranks", action="store_true", help="print every rank, not only dp replica 0")

    plan = sub.add_parser("plan", help="size a run before it starts: memory per device, FLOPs and training "
                          "time, gradient-sync volume, pipeline bubble, the largest micro-batch that fits")
    plan.add_argument("config")
    plan.add_argument("--world-size", type=int, help="default: dp * tp * pp from the config, else nproc_per_node")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--peak-tflops", type=float, help="dense peak per device; default: train.peak_tflops, "
                      "else the planning device's (llmpipe.device.PLAN_DEVICE)")
    plan.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed (default 0.4)")
    plan.add_argument("--bandwidth-gbps", type=float, help="per-device network bandwidth for the gradient sync, "
                      "gigabits/s (default 100; not with --deploy, whose bandwidth is --memory-bandwidth-gbs)")
    plan.add_argument("--tokens", type=float, help="training tokens; default 20 per parameter (Chinchilla)")
    plan.add_argument("--memory-gib", type=float, help="memory per device for the recommendation (default: "
                      "the planning device's, llmpipe.device.PLAN_MEMORY_GIB)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    plan.add_argument("--deploy", action="store_true", help="size inference instead: weight and KV-cache bytes, "
                      "a memory-bandwidth lower bound on decode time per token, the benchmark's measured one")
    plan.add_argument("--soc", help="with --deploy: the target device, e.g. Ascend910B, Ascend310P3, H100-SXM "
                      "(default: convert_om.soc_version)")
    plan.add_argument("--memory-bandwidth-gbs", type=float, help="with --deploy: the target's memory bandwidth, "
                      "GB/s, overriding the table (needed for a device it lacks, e.g. --soc cpu)")

    clean = sub.add_parser("clean", help="remove the folders of earlier attempts kept under <run>/superseded/ "
                           "(their checkpoints): the only command that deletes them")
    clean.add_argument("run", help="run name (folder under the artifacts dir)")
    clean.add_argument("--keep", type=int, default=0, help="keep the newest N per stage (default 0)")
    clean.add_argument("--artifacts-dir", default="artifacts")

    gen = sub.add_parser("generate", help="continue a prompt with a finished run's model, streaming the text")
    gen.add_argument("run", help="run name (folder under the artifacts dir), the path of a run folder, or a "
                     "registered model: models:/NAME@ALIAS or models:/NAME/VERSION")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to continue")
    what.add_argument("--chat", help="a question for a chat run: rendered with its chat template, only the answer "
                      "is printed")
    gen.add_argument("--system", help="with --chat: a system message before the question")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--variant", default="fp32", choices=ONNX_VARIANTS,
                     help="torch: PyTorch eager; fp32/fp16/int8/int4/int8w/int8s: onnxruntime with the static "
                     "KV-cache decoder (all but fp32 come from the benchmark stage); om: ais_bench (CANN). "
                     "Default fp32")
    gen.add_argument("--temperature", type=float, default=0.0, help="finite, >= 0; 0 (default): greedy")
    gen.add_argument("--top-k", type=int, help=">= 1")
    gen.add_argument("--top-p", type=float, help="in (0, 1]")
    gen.add_argument("--seed", type=int, help="seed of the sampler (temperature > 0), >= 0")
    gen.add_argument("--threads", type=int, help="intra-op threads, 1 to 1024 (default: all cores)")
    gen.add_argument("--allow-ungated", action="store_true", help="generate with a variant the benchmark's or the "
                     "evaluation's gate rejected (refused otherwise, as serve refuses it)")
    gen.add_argument("--artifacts-dir", default="artifacts")
    gen.add_argument("--tracking-uri", help="with models:/...: the registry (default: MLFLOW_TRACKING_URI, else "
                     "sqlite:///<artifacts-dir>/mlflow.db)")

    srv = sub.add_parser("serve", help="an OpenAI-compatible endpoint (FastAPI + uvicorn) over a finished run whose "
                         "benchmark gates passed")
    srv.add_argument("run", nargs="?", help="run name (folder under the artifacts dir), the path of a run folder, "
                     "or a registered model: models:/NAME@ALIAS or models:/NAME/VERSION")
    srv.add_argument("--latest-passing", action="store_true", help="instead of RUN: the run under --artifacts-dir "
                     "whose benchmark finished last with --variant through its gates")
    srv.add_argument("--variant", default="fp32", choices=ONNX_VARIANTS,
                     help="as for generate (default fp32)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    srv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    srv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot; beyond: 429 (default 64)")
    srv.add_argument("--api-key-file", help="a file holding the key clients must send as Authorization: Bearer KEY")
    srv.add_argument("--allow-ungated", action="store_true", help="serve a variant the benchmark's quality gate "
                     "rejected or did not measure (logged)")
    srv.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM, seconds the requests in flight "
                     "may take to finish (default 30)")
    srv.add_argument("--body-timeout", type=float, default=10.0, help="seconds a request's body may take to arrive; "
                     "beyond: 408 (default 10)")
    srv.add_argument("--threads", type=int, help="intra-op threads, 1 to 1024 (default: all cores)")
    srv.add_argument("--artifacts-dir", default="artifacts")
    srv.add_argument("--tracking-uri", help="with models:/...: the registry (default: MLFLOW_TRACKING_URI, else "
                     "sqlite:///<artifacts-dir>/mlflow.db)")

    bench = sub.add_parser("bench", help="measure a deployed endpoint")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bsrv = bench_sub.add_parser("serve", help="an OpenAI-compatible endpoint under concurrent load: requests/s, "
                                "output tokens/s, TTFT and TPOT p50/p90/p99 (the run's own llmpipe serve, or --url)")
    bsrv.add_argument("run", help="run name or folder: its validation text gives the prompts (and, without --url, "
                      "its model the server)")
    bsrv.add_argument("--url", help="measure this OpenAI-compatible server instead (e.g. http://127.0.0.1:8000)")
    bsrv.add_argument("--variant", default="fp32", choices=ONNX_VARIANTS,
                      help="the variant the local server serves (default fp32)")
    bsrv.add_argument("--concurrency", default="1,4,8,16", help="comma-separated levels (default 1,4,8,16)")
    bsrv.add_argument("--rate", type=float, help="requests/s of seeded Poisson arrivals (default: each client sends "
                      "its next request when the last one ended)")
    bsrv.add_argument("--requests", type=int, default=32, help="prompts per level (default 32)")
    bsrv.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    bsrv.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    bsrv.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals (default 0)")
    bsrv.add_argument("--api-key-file", help="the key to send as Authorization: Bearer KEY (and, without --url, "
                      "the one the local server requires)")
    bsrv.add_argument("--allow-ungated", action="store_true", help="the local server serves a variant its gates "
                      "rejected or did not measure")
    bsrv.add_argument("--json", type=Path, help="also write the results here")
    bsrv.add_argument("--artifacts-dir", default="artifacts")

    tune = sub.add_parser("tune", help="measure a setting by short trainings and pick the fastest")
    tune_sub = tune.add_subparsers(dest="tune", required=True)
    buckets = tune_sub.add_parser("buckets", help="DDP's bucket_cap_mb: train a few steps per value under the "
                                  "profiler into artifacts/<run>/tune/, print tokens/s, exposed communication "
                                  "and the plan's gradient-sync estimate, mark the fastest")
    buckets.add_argument("config")
    buckets.add_argument("--values", default="1,5,10,25,50,100", help="bucket_cap_mb values to try, MB, "
                         "comma-separated (default 1,5,10,25,50,100)")
    buckets.add_argument("--steps", type=int, default=10, help="training steps per value, about half of them "
                         "profiled (default 10, at least 4)")
    buckets.add_argument("--nproc", type=int, help="ranks on this node (default: train.nproc_per_node)")
    buckets.add_argument("--repeats", type=int, default=1, help="runs per value, the values taking turns (a busy "
                         "spell of a shared machine then falls on all of them); default 1")
    buckets.add_argument("--bandwidth-gbps", type=float, default=100.0,
                         help="network bandwidth of the plan's estimate, gigabits/s (default 100, as llmpipe plan)")
    buckets.add_argument("--write", action="store_true", help="set the fastest value in CONFIG (comments and "
                         "order kept; a symlink's target is edited; the original kept as CONFIG.bak, or "
                         "CONFIG.bak.1, .2, ... when earlier backups exist)")
    buckets.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    track = sub.add_parser("track", help="log a run folder to MLflow now (tracking.mlflow): params, curves, "
                           "stage results, artifacts, the registered model; what MLflow has already is not "
                           "logged twice")
    track.add_argument("run", help="run name (folder under the artifacts dir)")
    track.add_argument("--artifacts-dir", default="artifacts")
    track.add_argument("--tracking-uri", help="default: the run's tracking.mlflow.tracking_uri, else "
                       "sqlite:///<artifacts-dir>/mlflow.db")

    promote = sub.add_parser("promote", help="move a registry alias (production) to a model version whose "
                             "benchmark (and evaluation) gates passed")
    promote.add_argument("ref", metavar="RUN|NAME/VERSION", help="a run name (its current registered version) "
                         "or a registered model's version")
    promote.add_argument("--alias", default="production", help="default production")
    promote.add_argument("--force", action="store_true", help="promote although the gates did not pass "
                         "(recorded on the version as llmpipe.forced.<alias>, and logged)")
    promote.add_argument("--variant", choices=ONNX_VARIANTS, help="promote for this variant: it must have passed "
                         "the gates (the version passes when any variant did)")
    promote.add_argument("--artifacts-dir", default="artifacts")
    promote.add_argument("--tracking-uri", help="default: the run's; for NAME/VERSION: MLFLOW_TRACKING_URI, "
                         "else sqlite:///<artifacts-dir>/mlflow.db")

    runs = sub.add_parser("runs", help="a table of the runs logged to MLflow: status, steps, final val loss, "
                          "tokens/s, gate results, registered version and its aliases")
    runs.add_argument("--experiment", help="one experiment (default: all)")
    runs.add_argument("--artifacts-dir", default="artifacts")
    runs.add_argument("--tracking-uri", help="default: MLFLOW_TRACKING_URI, else sqlite:///<artifacts-dir>/mlflow.db")
    runs.add_argument("--deadline-s", type=float, default=60.0, help="give up (one line) when the store has not "
                      "answered in full within this many seconds (default 60)")

    rep = sub.add_parser("report", help="(re)write artifacts/<run>/report.html")
    rep.add_argument("run")
    rep.add_argument("--artifacts-dir", default="artifacts")

    synth = sub.add_parser("synth-chat", help="write the demo's conversation set (arithmetic, made-up-word "
                           "instructions and short facts, split by question) as OUT/train.jsonl and "
                           "OUT/val.jsonl (held-out questions)")
    synth.add_argument("out")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--arithmetic", type=int, default=2000, help="distinct arithmetic questions")
    synth.add_argument("--words", type=int, default=None, help="distinct made-up words (default: --arithmetic)")
    synth.add_argument("--val-fraction", type=float, default=0.1, help="share of questions held out")
    imp = sub.add_parser("import-gguf", help="turn a GGUF file (llama.cpp / Ollama) into a Hugging Face folder "
                         "that model.init_from takes: weights dequantised to fp32, tokenizer, chat template")
    imp.add_argument("gguf", help="the .gguf file (general.architecture llama)")
    imp.add_argument("out", help="the folder to write (must not exist; written whole or not at all)")
    _finish(p, sub)
    return p


def _overrides(args: argparse.Namespace) -> list[str]:
    return list(args.overrides) + ([f"run.name={args.run_name}"] if args.run_name else [])


def _recorded_config(run: str, artifacts_dir: str) -> config_mod.RunConfig:
    """The config of a run as recorded by its most recently finished stage, placed at the folder asked
    for: a copied run folder (`cp -a artifacts/base artifacts/copy2`) is copy2, not the base it records."""
    from llmpipe.manifest import Manifest
    from llmpipe.stages import stage_dir

    if not config_mod.RUN_NAME_RE.match(run):
        raise ConfigError(f"run {run!r}: not a valid run name")
    run_dir = Path(artifacts_dir) / run
    manifests = [m for s in STAGES if (m := Manifest.read(stage_dir(run_dir, s)))]
    if not manifests:
        raise ConfigError(f"{run_dir}: no stage of run {run!r} has finished yet")
    latest = max(manifests, key=lambda m: m.finished_at)
    tree = latest.config
    tree.setdefault("run", {}).update(name=run, artifacts_dir=artifacts_dir)
    # fields only: the recorded config passed the model checks when it ran, and status stays torch-free
    return config_mod.from_dict(tree, source=f"{run_dir} (recorded config)", check="fields")


def _status(args: argparse.Namespace) -> int:
    from llmpipe.tools.report import stage_rows

    if args.config:
        cfg = config_mod.load(args.config, [*args.overrides, f"run.name={args.run}",
                                            f"run.artifacts_dir={args.artifacts_dir}"])
    else:
        cfg = _recorded_config(args.run, args.artifacts_dir)
    print(f"run {cfg.run.name}: {cfg.run_dir()}")
    print(f"{'stage':<14} {'state':<10} {'status':<10} {'fingerprint':<13} {'duration':>9}  finished")
    for r in stage_rows(cfg):
        dur = f"{r['duration_s']:.1f}s" if r["duration_s"] is not None else "-"
        print(f"{r['stage']:<14} {r['state']:<10} {r['status']:<10} {r['fingerprint']:<13} {dur:>9}  "
              f"{r['finished_at']}{'  (' + r['reason'] + ')' if r['reason'] else ''}")
    _print_attempts(cfg.run_dir())
    return 0


def _print_attempts(run_dir: Path) -> None:
    """The last failure per stage, and the superseded folders kept (with their disk usage)."""
    from llmpipe import attempts
    from llmpipe.stages import stage_dir

    for name in STAGES:
        last = attempts.last_failure(run_dir, stage_dir(run_dir, name).name)
        if last:
            print(f"last failure of {name} ({last[0].when}): {last[1]}  [{last[0].path}]")
    superseded = attempts.kept(run_dir, attempts.SUPERSEDED)
    if superseded:
        sizes = [k.bytes for k in superseded]
        print(f"superseded (kept; `llmpipe clean {run_dir.name}` removes them): {len(superseded)} folder(s), "
              f"{_gib(sum(sizes))}")
        for k, size in zip(superseded, sizes):
            print(f"  {k.path.name:<48} {_gib(size):>10}  fingerprint {k.fingerprint}  kept {k.when}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _clean(args: argparse.Namespace) -> int:
    from llmpipe import attempts
    from llmpipe.lock import run_lock

    if not config_mod.RUN_NAME_RE.match(args.run):
        raise ConfigError(f"run {args.run!r}: not a valid run name")
    if args.keep < 0:
        raise ConfigError(f"--keep {args.keep}: must be >= 0")
    run_dir = Path(args.artifacts_dir) / args.run
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run folder")
    # The run folder may be a symlink (artifacts on another disk); superseded/ and failed/ inside it may
    # not (refused before anything is removed). Each removal is printed as it is done.
    with run_lock(run_dir):
        removed = attempts.clean(run_dir, keep=args.keep, done=lambda r: print(r, flush=True))
    print(f"clean: {len(removed)} superseded folder(s) removed, {_gib(sum(r.bytes for r in removed))} freed")
    return 0


def _run_flow(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, _overrides(args))  # one clear line before Prefect starts
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    from llmpipe.stages import StageError, select

    selected = select(args.from_stage, only)  # validates stage names
    from llmpipe.preflight import check_before_run  # the launch world size, before prepare_data

    check_before_run(cfg, selected, args.force or args.from_stage is not None, source=args.config)
    from flows.train_to_deploy import train_to_deploy

    if not args.verbose:
        from flows.console import quiet_engine_failures

        quiet_engine_failures()  # the one `error:` line instead of Prefect's tracebacks
        _quiet_console()
    from flows.local_server import ServerError, prefect_api

    try:
        # a server of our own (unless PREFECT_API_URL names one) that dies with this process
        with prefect_api():
            train_to_deploy(config=args.config, overrides=list(args.overrides), run_name=args.run_name,
                            from_stage=args.from_stage, only=only, force=args.force)
    except ServerError as err:
        raise StageError(str(err)) from None
    print(f"report: {cfg.run_dir() / 'report.html'}")
    return 0


def _quiet_console() -> None:
    """The terminal shows the stages' start and end lines, progress bars and the report's path; the rest
    goes to <run>/logs/ and the Prefect UI (llmpipe.console). The libraries' own progress bars and
    transformers' notices are switched off (set before the stages import them; a value already set wins)."""
    from llmpipe import console

    console.quiet_console()


def _quiet_libraries() -> list[str]:
    """Before anything imports tqdm (it reads TQDM_* when imported): the libraries' own progress bars off
    (llmpipe's own pass disable=False), datasets' too, transformers' notices (a value already set wins).
    Returns the variables it set, for main to unset when it returns (main may run inside another program)."""
    quiet = {"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    added = [k for k in quiet if k not in os.environ]
    os.environ.update({k: quiet[k] for k in added})
    return added


def _run_stage(args: argparse.Namespace) -> int:
    from llmpipe.stages import run_stage
    from llmpipe.tools import report

    cfg = config_mod.load(args.config, _overrides(args))
    if args.stage in config_mod.STAGES:  # an unknown name is run_stage's to refuse
        from llmpipe.preflight import check_before_run  # launch, resume, ATC: before the stage runs

        check_before_run(cfg, [args.stage], args.force, source=args.config)
    from llmpipe import tracking

    try:
        manifest, executed = run_stage(args.stage, cfg, force=args.force)
    except Exception:
        tracking.finish(cfg, ok=False)  # MLflow catches up with the folder: a warning at worst
        raise
    report.write(cfg)
    tracking.finish(cfg, ok=True)
    word = manifest.status if executed else "up to date (skipped)"
    print(f"{args.stage}: {word}{' - ' + manifest.reason if manifest.reason else ''}")
    return 0


def _job(args: argparse.Namespace) -> int:
    from llmpipe.train import cluster

    cfg = config_mod.load(args.config, _overrides(args))
    if cfg.train.launcher == "local":
        raise ConfigError(f"{args.config}: train.launcher: local starts torchrun here, no job to submit; set "
                          "train.launcher to slurm or kubernetes")
    if args.dry_run:
        print(cluster.describe(cfg), end="")
        return 0
    args.stage = "train"
    return _run_stage(args)


def _dryrun(args: argparse.Namespace) -> int:
    from llmpipe.parallel.mesh import LayoutError
    from llmpipe.tools import dryrun
    from llmpipe.train.cluster import planned_world

    cfg = config_mod.load(args.config, list(args.overrides))
    try:
        world = planned_world(cfg, args.world_size)  # a scheduler's job: its nodes x nproc_per_node
        print(dryrun.run(cfg, world or dryrun.default_world_size(cfg), args.all_ranks))
    except LayoutError as err:
        raise ConfigError(f"{args.config}: train.parallel: {err}") from None
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from llmpipe.parallel.mesh import LayoutError
    from llmpipe.tools import plan

    cfg = config_mod.load(args.config, list(args.overrides))
    if args.deploy:
        return _plan_deploy(args, cfg)
    if args.soc or args.memory_bandwidth_gbs is not None:
        raise ConfigError("--soc and --memory-bandwidth-gbs size a deployment: add --deploy")
    try:
        p = plan.plan(cfg, args.world_size, peak_tflops=args.peak_tflops, mfu=args.mfu,
                      bandwidth_gbps=100.0 if args.bandwidth_gbps is None else args.bandwidth_gbps,
                      tokens=args.tokens, memory_gib=args.memory_gib)
    except LayoutError as err:
        raise ConfigError(f"{args.config}: train.parallel: {err}") from None
    print(json.dumps(p.to_dict(), indent=2) if args.json else plan.format_table(p))
    return 0


def _plan_deploy(args: argparse.Namespace, cfg: config_mod.RunConfig) -> int:
    import json

    from llmpipe.tools import plan_deploy

    if args.bandwidth_gbps is not None:  # NOTE: the training plan's network bandwidth, in gigabits/s
        raise ConfigError("--bandwidth-gbps is the gradient sync's network bandwidth; with --deploy give the "
                          "device's memory bandwidth as --memory-bandwidth-gbs (GB/s)")
    d = plan_deploy.deploy(cfg, args.soc, bandwidth_gbs=args.memory_bandwidth_gbs, memory_gib=args.memory_gib)
    print(json.dumps(d.to_dict(), indent=2) if args.json else plan_deploy.format_deploy(d))
    return 0


def _tune(args: argparse.Namespace) -> int:
    from llmpipe.tools import tune, tune_write

    values = tune.parse_values(args.values)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
    nproc = [f"train.nproc_per_node={args.nproc}"] if args.nproc is not None else []
    cfg = config_mod.load(args.config, [*args.overrides, *nproc])
    points = tune.bucket_sweep(cfg, values, args.steps, args.bandwidth_gbps, args.repeats)
    print(tune.format_table(cfg, points, args.steps, args.bandwidth_gbps))
    if args.write:
        print(tune_write.write_bucket_cap(Path(args.config), tune.best(points).bucket_cap_mb, list(args.overrides)))
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, systemd, a container runtime), raised in the main thread as Ctrl-C raises
    KeyboardInterrupt: what is running cleans up (the train stage kills its torchrun group), then
    `main` prints one line and returns 143 (128 + SIGTERM), as a shell reports a SIGTERMed command."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _on_sigterm(handler):
    """Install `handler` for SIGTERM; the previous one, or None outside the main thread (no handler)."""
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # signals are the main thread's
        return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quieted = _quiet_libraries() if args.command == "run" and not args.verbose else []
    # NOTE: during a flow run Prefect swaps in its own SIGTERM handler (TerminationSignal: the flow run
    # is marked Crashed); when that unwinds it restores this one and sends SIGTERM again, which then
    # raises Terminated instead of killing the process where it stands.
    previous = _on_sigterm(_raise_terminated)
    logging.basicConfig(level=os.environ.get("LLMPIPE_LOG_LEVEL", "INFO"), format="%(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Prefect's client logs every request at INFO
    from llmpipe.errors import UserError

    try:
        if args.command == "run":
            return _run_flow(args)
        if args.command == "stage":
            return _run_stage(args)
        if args.command == "job":
            return _job(args)
        if args.command == "status":
            return _status(args)
        if args.command == "dryrun":
            return _dryrun(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "clean":
            return _clean(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "bench":
            return _bench_serve(args)
        if args.command in ("track", "promote", "runs"):
            return {"track": _track, "promote": _promote, "runs": _runs}[args.command](args)
        if args.command == "import-gguf":
            return _import_gguf(args)
        if args.command == "synth-chat":
            from llmpipe.chat import synth

            if args.arithmetic < 0 or (args.words or 0) < 0 or not 0 < args.val_fraction < 1:
                raise ConfigError("synth-chat: --arithmetic and --words take counts >= 0, --val-fraction a share "
                                  "between 0 and 1")
            problem = synth.count_problem(args.arithmetic, args.words)
            if problem:
                raise ConfigError(problem)
            counts = synth.write(args.out, args.seed, args.arithmetic, args.val_fraction, args.words)
            print(f"{args.out}: train.jsonl {counts['train']} conversations, val.jsonl {counts['val']} (held out)")
            return 0
        from llmpipe.tools import report

        print(f"report: {report.write(_recorded_config(args.run, args.artifacts_dir))}")
        return 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except UserError as err:  # a stage, the lock, the data, a model folder: one line
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Terminated:
        print("error: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except OSError as err:  # a full disk, a path that is a file: the path and the cause, no traceback
        cause = err.strerror or str(err)
        where = err.filename or _written_under(args)
        print(f"error: {where + ': ' if where else ''}{cause[:1].lower() + cause[1:]}", file=sys.stderr)
        return 1
    finally:
        for key in quieted:
            os.environ.pop(key, None)
        if previous is not None:
            _on_sigterm(previous)


def _import_gguf(args: argparse.Namespace) -> int:
    from llmpipe.models.gguf import import_gguf

    cfg = import_gguf(args.gguf, args.out)
    print(f"{args.out}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"vocab {cfg['vocab_size']}{', tied embeddings' if cfg['tie_word_embeddings'] else ''}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from llmpipe.tools.generate import run_generate

    run_generate(_run_dir(args), args.prompt, args.max_new_tokens, args.variant, args.temperature, args.top_k,
                 args.top_p, args.seed, args.threads, chat=args.chat, system=args.system,
                 allow_ungated=args.allow_ungated)
    return 0


def _registry_uri(args: argparse.Namespace) -> str:
    from llmpipe.config_checks import check_tracking
    from llmpipe.tracking.client import resolve_uri

    uri = getattr(args, "tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
    check_tracking(config_mod.MlflowSection(tracking_uri=uri))  # a scheme MLflow has no store for: one line
    return resolve_uri(uri, args.artifacts_dir)


def _run_dir(args: argparse.Namespace) -> Path:
    from llmpipe.tracking import registry

    if registry.is_models_uri(args.run):
        run_dir = registry.resolve(args.run, _registry_uri(args))
        _recorded_config(run_dir.name, str(run_dir.parent))  # it ran, and its name is a run name
        return run_dir
    run_dir = Path(args.run)
    if not run_dir.is_dir() or not (args.run.startswith((".", "/")) or os.sep in args.run):
        _recorded_config(args.run, args.artifacts_dir)  # a run name: checks the name and that it ran
        run_dir = Path(args.artifacts_dir) / args.run
    return run_dir


def _serve(args: argparse.Namespace) -> int:
    from llmpipe.tools.generate import MAX_THREADS
    from llmpipe.tools.serve import run_serve

    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise ConfigError(f"--threads {args.threads}: must be between 1 and {MAX_THREADS}")
    if (args.run is None) == (not args.latest_passing):
        raise ConfigError("serve: name a RUN or pass --latest-passing (one of the two)")
    if args.latest_passing:
        from llmpipe.tools.serve import latest_passing

        run_dir = latest_passing(Path(args.artifacts_dir), args.variant)
        logging.getLogger("llmpipe.serve").info("serve: --latest-passing picked %s", run_dir)
    else:
        run_dir = _run_dir(args)
    return run_serve(run_dir, run_dir.name, args.variant, args.host, args.port, args.max_batch, args.max_queue,
                     args.api_key_file, args.allow_ungated, args.threads, args.drain_timeout, args.body_timeout)


def _bench_serve(args: argparse.Namespace) -> int:
    from llmpipe.bench.serving import parse_levels
    from llmpipe.tools.serve.bench import bench_serve

    levels = parse_levels(args.concurrency)
    return bench_serve(_run_dir(args), args.url, args.variant, levels, args.rate, args.requests, args.prompt_tokens,
                       args.max_tokens, args.seed, args.api_key_file, args.json, args.allow_ungated)


def _tracked_config(args: argparse.Namespace) -> config_mod.RunConfig:
    """The run's recorded config, tracking on, at --tracking-uri when given."""
    from llmpipe.config_checks import check_tracking

    cfg = _recorded_config(args.run if hasattr(args, "run") else args.ref, args.artifacts_dir)
    section = cfg.tracking.mlflow
    section.enabled = True
    if args.tracking_uri:
        section.tracking_uri = args.tracking_uri
    check_tracking(section)
    return cfg


def _track(args: argparse.Namespace) -> int:
    from llmpipe import tracking

    cfg = _tracked_config(args)
    done = tracking.backfill(cfg)
    versions = ", ".join(f"{v['name']}/{v['version']}" for v in done["versions"].values()) or "none"
    print(f"track: {cfg.run.name} -> MLflow run {done['run_id']} in {done['uri']} (model versions: {versions})")
    return 0


def _promote(args: argparse.Namespace) -> int:
    from llmpipe.tracking import registry
    from llmpipe.tracking.folder import store_state

    ref = registry.parse_ref(args.ref)
    if ref is None:  # a run name: its current consolidated model's version, in its own store
        args.run = args.ref
        cfg = _tracked_config(args)
        name, version = registry.current_version(cfg)
        uri = store_state(cfg)[0]
    else:
        name, version = ref
        uri = _registry_uri(args)
    print(f"promote: {registry.promote(uri, name, version, args.alias, args.force, variant=args.variant)}")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from llmpipe.tracking import runs

    if not 0 < args.deadline_s <= 86400:
        raise ConfigError(f"--deadline-s {args.deadline_s:g}: must be in (0, 86400]")
    print(runs.table(runs.rows(_registry_uri(args), args.experiment, deadline_s=args.deadline_s)))
    return 0


def _written_under(args: argparse.Namespace) -> str | None:
    """The run folder a failed run/stage command writes under: a plain write() on a full disk raises an
    OSError that names no file, and the folder at least names the disk."""
    if args.command not in ("run", "stage"):
        return None
    try:
        return str(config_mod.load(args.config, _overrides(args), check="fields").run_dir())
    except (ConfigError, OSError):
        return None


if __name__ == "__main__":
    sys.exit(main())
