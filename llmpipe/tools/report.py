"""The run report: artifacts/<run>/report.html, one self-contained page about a run.

Stage table (state, duration, fingerprint, outputs linked), the loss curve, training throughput,
the benchmark table and the evaluation's task x variant table. Written after every flow run, also when a stage failed.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import logging
from pathlib import Path
from typing import Any

from llmpipe.config import STAGES, RunConfig
from llmpipe.manifest import Manifest
from llmpipe.stages import fingerprints, stage_dir, state

REPORT = "report.html"


def stage_rows(cfg: RunConfig) -> list[dict[str, Any]]:
    """One row per stage: state against the current config and the files on disk (sha256 through
    the digest cache, so a same-size corruption shows as "corrupt"), status, duration, fingerprint."""
    fps = fingerprints(cfg)
    rows = []
    for name in STAGES:
        st, manifest = state(cfg, name, fps[name], full=True)
        rows.append({"stage": name, "state": st, "status": manifest.status if manifest else "-",
                     "reason": (manifest.reason or "") if manifest else "",
                     "duration_s": manifest.duration_s if manifest else None,
                     "fingerprint": manifest.fingerprint[:12] if manifest else "-",
                     "finished_at": manifest.finished_at if manifest else "",
                     "outputs": sorted(manifest.outputs) if manifest else []})
    return rows


def _loss_png(metrics_path: Path) -> str | None:
    """The loss curve as a base64 PNG, or None without metrics."""
    if not metrics_path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmpipe.train.metrics import read

    recs = read(metrics_path)  # a torn last line (a killed or out-of-space run) is skipped
    train = [(r["step"], r["loss"]) for r in recs if _number(r.get("loss"))]
    val = [(r["step"], r["val_loss"]) for r in recs if _number(r.get("val_loss"))]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>none</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape("" if v is None else str(v))


def _stage_section(cfg: RunConfig) -> str:
    rows = stage_rows(cfg)
    run_dir = cfg.run_dir()
    for r in rows:
        folder = stage_dir(run_dir, r["stage"])
        names = r.pop("outputs")[:8]
        entries = Manifest.read(folder).outputs if names else {}  # read once per stage
        r["outputs"] = [f'<a href="{html.escape(folder.name)}/{html.escape(entries[o]["path"])}">'
                        f"{html.escape(o)}</a>" for o in names]
    cols = ["stage", "state", "status", "reason", "duration_s", "fingerprint", "finished_at"]
    body = "".join("<tr>" + "".join(f"<td>{_cell(r[c])}</td>" for c in cols)
                   + f"<td>{' '.join(r['outputs'])}</td></tr>" for r in rows)
    head = "".join(f"<th>{c}</th>" for c in [*cols, "outputs"])
    return f"<h2>Stages</h2><table><tr>{head}</tr>{body}</table>"


def _train_section(run_dir: Path) -> str:
    folder = stage_dir(run_dir, "train")
    m = Manifest.read(folder)
    if m is None:
        return ""
    keys = ("steps", "world_size", "global_batch", "val_loss_start", "val_loss", "val_ppl", "tokens_per_s",
            "wall_s", "params")
    summary = {k: m.metrics.get(k) for k in keys}
    png = _loss_png(folder / "metrics.jsonl")
    img = f'<img alt="loss curve" src="data:image/png;base64,{png}">' if png else ""
    return f"<h2>Training</h2>{_table([summary])}{img}"


def _bench_section(run_dir: Path) -> str:
    folder = stage_dir(run_dir, "benchmark")
    if Manifest.read(folder) is None:
        return ""
    from llmpipe.bench.run import load_results, table_rows

    results = load_results(folder)
    notes = results.get("notes", [])
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    parts = [f'<h2>Benchmark: prefill throughput</h2>{_table(table_rows(results))}<ul>{notes_html}</ul>'
             f'<img alt="latency" src="{folder.name}/latency.png">']
    if results.get("llm"):
        parts.append(_llm_section(results["llm"], folder.name))
    if results.get("quality"):
        parts.append(_quality_section(results["quality"]))
    if results.get("serving"):
        parts.append(_serving_section(results["serving"], folder.name))
    return "".join(parts)


def _serving_section(serving: dict[str, Any], folder: str) -> str:
    """benchmark.serving: throughput and latency against concurrency, with the definitions."""
    from llmpipe.bench.serving import DEFINITIONS

    rows = [{"concurrency": r["concurrency"], "requests": r["requests"], "errors": r["errors"],
             "requests_per_s": r["requests_per_s"], "output_tokens_per_s": r["output_tokens_per_s"],
             **{f"ttft_{q}_ms": r["ttft_ms"][q] for q in ("p50", "p90", "p99")},
             **{f"tpot_{q}_ms": r["tpot_ms"][q] for q in ("p50", "p99")}} for r in serving["rows"]]
    return (f"<h2>Serving: {html.escape(serving['model'])} under load</h2><p>{serving['requests']} requests of "
            f"{serving['prompt_tokens']} prompt tokens, up to {serving['max_tokens']} new tokens each, streamed from "
            f"a real <code>llmpipe serve</code> on a loopback port.</p>{_table(rows)}"
            f"<img alt='serving' src='{folder}/serving.png'><p>{html.escape(DEFINITIONS)}</p>")


_LLM_COLS = {"prefill": ("provider", "variant", "prompt_len", "prefill_ms", "ttft_ms", "ttft_ratio", "error"),
             "decode": ("provider", "variant", "batch", "tpot_ms", "decode_tokens_per_s", "decode_speedup",
                        "e2e_tokens_per_s", "ttft_ms", "error")}


def _llm_section(llm: dict[str, Any], folder: str) -> str:
    """Generation: TTFT and TPOT tables and plots, the definitions, one sample per engine."""
    tables = {k: _table([{c: r.get(c) for c in cols} for r in llm[k]]) for k, cols in _LLM_COLS.items()}
    defs = "".join(f"<li>{html.escape(d)}</li>" for d in llm.get("definitions", []))
    chat = " (chat: the conversation as the template renders it, then the answer)"
    samples = "".join(f"<h4>{html.escape(name)}{chat if s.get('chat') else ''}</h4><pre>{html.escape(s['prompt'])}"
                      f"<b>{html.escape(s['text'])}</b></pre>" for name, s in llm.get("samples", {}).items())
    return (f"<h2>Benchmark: generation (cache of {llm.get('cache_len')} tokens)</h2>"
            f"<h3>Time to first token</h3>{tables['prefill']}<img alt='TTFT' src='{folder}/ttft.png'>"
            f"<h3>Decoding</h3>{tables['decode']}<img alt='TPOT' src='{folder}/tpot.png'>"
            f"<ul>{defs}</ul><h3>Generated samples (greedy; the prompt, then <b>the model's text</b>)</h3>{samples}")


def _quality_section(q: dict[str, Any]) -> str:
    """Quality per variant with its verdict, and the parity chain."""
    rows = [{"variant": name, "perplexity": v["ppl"], "ppl_increase": v["ppl_increase"], "kl": v["kl"],
             "top1": v["top1"], "greedy_agreement": v.get("continuation", {}).get("token_agreement"),
             "verdict": v.get("verdict"), "why": v.get("rejected_because")} for name, v in q["variants"].items()]
    chain = [{k: r.get(k) for k in ("name", "ppl", "max_abs_diff", "kl", "top1", "prev", "prev_kl", "moved",
                                    "reason")} for r in q["chain"]]
    return (f"<h2>Quality on validation text</h2><p>{q['samples']} validation sequences of {q['seq_len']} tokens, "
            f"against torch fp32.</p>{_table(rows)}<h3>Parity chain</h3>{_table(chain)}")


def _eval_section(run_dir: Path) -> str:
    folder = stage_dir(run_dir, "evaluate")
    manifest = Manifest.read(folder)
    if manifest is None or manifest.status != "completed":
        return ""
    from llmpipe.eval.stage import PLOT_FILE, load_results, table_rows

    results = load_results(folder)
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in results.get("notes", []))
    return (f"<h2>Evaluation (lm-evaluation-harness)</h2><p>Reference: {html.escape(results['reference'])}; "
            f"cells: score ± stderr (delta against the reference).</p>{_table(table_rows(results))}"
            f"<ul>{notes}</ul><img alt='evaluation' src='{folder.name}/{PLOT_FILE}'>")


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;font-size:90%}th{background:#eee}")


def markdown(cfg: RunConfig) -> str:
    """The report's stage table and benchmark table as markdown (for a Prefect artifact)."""
    run_dir = cfg.run_dir()
    lines = [f"# llmpipe run `{cfg.run.name}`", "", f"Full report: `{run_dir / REPORT}`", "",
             "| stage | state | status | duration s | fingerprint | reason |", "|---|---|---|--:|---|---|"]
    for r in stage_rows(cfg):
        dur = f"{r['duration_s']:.1f}" if r["duration_s"] is not None else "-"
        lines.append(f"| {r['stage']} | {r['state']} | {r['status']} | {dur} | `{r['fingerprint']}` | {r['reason']} |")
    train = Manifest.read(stage_dir(run_dir, "train"))
    if train is not None:
        m = train.metrics
        lines += ["", f"Training: val loss {m.get('val_loss_start', float('nan')):.3f} -> "
                      f"{m.get('val_loss', float('nan')):.3f}, {m.get('tokens_per_s', 0):.0f} tokens/s, "
                      f"{m.get('steps')} steps on {m.get('world_size')} rank(s)"]
    bench = stage_dir(run_dir, "benchmark")
    if Manifest.read(bench) is not None:
        from llmpipe.bench.run import load_results, markdown_table

        results = load_results(bench)
        lines += ["", "## Benchmark", "", markdown_table(results)]
        if results.get("llm"):
            from llmpipe.bench.llm import markdown as llm_markdown

            lines += ["## Generation", "", llm_markdown(results["llm"])]
        if results.get("quality"):
            lines += ["## Parity chain", "", results["quality"]["chain_markdown"]]
    evaluation = stage_dir(run_dir, "evaluate")
    manifest = Manifest.read(evaluation)
    if manifest is not None and manifest.status == "completed":
        lines += ["", "## Evaluation", "", (evaluation / "results.md").read_text(encoding="utf-8")
                  .split("\n", 2)[-1].strip()]
    return "\n".join(lines) + "\n"


log = logging.getLogger("llmpipe.report")


def write(cfg: RunConfig) -> Path:
    """Write report.html into the run folder; returns its path.

    A report that cannot be written (a full disk, a read-only folder) is a warning, never an error: the
    flow writes it in a `finally`, where an exception would hide the stage's own error."""
    run_dir = cfg.run_dir()
    path = run_dir / REPORT
    if not run_dir.is_dir():
        return path  # nothing ran yet: no folder is created just for a report
    tmp = path.with_name(f".{REPORT}.tmp")
    try:
        tmp.write_text(_page(cfg, run_dir), encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        with contextlib.suppress(OSError):  # no half-written page left behind (where it can go)
            tmp.unlink(missing_ok=True)
        log.warning("warning: report not written: %s: %s", err.filename or path, err.strerror or err)
    return path


def _page(cfg: RunConfig, run_dir: Path) -> str:
    parts = [f"<h1>llmpipe run {html.escape(cfg.run.name)}</h1>", _stage_section(cfg),
             _train_section(run_dir), _bench_section(run_dir), _eval_section(run_dir),
             f"<h2>Config</h2><pre>{html.escape(json.dumps(cfg.to_dict(), indent=2))}</pre>"]
    return f"<!doctype html><html><head><meta charset='utf-8'><title>llmpipe {html.escape(cfg.run.name)}" \
           f"</title><style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n"
