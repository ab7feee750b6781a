"""The report's plotly figures, one builder per chart, from frames of ``analysis._report_data``.

Every trace-derived string that plotly renders (hover text, tick labels, titles) goes through
``esc``: plotly draws its pseudo-HTML (``<b>``, ``<br>``) itself and decodes ``&lt;``/``&gt;``/
``&amp;``, so an op named ``<script>`` shows literally and never becomes markup.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
import polars as pl

if TYPE_CHECKING:
    from prism_trace.analysis.report.data import LaneGroup

__all__ = [
    "CATEGORY_COLORS",
    "bytes_text",
    "esc",
    "host_ops_figure",
    "iteration_figure",
    "kernels_figure",
    "memory_figure",
    "ms_text",
    "temporal_figure",
    "time_unit",
    "timeline_figure",
    "wait_heatmap",
]

CATEGORY_COLORS: dict[str, str] = {
    "cpu_op": "#4c78a8",
    "user_annotation": "#9ecae9",
    "python_function": "#b7b7b7",
    "cuda_runtime": "#f58518",
    "cuda_driver": "#ffbf79",
    "kernel": "#54a24b",
    "comm kernel": "#d62728",
    "memcpy": "#e7ba52",
    "memset": "#f2d98a",
    "gpu_user_annotation": "#88d27a",
    "cuda_sync": "#b279a2",
    "compute": "#54a24b",
    "comm": "#d62728",
    "instant": "#000000",
    "other": "#bab0ac",
}
"""Colour of each ``event.category`` in the timeline: computation greens, communication red
(NCCL kernels are ``comm kernel``, op-timeline communication ``comm``), memory copies yellow."""

PART_COLORS = {
    "compute": "#54a24b",
    "comm": "#d62728",
    "memory": "#f58518",
    "other": "#bab0ac",
    "idle": "#e8e8e8",
}

_LANE_PX = 22
_NAME_CHARS = 70


def ms_text(ns: float | None) -> str:
    """A duration in ms with 3 significant digits (``12.3 ms``, ``0.00412 ms``), whole ms from
    1000 ms on (``2346 ms``, never ``2.35e+03``); ``-`` if none."""
    if ns is None:
        return "-"
    ms = ns / 1e6
    return f"{ms:.0f} ms" if abs(ms) >= 1000 else f"{ms:.3g} ms"


def bytes_text(n: float) -> str:
    """Bytes with 3 significant digits in a unit that reads well: ``820 KiB``, ``4.79 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def esc(value: object, *, limit: int | None = None) -> str:
    """``value`` as text safe for plotly's pseudo-HTML, optionally cut to ``limit`` characters."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return html.escape(text, quote=False)


def time_unit(span_ns: float) -> tuple[float, str]:
    """Divisor and name of the time unit for an axis spanning ``span_ns``: seconds above 10 s,
    else milliseconds (an axis never reads "0.5M ms")."""
    return (1e9, "s") if span_ns > 10e9 else (1e6, "ms")


def _layout(fig: go.Figure, title: str, *, height: int = 420, **kw: Any) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01},
        height=height,
        margin={"l": 10, "r": 10, "t": 50, "b": 40},
        template="plotly_white",
        **kw,
    )
    fig.update_yaxes(automargin=True)
    fig.update_xaxes(automargin=True)
    return fig


def timeline_figure(
    groups: list[LaneGroup], tracks: pl.DataFrame, events: pl.DataFrame, t0: int
) -> go.Figure:
    """Gantt timeline: a lane per thread/stream of each group, a bar per event, nested narrower.

    A dropdown shows all groups or one (the drill-down); the x axis is ms since ``t0``.
    """
    lane_of: dict[tuple[int, int], int] = {}
    ticks: list[str] = []
    spans: list[tuple[int, int]] = []
    by_rank = tracks.partition_by("rank", as_dict=True) if tracks.height else {}
    for g in groups:
        first = len(ticks)
        part = by_rank.get((g.rank,))
        if part is not None:
            for row in part.iter_rows(named=True):
                lane_of[(g.rank, row["track_id"])] = len(ticks)
                ticks.append(f"{g.short} · {esc(row['name'], limit=40)}")
        spans.append((first, len(ticks) - 1))
    fig = go.Figure()
    trace_group: list[int] = []
    seen: set[str] = set()
    span = float((events["ts"] + events["dur"]).max() - t0) if events.height else 0.0  # type: ignore[operator]
    div, unit = time_unit(span)
    ev_by_rank = events.partition_by("rank", as_dict=True) if events.height else {}
    for gi, g in enumerate(groups):
        ev = ev_by_rank.get((g.rank,))
        if ev is None:
            continue
        lanes = np.array(
            [lane_of.get((g.rank, t), -1) for t in ev["track_id"].to_list()], dtype=np.int32
        )
        ev = ev.with_columns(pl.Series("lane", lanes)).filter(pl.col("lane") >= 0)
        for cat_key, part in ev.partition_by("category", as_dict=True).items():
            cat = str(cat_key[0])
            # in time order, parents before the children that start with them: drawn the same,
            # and the starts pack small (packed._delta_bases)
            part = part.sort("ts", "depth")
            # Whole µs as short decimal text, and no per-bar duration text: the bars are most of
            # a report's bytes, and such text gzips to a fraction of binary floats (docs/report.md,
            # "Size")
            digits = 3 if unit == "ms" else 6
            start = np.round((part["ts"].to_numpy() - t0) / div, digits).tolist()
            dur = np.round(part["dur"].to_numpy() / div, digits).tolist()
            depth = np.minimum(part["depth"].to_numpy(), 5)
            names = [esc(n, limit=_NAME_CHARS) for n in part["name"].to_list()]
            iters = ["-" if i is None else str(i) for i in part["iteration"].to_list()]
            fig.add_trace(
                go.Bar(
                    orientation="h",
                    y=part["lane"].to_numpy(),
                    base=start,
                    x=dur,
                    width=np.round(0.84 - 0.13 * depth, 2).tolist(),
                    name=esc(cat),
                    legendgroup=cat,
                    showlegend=cat not in seen,
                    marker={
                        "color": CATEGORY_COLORS.get(cat, "#7f7f7f"),
                        "line": {"width": 0.3, "color": "rgba(0,0,0,0.35)"},
                    },
                    customdata=np.column_stack([names, iters]),
                    hovertemplate=(
                        "<b>%{customdata[0]}</b><br>"
                        f"{esc(cat)} · {esc(g.label, limit=60)}<br>"
                        f"start %{{base:.4g}} {unit} · dur %{{x:.3g}} {unit}<br>"
                        "iteration %{customdata[1]}<extra></extra>"
                    ),
                )
            )
            seen.add(cat)
            trace_group.append(gi)
    n_lanes = max(len(ticks), 1)
    height = int(min(max(220, 90 + _LANE_PX * n_lanes), 1600))
    _layout(
        fig,
        f"Timeline ({unit} from the first event)",
        height=height,
        barmode="overlay",
        bargap=0,
        hovermode="closest",
        legend={"orientation": "h", "y": -0.08},
    )
    fig.update_yaxes(
        tickmode="array",
        tickvals=list(range(len(ticks))),
        ticktext=ticks,
        range=[n_lanes - 0.5, -0.5],
        showgrid=False,
        zeroline=False,
    )
    fig.update_xaxes(title_text=unit, zeroline=False)
    for first, _last in spans[1:]:
        fig.add_hline(y=first - 0.5, line={"width": 1, "color": "#888"})
    if len(groups) > 1:
        buttons = [
            {
                "label": "all",
                "method": "update",
                "args": [
                    {"visible": [True] * len(trace_group)},
                    {"yaxis.range": [n_lanes - 0.5, -0.5]},
                ],
            }
        ]
        for gi, g in enumerate(groups):
            first, last = spans[gi]
            buttons.append(
                {
                    "label": esc(g.label, limit=60),
                    "method": "update",
                    "args": [
                        {"visible": [t == gi for t in trace_group]},
                        {"yaxis.range": [last + 0.5, first - 0.5]},
                    ],
                }
            )
        fig.update_layout(
            updatemenus=[
                {"buttons": buttons, "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"}
            ]
        )
    return fig


def temporal_figure(df: pl.DataFrame, labels: list[str]) -> go.Figure:
    """Stacked bars: each row's compute/comm/memory/other/idle share of its iteration windows."""
    fig = go.Figure()
    for part in ("compute", "comm", "memory", "other", "idle"):
        ms = (df[f"{part}_ns"].cast(pl.Float64) / 1e6).to_numpy()
        fig.add_trace(
            go.Bar(
                x=labels,
                y=df[f"{part}_pct"].to_numpy(),
                name=part,
                marker_color=PART_COLORS[part],
                customdata=ms,
                hovertemplate=f"%{{x}}<br>{part}: %{{y:.1f}} % (%{{customdata:.3f}} ms)"
                "<extra></extra>",
            )
        )
    mode = ", ".join(sorted({str(m) for m in df["mode"].to_list()}))
    _layout(
        fig,
        f"Temporal breakdown per rank ({mode} mode; % of iteration windows)",
        barmode="stack",
        yaxis_title="% of window",
        legend={"orientation": "h", "y": -0.15},
    )
    fig.update_xaxes(type="category")
    return fig


def kernels_figure(
    df: pl.DataFrame, *, title: str = "Top device kernels (total time over all ranks)"
) -> go.Figure:
    """Top device kernels by total time over the run, coloured by kernel type."""
    df = df.sort("total_ns")
    div, unit = time_unit(float(df["total_ns"].max() or 0))  # type: ignore[arg-type]
    fig = go.Figure()
    colors = {"compute": "#54a24b", "comm": "#d62728", "memory": "#f58518", "other": "#bab0ac"}
    for (ktype,), part in df.partition_by("kernel_type", as_dict=True).items():
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[esc(n, limit=50) for n in part["name"].to_list()],
                x=(part["total_ns"].cast(pl.Float64) / div).to_numpy(),
                name=esc(ktype),
                marker_color=colors.get(str(ktype), "#7f7f7f"),
                customdata=np.column_stack(
                    [[esc(n, limit=200) for n in part["name"].to_list()], part["calls"].to_numpy()]
                ),
                hovertemplate="<b>%{customdata[0]}</b><br>%{x:.3g} "
                + unit
                + " in %{customdata[1]} calls<extra></extra>",
            )
        )
    _layout(
        fig,
        esc(title),
        height=max(300, 60 + 24 * df.height),
        xaxis_title=unit,
        barmode="stack",
    )
    fig.update_yaxes(categoryorder="total ascending")
    return fig


def host_ops_figure(df: pl.DataFrame, *, scope: str) -> go.Figure:
    """Top host ops by self time (duration minus nested events) over the stored ranks."""
    df = df.sort("self_ns")
    div, unit = time_unit(float(df["self_ns"].max() or 0))  # type: ignore[arg-type]
    names = [esc(n, limit=200) for n in df["name"].to_list()]
    fig = go.Figure(
        go.Bar(
            orientation="h",
            y=[esc(n, limit=50) for n in df["name"].to_list()],
            x=(df["self_ns"].cast(pl.Float64) / div).to_numpy(),
            marker_color="#4c78a8",
            customdata=np.column_stack(
                [names, df["calls"].to_numpy(), (df["total_ns"] / div).to_numpy()]
            ),
            hovertemplate="<b>%{customdata[0]}</b><br>self %{x:.3g} "
            + unit
            + ", inclusive %{customdata[2]:.3g} "
            + unit
            + "<br>%{customdata[1]} calls<extra></extra>",
        )
    )
    _layout(
        fig,
        f"Top host ops by self time ({esc(scope)})",
        height=max(300, 60 + 24 * df.height),
        xaxis_title=unit,
    )
    return fig


def wait_heatmap(z: np.ndarray, ranks: list[str], instances: list[str]) -> go.Figure:
    """Lane groups x communication instances, coloured by the time each waited for the last one.

    The colour scale runs from 0 to the 99th percentile of the waits (at least 1 µs), so a few
    long waits do not wash the rest out and an all-zero map reads as "no waiting", not as a
    -0.5..0.5 scale.
    """
    finite = z[np.isfinite(z)]
    top = float(np.percentile(finite, 99)) if finite.size else 0.0
    if top <= 0 and finite.size:
        top = float(finite.max())  # sparse waits: most cells are 0
    zmax = max(top, 1.0)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=instances,
            y=ranks,
            zmin=0.0,
            zmax=zmax,
            colorscale="YlOrRd",
            colorbar={"title": {"text": "wait µs"}},
            hovertemplate="%{y} · %{x}<br>waited %{z:.4g} µs<extra></extra>",
            hoverongaps=False,
        )
    )
    _layout(
        fig,
        "Wait per rank (or class) and communication instance (last arrival - own arrival)",
        height=int(min(max(260, 120 + 18 * len(ranks)), 1200)),
    )
    fig.update_xaxes(type="category", showticklabels=len(instances) <= 60, title_text="instance")
    fig.update_yaxes(type="category", autorange="reversed")
    return fig


def iteration_figure(runs: list[tuple[str, pl.DataFrame]]) -> go.Figure:
    """Per iteration, the slowest rank's step time of each run (bars) and the mean (markers)."""
    fig = go.Figure()
    top = max((float(df["max_ns"].max() or 0) for _, df in runs), default=0.0)  # type: ignore[arg-type]
    div, unit = time_unit(top)
    colors = ["#4c78a8", "#f58518", "#54a24b", "#e45756"]
    for i, (name, df) in enumerate(runs):
        color = colors[i % len(colors)]
        x = [str(v) for v in df["iteration"].to_list()]
        fig.add_trace(
            go.Bar(
                x=x,
                y=(df["max_ns"].cast(pl.Float64) / div).to_numpy(),
                name=f"{esc(name)} (max over ranks)",
                marker_color=color,
                offsetgroup=str(i),
                customdata=np.column_stack(
                    [
                        (df["min_ns"].cast(pl.Float64) / div).to_numpy(),
                        (df["mean_ns"] / div).to_numpy(),
                        df["slowest_rank"].to_numpy(),
                        df["ranks"].to_numpy(),
                    ]
                ),
                hovertemplate=f"{esc(name)} · iteration %{{x}}<br>max %{{y:.3g}} {unit}"
                f" (rank %{{customdata[2]}})<br>mean %{{customdata[1]:.3g}} {unit}, min"
                f" %{{customdata[0]:.3g}} {unit}<br>%{{customdata[3]}} ranks<extra></extra>",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=(df["mean_ns"] / div).to_numpy(),
                mode="markers",
                offsetgroup=str(i),
                name=f"{esc(name)} (mean)",
                marker={"color": color, "symbol": "diamond", "size": 9, "line": {"width": 1}},
                hovertemplate=f"{esc(name)} mean %{{y:.3g}} {unit}<extra></extra>",
            )
        )
    title = "Iteration time" + (" — " + " vs ".join(esc(n) for n, _ in runs) if runs else "")
    _layout(
        fig,
        title,
        barmode="group",
        scattermode="group",
        xaxis_title="iteration",
        yaxis_title=unit,
        legend={"orientation": "h", "y": -0.2},
    )
    fig.update_xaxes(type="category")
    return fig


def memory_figure(series: pl.DataFrame, peaks: pl.DataFrame, t0: int) -> go.Figure:
    """Allocated bytes over time per lane group (rank or class) and device, each peak marked.

    ``peaks`` carries a ``label`` per (grp, device) line.
    """
    fig = go.Figure()
    span = float(series["ts"].max() - t0) if series.height else 0.0  # type: ignore[operator]
    div, unit = time_unit(span)
    for row in peaks.iter_rows(named=True):
        part = series.filter((pl.col("grp") == row["grp"]) & (pl.col("device") == row["device"]))
        label = f"{esc(row['label'], limit=50)} {esc(row['device'])}"
        fig.add_trace(
            go.Scatter(
                x=(part["ts"].to_numpy() - t0) / div,
                y=part["bytes"].cast(pl.Float64).to_numpy() / 2**20,
                mode="lines",
                line={"shape": "hv", "width": 1.5},
                name=label,
                legendgroup=label,
                hovertemplate=f"{label}<br>%{{x:.4g}} {unit}: %{{y:.3f}} MiB<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=(peaks["ts"].to_numpy() - t0) / div,
            y=peaks["bytes"].cast(pl.Float64).to_numpy() / 2**20,
            mode="markers",
            marker={"symbol": "triangle-down", "size": 11, "color": "#d62728"},
            name="peak",
            text=[
                f"{esc(lb, limit=50)} {esc(d)} (rank {r})"
                for lb, d, r in zip(peaks["label"], peaks["device"], peaks["rank"], strict=True)
            ],
            hovertemplate=f"peak %{{text}}<br>%{{y:.3f}} MiB at %{{x:.4g}} {unit}<extra></extra>",
        )
    )
    top = peaks.row(0, named=True)
    where = esc(top["label"], limit=40)
    if top["label"] != f"rank {top['rank']}":
        where += f", rank {top['rank']}"
    fig.add_annotation(
        x=(top["ts"] - t0) / div,
        y=top["bytes"] / 2**20,
        text=f"peak {bytes_text(top['bytes'])} ({where} {esc(top['device'])})",
        showarrow=True,
        arrowhead=2,
        ay=-30,
    )
    _layout(
        fig,
        f"Memory: allocated bytes over time ({unit} from the first event)",
        xaxis_title=unit,
        yaxis_title="MiB allocated",
        legend={"orientation": "h", "y": -0.2},
    )
    return fig
