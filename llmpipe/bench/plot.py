"""latency.png: grouped bars of p50 latency, one group per shape, one bar per provider/variant."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# NOTE: Figure + FigureCanvasAgg instead of pyplot: no global backend or figure state, so this is
# safe in worker threads (Prefect) and on machines without a display.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _series(results: dict) -> list[tuple[str, str]]:
    """(provider, variant) pairs with at least one measured row, in row order."""
    seen: dict[tuple[str, str], None] = {}
    for r in results["rows"]:
        if r["latency_ms"]:
            seen.setdefault((r["provider"], r["variant"]))
    return list(seen)


def latency_plot(results: dict, path: Path) -> Path:
    """Write a PNG bar chart of p50 latency (ms) per variant, grouped by (batch x seq) shape."""
    shapes = [tuple(s) for s in results["shapes"]]
    series = _series(results)
    p50 = {(r["batch"], r["seq"], r["provider"], r["variant"]): r["latency_ms"]["p50"]
           for r in results["rows"] if r["latency_ms"]}
    one_provider = len({p for p, _ in series}) <= 1

    fig = Figure(figsize=(max(6.0, 1.2 + 0.45 * len(shapes) * max(len(series), 1)), 4.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = np.arange(len(shapes))
    width = 0.8 / max(len(series), 1)
    for i, (provider, variant) in enumerate(series):
        values = [p50.get((b, s, provider, variant), np.nan) for b, s in shapes]
        name = "torch eager" if variant == "torch" else f"ORT {variant}"
        label = name if one_provider else f"{provider} {name}"
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(x, [f"{b}x{s}" for b, s in shapes])
    ax.set_xlabel("batch x seq")
    ax.set_ylabel("p50 latency (ms)")
    ax.set_title(f"Prefill latency, {results.get('threads', '?')} threads (lower is better)")
    ax.grid(axis="y", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no successful measurements", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    return Path(path)


def _lines(rows: list[dict], x: str, y: str, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """One line per provider/variant of y against x (measured rows only)."""
    fig = Figure(figsize=(6.4, 4.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in rows:
        if not r.get("error") and r.get(y) is not None:
            series.setdefault((r["provider"], r["variant"]), []).append((r[x], r[y]))
    one_provider = len({p for p, _ in series}) <= 1
    for (provider, variant), points in series.items():
        points.sort()
        name = "torch eager" if variant == "torch" else variant if variant == "om" else f"ORT {variant}"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=name if one_provider else f"{provider} {name}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
        xs = sorted({p[0] for pts in series.values() for p in pts})
        ax.set_xticks(xs)
    else:
        ax.text(0.5, 0.5, "no successful measurements", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    return Path(path)


def ttft_plot(llm: dict, path: Path) -> Path:
    """Time to first token (ms) against prompt length, batch 1."""
    return _lines(llm["prefill"], "prompt_len", "ttft_ms", path, "prompt tokens", "time to first token (ms)",
                  "Time to first token, batch 1 (lower is better)")


def tpot_plot(llm: dict, path: Path) -> Path:
    """Time per output token (ms) against batch size."""
    return _lines(llm["decode"], "batch", "tpot_ms", path, "batch", "time per output token (ms)",
                  "Time per output token, first token excluded (lower is better)")


def serving_plot(serving: dict, path: Path) -> Path:
    """The short serving run: output tokens/s and TTFT p50 / p99 against concurrency."""
    rows = serving["rows"]
    fig = Figure(figsize=(9.6, 3.8), dpi=110)
    FigureCanvasAgg(fig)
    xs = [r["concurrency"] for r in rows]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.plot(xs, [r["output_tokens_per_s"] for r in rows], marker="o")
    left.set_ylabel("output tokens/s")
    left.set_title(f"Throughput, {serving['model']} (higher is better)", fontsize=9)
    for q in ("p50", "p99"):
        right.plot(xs, [r["ttft_ms"][q] for r in rows], marker="o", label=f"TTFT {q}")
    right.set_ylabel("time to first token (ms)")
    right.set_title("Latency (lower is better)", fontsize=9)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xlabel("concurrent clients")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    return Path(path)
