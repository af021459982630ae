"""The benchmark's PNG: per-call overhead and decode time per token, per contender.

Four panels of grouped bars on log scales: CPU time per call, wall time per call and GPU-only
time per call (overhead scenario; groups are the 1/16/64-kernel functions), and time per token
(decode scenario; groups are batch sizes). A run of the ``ddp`` and ``tp`` scenarios (under
torchrun) has their panels instead: time per training step and per decoded token. A contender
that failed in a group is marked "failed" where its bar would be. The title names the GPU and the torch version.

matplotlib is imported only here and only when plotting; without it the benchmark says so
and writes no PNG (``pip install 'graphtree[bench]'``).

Example::

    import json
    from graphtree.bench.plot import plot_results
    plot_results(json.load(open("bench.json")), "bench.png")
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PANELS: tuple[tuple[str, str, str, float, str], ...] = (
    ("overhead", "cpu_per_call", "CPU time per call (no sync)", 1e6, "us"),
    ("overhead", "wall_per_call", "wall time per call (synced)", 1e6, "us"),
    ("overhead", "gpu_time", "GPU-only time per call (CUDA events)", 1e6, "us"),
    ("decode", "time_per_token", "decode: time per token", 1e3, "ms"),
)
"""(scenario, metric, panel title, scale from seconds, unit) of each panel."""

RANK_PANELS: tuple[tuple[str, str, str, float, str], ...] = (
    ("ddp", "time_per_step", "ddp: time per training step (every rank)", 1e3, "ms"),
    ("tp", "time_per_token", "tp: time per decoded token (every rank)", 1e3, "ms"),
)
"""The panels of a run of the ``ddp`` and ``tp`` scenarios (under torchrun: they run alone)."""

_COLORS = {
    "eager": "#7f7f7f",
    "handwritten": "#1f77b4",
    "compile-reduce-overhead": "#ff7f0e",
    "compile-cudagraphs": "#2ca02c",
    "graphtree": "#d62728",
}
_SPARE = ("#9467bd", "#8c564b", "#e377c2", "#17becf")


def _color(name: str, j: int) -> str:
    return _COLORS.get(name, _SPARE[j % len(_SPARE)])


def title_for(meta: Mapping[str, Any]) -> str:
    """The figure title: GPU name, torch (and CUDA) version and date.

    Example::

        >>> title_for({"device": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0",
        ...            "date": "2025-01-02T03:04:05+00:00"})
        'graphtree bench - NVIDIA H100 - torch 2.11.0 (CUDA 13.0) - 2025-01-02'
    """
    cuda = f" (CUDA {meta['cuda']})" if meta.get("cuda") else ""
    date = str(meta.get("date", ""))[:10]
    return f"graphtree bench - {meta.get('device', '?')} - torch {meta.get('torch', '?')}{cuda}" + (
        f" - {date}" if date else ""
    )


def _minor_label(v: float, _: Any = None) -> str:
    """Label the 2x and 5x minor ticks of a log axis (so narrow ranges still get numbers)."""
    if v <= 0:
        return ""
    mantissa = round(v / 10 ** math.floor(math.log10(v)), 6)
    return f"{v:g}" if mantissa in (2.0, 5.0) else ""


def _ordered(values: Sequence[str]) -> list[str]:
    seen: dict[str, None] = {}
    for v in values:
        seen.setdefault(v, None)
    return list(seen)


def panel_data(
    doc: Mapping[str, Any], scenario: str, metric: str
) -> tuple[list[str], list[str], dict[tuple[str, str], float | None]]:
    """``(cases, contenders, values)`` of one panel; ``None`` marks a failed contender.

    Example::

        cases, names, values = panel_data(doc, "overhead", "wall_per_call")
    """
    rows = [r for r in doc["results"] if r["scenario"] == scenario]
    cases = _ordered([r["case"] for r in rows if r["metric"] == metric])
    names = list(doc.get("meta", {}).get("contenders") or _ordered([r["contender"] for r in rows]))
    values: dict[tuple[str, str], float | None] = {}
    for r in rows:
        if r["metric"] == metric and r["ok"] and r["value"] is not None:
            values[(r["case"], r["contender"])] = float(r["value"])
    failed_pairs = {(r["case"], r["contender"]) for r in rows if not r["ok"]}
    for case in cases:
        for name in names:
            if (case, name) in failed_pairs and (case, name) not in values:
                values[(case, name)] = None
    names = [n for n in names if any((c, n) in values for c in cases)]
    return cases, names, values


def plot_results(doc: Mapping[str, Any], path: str | Path) -> Path | None:
    """Write the PNG for a benchmark document; returns its path, or ``None`` without matplotlib.

    Example::

        plot_results(doc, "results/bench-.../bench.png")
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print(
            "graphtree bench: matplotlib is not installed, so no PNG was written (pip install 'graphtree[bench]')",
            file=sys.stderr,
        )
        return None

    path = Path(path)
    ranked = [p for p in RANK_PANELS if panel_data(doc, p[0], p[1])[0]]
    panels = PANELS if not ranked else tuple(ranked)
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(15, 4.75 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (scenario, metric, title, scale, unit) in zip(axes.flat, panels):
        cases, names, values = panel_data(doc, scenario, metric)
        ax.set_title(title)
        if not cases or not names:
            ax.text(
                0.5, 0.5, f"no {scenario} results", ha="center", va="center", transform=ax.transAxes, color="#888888"
            )
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        width = 0.8 / len(names)
        ok_values = [v * scale for v in values.values() if v]
        floor = min(ok_values) if ok_values else 1.0
        for j, name in enumerate(names):
            color = _color(name, j)
            xs, hs = [], []
            for i, case in enumerate(cases):
                x = i - 0.4 + width * (j + 0.5)
                v = values.get((case, name), "absent")
                if v is None:
                    ax.text(x, floor, "failed", rotation=90, ha="center", va="bottom", fontsize=7, color=color)
                elif v != "absent":
                    xs.append(x)
                    hs.append(float(v) * scale)
            if not hs:  # failed everywhere: a legend entry of its own colour, no bars
                ax.bar([0], [0], width=0, label=f"{name} (failed)", color=color)
                continue
            bars = ax.bar(xs, hs, width=width * 0.95, label=name, color=color)
            for bar, h in zip(bars, hs):
                ax.annotate(
                    f"{h:.3g}",
                    (bar.get_x() + bar.get_width() / 2, h),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases)
        ax.set_ylabel(unit + " (log scale)")
        if ok_values and min(ok_values) > 0:
            ax.set_yscale("log")
            ax.set_ylim(min(ok_values) / 2, max(ok_values) * 4)
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title_for(doc.get("meta", {})), fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
