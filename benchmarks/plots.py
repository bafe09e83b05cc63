"""Draw the benchmark figures of the documentation from `benchmarks/results/*.json`.

    python benchmarks/plots.py                # docs/images/*.png from the full results
    python benchmarks/plots.py --quick        # from the *_quick.json smoke-test results
    python benchmarks/plots.py --out /tmp/x   # somewhere else

Each figure is drawn from one results file written by a benchmark script (see
`report.py` for the schema: a `results` list with one entry per case, holding
`case`, `info`, `peak_rss_bytes`, `time_s`, ...). A missing file, or one without the
cases a figure needs, is reported and its figure skipped, so the script never fails
for want of results.

- `hessian_memory.png` (from `hessian_memory.json`): peak resident memory and wall
  time of a full Hessian against `nbatches`, for zodmem, zodiax and `jax.hessian`,
  with the process floor and "floor + one Hessian" for scale.
- `loops.png` (from `loops.json`): peak memory and time of each chunked map,
  microbatched gradient and nested stack against its chunk (or microbatch) size, with
  the unchunked JAX version and the process floor for scale.
- `budgets.png` (from `budgets.json`): the measured peak above the process floor of
  every case run with `max_memory`, against its budget, with the line y = x (a point
  under it kept its budget) and the plan's predicted peak beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

ROOT = report.ROOT
IMAGES_DIR = ROOT / "docs" / "images"
_GB = report.GB

# One colour and marker per tool, so a tool looks the same in every figure.
_STYLES = {
    "zodmem": {"color": "#00897b", "marker": "o"},
    "zodmem-compat": {"color": "#4db6ac", "marker": "s", "linestyle": "--"},
    "zodiax": {"color": "#e65100", "marker": "^"},
    "powerpax": {"color": "#6a1b9a", "marker": "v"},
    "jax": {"color": "#1565c0", "marker": "D"},
    "jax.lax": {"color": "#7cb342", "marker": "D"},
    "optax": {"color": "#c62828", "marker": "P"},
}
_FALLBACK_COLOURS = ["#455a64", "#8d6e63", "#afb42b", "#5c6bc0", "#ec407a"]


def _style(series: str, index: int) -> dict[str, Any]:
    for prefix in sorted(_STYLES, key=len, reverse=True):
        if series == prefix or series.startswith(prefix + ".") or series.startswith(prefix + "-"):
            return dict(_STYLES[prefix])
    return {"color": _FALLBACK_COLOURS[index % len(_FALLBACK_COLOURS)], "marker": "x"}


def _split_case(name: str) -> tuple[str, int | None]:
    """Tool and trailing number of a case name.

    `"zodmem-compat-16"` gives `("zodmem-compat", 16)`, `"jax.hessian"` gives
    `("jax.hessian", None)`.
    """
    match = re.fullmatch(r"(.+?)-(\d+)", name)
    if match:
        return match.group(1), int(match.group(2))
    return name, None


def _figure(ncols: int, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.6), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, list(axes[0])


def _save(fig: Any, path: Path, legend_rows: int = 0, layout: bool = True) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        # Leave room at the bottom for a figure-wide legend of `legend_rows` rows.
        bottom = 0.2 * legend_rows / fig.get_size_inches()[1] if legend_rows else 0
        fig.tight_layout(rect=(0, bottom, 1, 1))
    # No metadata, so that redrawing from the same results gives the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def _log2_axis(ax: Any, values: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()


def _reference_line(
    ax: Any, value: float, unit: str, others: list[float], label: str, style: dict
) -> None:
    """A horizontal line, or, when it would squash the other curves, a note at the top."""
    line = {"color": style["color"], "linestyle": ":", "linewidth": 1.5}
    if others and value > 2.5 * max(others):
        top = 1.4 * max(others)
        ax.set_ylim(top=top)
        ax.annotate(
            f"{label}: {value:.2f} {unit}, off the scale \u2191",
            xy=(0.5, 0.97),
            xycoords="axes fraction",
            ha="center",
            va="top",
            fontsize=8,
            color=style["color"],
        )
        ax.plot([], [], label=label, **line)
    else:
        ax.axhline(value, label=label, **line)


def plot_hessian_memory(results_dir: Path, out_dir: Path, suffix: str) -> bool:
    results = report.read_results(results_dir / f"hessian_memory{suffix}.json")
    if results is None:
        return False
    series: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    unbatched: dict[str, dict[str, Any]] = {}
    floor = None
    for r in results:
        tool, nbatches = _split_case(r["case"])
        nbatches = r.get("info", {}).get("nbatches", nbatches)
        if tool == "floor":
            floor = r
        elif nbatches is None:
            unbatched[tool] = r
        elif "time_s" in r:
            series[tool].append((int(nbatches), r))
    if not series:
        print("skip hessian_memory.png: no case has an nbatches", file=sys.stderr)
        return False

    info = results[0].get("info", {})
    title = "Full Hessian"
    if "n" in info:
        title += f" of an MLP loss, n = {info['n']:,} parameters"
    if "hessian_bytes" in info:
        title += f" (H = {info['hessian_bytes'] / 1e6:,.0f} MB)"
    fig, (memory_ax, time_ax) = _figure(2, title)
    all_nbatches = [nb for points in series.values() for nb, _ in points]

    for index, (tool, points) in enumerate(sorted(series.items())):
        points.sort(key=lambda p: p[0])
        xs = [nb for nb, _ in points]
        style = _style(tool, index)
        memory_ax.plot(xs, [r["peak_rss_bytes"] / _GB for _, r in points], label=tool, **style)
        time_ax.plot(xs, [r["time_s"] for _, r in points], label=tool, **style)

    batched_peaks = [r["peak_rss_bytes"] / _GB for points in series.values() for _, r in points]
    batched_times = [r["time_s"] for points in series.values() for _, r in points]
    for index, (tool, r) in enumerate(sorted(unbatched.items())):
        style = _style(tool, index)
        label = f"{tool} (all at once)"
        _reference_line(memory_ax, r["peak_rss_bytes"] / _GB, "GB", batched_peaks, label, style)
        if "time_s" in r:
            _reference_line(time_ax, r["time_s"], "s", batched_times, label, style)

    if floor is not None:
        floor_gb = floor["peak_rss_bytes"] / _GB
        memory_ax.axhline(floor_gb, color="0.55", linewidth=1, label="process floor")
        if "hessian_bytes" in info:
            memory_ax.axhline(
                floor_gb + info["hessian_bytes"] / _GB,
                color="0.3",
                linewidth=1,
                linestyle="--",
                label="floor + one Hessian",
            )

    memory_ax.set_ylabel("peak resident memory (GB)")
    memory_ax.set_ylim(bottom=0)
    time_ax.set_ylabel("wall time, compilation included (s)")
    time_ax.set_ylim(bottom=0)
    for ax in (memory_ax, time_ax):
        _log2_axis(ax, all_nbatches)
        ax.set_xlabel("nbatches (blocks of rows)")
        ax.grid(True, alpha=0.3)
    handles, labels = memory_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    _save(fig, out_dir / "hessian_memory.png", legend_rows=-(-len(labels) // 4))
    return True


def _chunk_of(r: dict[str, Any]) -> int | None:
    info = r.get("info", {})
    for key in ("chunk_size", "batch_size", "microbatch_size"):
        if isinstance(info.get(key), int):
            return info[key]
    return _split_case(r["case"])[1]


def _group_of(r: dict[str, Any]) -> str:
    info = r.get("info", {})
    for key in ("problem", "group", "workload"):
        if isinstance(info.get(key), str):
            return info[key]
    return ""


def _series_of(r: dict[str, Any]) -> str:
    info = r.get("info", {})
    for key in ("tool", "method", "implementation"):
        if isinstance(info.get(key), str):
            return info[key]
    tool, _ = _split_case(r["case"])
    group = _group_of(r)
    # Case names such as "vmap/zodmem-8" carry their group as a prefix.
    if group and tool.startswith(group + "/"):
        tool = tool[len(group) + 1 :]
    return tool


def _seconds(r: dict[str, Any]) -> float | None:
    """A compiled call's time when the case repeated its call, else the first call's."""
    for key in ("steady_median_s", "time_s"):
        if isinstance(r.get(key), (int, float)):
            return float(r[key])
    return None


_SIZE_NAMES = {"chunk_size": "chunk size", "microbatch_size": "microbatch size"}


def plot_loops(results_dir: Path, out_dir: Path, suffix: str) -> bool:
    results = report.read_results(results_dir / f"loops{suffix}.json")
    if results is None:
        return False
    # group -> tool -> [(chunk, result)]; tools without a chunk are drawn as references.
    groups: dict[str, dict[str, list[tuple[int, dict]]]] = defaultdict(lambda: defaultdict(list))
    references: dict[str, dict[str, dict]] = defaultdict(dict)
    size_names: dict[str, str] = {}
    steady = any("steady_median_s" in r for r in results)
    for r in results:
        group, tool, chunk = _group_of(r), _series_of(r), _chunk_of(r)
        if chunk is None:
            references[group][tool] = r
        elif _seconds(r) is not None:
            groups[group][tool].append((chunk, r))
            size_key = next((k for k in _SIZE_NAMES if k in r.get("info", {})), "chunk_size")
            size_names[group] = _SIZE_NAMES[size_key]
    if not groups:
        print("skip loops.png: no case has a chunk size", file=sys.stderr)
        return False

    names = sorted(groups)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One row per problem (memory, then time), so the figure stays legible at the
    # width of a documentation page however many problems there are.
    fig = plt.figure(layout="constrained", figsize=(9.0, 3.7 * len(names)))
    rows = fig.subfigures(len(names), 1, squeeze=False)[:, 0]
    time_label = "time of a compiled call (s)" if steady else "wall time, compilation included (s)"
    for row, group in zip(rows, names, strict=True):
        memory_ax, time_ax = row.subplots(1, 2)
        floor = references[group].pop("floor", {}).get("peak_rss_bytes", 0)
        all_peaks = [
            r["peak_rss_bytes"] - floor
            for r in [r for pts in groups[group].values() for _, r in pts]
            + list(references[group].values())
            if "peak_rss_bytes" in r
        ]
        # Memory above the process floor: what the computation itself needed.
        unit, scale = ("GB", _GB) if max(all_peaks, default=0) >= 1e9 else ("MB", 1e6)
        chunks = []
        for index, (tool, points) in enumerate(sorted(groups[group].items())):
            points.sort(key=lambda p: p[0])
            xs = [c for c, _ in points]
            chunks += xs
            style = _style(tool, index)
            peaks = [(r.get("peak_rss_bytes", float("nan")) - floor) / scale for _, r in points]
            memory_ax.plot(xs, peaks, label=tool, **style)
            time_ax.plot(xs, [_seconds(r) for _, r in points], label=tool, **style)
        points = [r for pts in groups[group].values() for _, r in pts]
        peaks = [(r.get("peak_rss_bytes", floor) - floor) / scale for r in points]
        seconds = [_seconds(r) or 0.0 for r in points]
        for index, (tool, r) in enumerate(sorted(references[group].items())):
            style = _style(tool, len(groups[group]) + index)
            label = f"{tool} (all at once)"
            if "peak_rss_bytes" in r:
                value = (r["peak_rss_bytes"] - floor) / scale
                _reference_line(memory_ax, value, unit, peaks, label, style)
            if _seconds(r) is not None:
                _reference_line(time_ax, _seconds(r), "s", seconds, label, style)
        if group:
            row.suptitle(group, fontsize=11)
        above = " above the floor" if floor else ""
        memory_ax.set_ylabel(f"peak memory{above} ({unit})")
        time_ax.set_ylabel(time_label)
        for ax in (memory_ax, time_ax):
            _log2_axis(ax, chunks)
            ax.set_xlabel(size_names.get(group, "chunk size"))
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        # Each row's legend goes under it, clear of the curves.
        handles, labels = memory_ax.get_legend_handles_labels()
        row.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    _save(fig, out_dir / "loops.png", layout=False)
    return True


# The budgets figure's groups: the microbatch's and the sharded Hessian's calls hold a few
# kB, far off this scale (their figures are in the budgets tables).
_BUDGET_GROUPS = {
    "hessian": ("BatchedHessian", "zodmem"),
    "small": ("BatchedHessian (small)", "zodmem-compat"),
    "map": ("ChunkedVmap", "powerpax"),
}


def plot_budgets(results_dir: Path, out_dir: Path, suffix: str) -> bool:
    results = report.read_results(results_dir / f"budgets{suffix}.json")
    if results is None:
        return False
    floors = {
        _group_of(r): r["peak_rss_bytes"] for r in results if r["info"].get("tool") == "floor"
    }
    # group -> [(budget, measured above the floor, predicted, label)]
    points: dict[str, list[tuple[float, float, float, str]]] = defaultdict(list)
    for r in results:
        info = r.get("info", {})
        group = _group_of(r)
        if info.get("tool") != "budget" or "budget_bytes" not in info or group not in floors:
            continue
        if group not in _BUDGET_GROUPS:
            continue
        label = r["case"].rsplit("budget-", 1)[-1]
        if label == "auto":
            label = f"auto ({info['budget_bytes'] / _GB:.1f}GB)"
        above = r["peak_rss_bytes"] - floors[group]
        points[group].append((info["budget_bytes"], above, info["predicted_peak_bytes"], label))
    if not points:
        print("skip budgets.png: no case has a budget and a floor", file=sys.stderr)
        return False

    fig, (scale_ax, ratio_ax) = _figure(
        2, "Memory budgets: peak memory above the process floor against max_memory"
    )
    everything = [v for pts in points.values() for p in pts for v in p[:3]]
    low, high = 0.7 * min(everything) / 1e6, 1.4 * max(everything) / 1e6
    scale_ax.plot([low, high], [low, high], color="0.3", linewidth=1, linestyle="--")
    ratio_ax.axhline(1.0, color="0.3", linewidth=1, linestyle="--")
    labels = []
    for index, (group, pts) in enumerate(sorted(points.items())):
        pts.sort()
        style = _style(_BUDGET_GROUPS[group][1], index)
        marker = {"color": style["color"], "marker": style["marker"]}
        hollow = {"facecolors": "none", "edgecolors": style["color"], "marker": style["marker"]}
        name = _BUDGET_GROUPS[group][0]
        budgets = [b / 1e6 for b, _, _, _ in pts]
        scale_ax.scatter(budgets, [m / 1e6 for _, m, _, _ in pts], s=42, zorder=3, **marker)
        scale_ax.scatter(budgets, [p / 1e6 for _, _, p, _ in pts], s=42, zorder=3, **hollow)
        for budget, measured, _, label in pts:
            scale_ax.annotate(
                label,
                xy=(budget / 1e6, measured / 1e6),
                xytext=(7, -4),
                textcoords="offset points",
                fontsize=7,
                color=style["color"],
            )
        # The same cases side by side, as a share of their budget: the misses show.
        xs = list(range(len(labels), len(labels) + len(pts)))
        labels += [label for _, _, _, label in pts]
        ratio_ax.scatter(
            xs, [m / b for b, m, _, _ in pts], s=42, zorder=3, label=f"{name}: measured", **marker
        )
        ratio_ax.scatter(
            xs,
            [p / b for b, _, p, _ in pts],
            s=42,
            zorder=3,
            label=f"{name}: predicted by plan()",
            **hollow,
        )
    scale_ax.annotate(
        "y = x (the budget)",
        xy=(0.97, 0.04),
        xycoords="axes fraction",
        ha="right",
        fontsize=8,
        color="0.3",
    )
    scale_ax.set_xscale("log")
    scale_ax.set_yscale("log")
    scale_ax.set_xlim(low, high)
    scale_ax.set_ylim(low, high)
    scale_ax.set_xlabel("max_memory (MB)")
    scale_ax.set_ylabel("peak resident memory above the floor (MB)")
    ratio_ax.set_xticks(range(len(labels)))
    ratio_ax.set_xticklabels(labels, rotation=30, fontsize=8)
    ratio_ax.set_xlabel("max_memory of each case")
    ratio_ax.set_ylabel("peak above the floor / max_memory")
    ratio_ax.set_ylim(0, max(1.2, ratio_ax.get_ylim()[1]))
    for ax in (scale_ax, ratio_ax):
        ax.grid(True, which="both", alpha=0.3)
    handles, legend = ratio_ax.get_legend_handles_labels()
    fig.legend(handles, legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    _save(fig, out_dir / "budgets.png", legend_rows=2)
    return True


PLOTS: dict[str, Callable[[Path, Path, str], bool]] = {
    "hessian_memory": plot_hessian_memory,
    "loops": plot_loops,
    "budgets": plot_budgets,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=report.RESULTS_DIR, help="results folder")
    parser.add_argument("--out", type=Path, default=IMAGES_DIR, help="where the PNGs go")
    parser.add_argument(
        "--quick", action="store_true", help="plot the *_quick.json smoke-test results"
    )
    args = parser.parse_args(argv)
    suffix = "_quick" if args.quick else ""
    drawn = [name for name, plot in PLOTS.items() if plot(args.results, args.out, suffix)]
    print(f"{len(drawn)} of {len(PLOTS)} figures drawn", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
