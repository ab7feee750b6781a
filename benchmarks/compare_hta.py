"""The analyses against HolisticTraceAnalysis on the same real traces, and their run times.

For ``param-dlrm-8rank`` (8 ranks), ``hta-nccl-rank0`` (1 rank, 3 steps), the same with CUDA
sync events added (``tests/analysis/foreign_traces.with_cuda_sync``) and the bundled sample
it prints, per rank, HTA's temporal breakdown, kernel totals, comm/comp overlap and idle totals
next to prism's with HTA's window (``window="hta"``), then the wall time of
each prism analysis (target: <= 2 s each on the 8-rank set) and of HTA's. Writes
``benchmarks/results/analysis-vs-hta_<machine>_<date>.md``. Not a test: no asserts on timings.

Usage::

    python benchmarks/compare_hta.py                 # datasets from ../shared/datasets
    PRISM_SHARED_DATASETS=/path python benchmarks/compare_hta.py
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import polars as pl
from prism_trace.analysis import ANALYSES, idle, kernels, overlap, temporal

from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "datasets" / "sample"


def _shared() -> Path:
    env = os.environ.get("PRISM_SHARED_DATASETS")
    return Path(env) if env else REPO.parent / "shared" / "datasets"


def _hta(trace_dir: Path) -> tuple[dict[str, object], float]:
    from hta.trace_analysis import TraceAnalysis

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    ta = TraceAnalysis(trace_dir=str(trace_dir))
    out: dict[str, object] = {
        "temporal": ta.get_temporal_breakdown(visualize=False),
        "kernels": ta.get_gpu_kernel_breakdown(
            visualize=False, include_memory_kernels=True, num_kernels=1000, duration_ratio=1.0
        ),
        "overlap": ta.get_comm_comp_overlap(visualize=False),
        "idle": ta.get_idle_time_breakdown(ranks=list(ta.t.traces), visualize=False)[0],
    }
    return out, time.perf_counter() - t0


def _pct(a: float, b: float) -> str:
    """prism / HTA with the relative difference."""
    diff = 0.0 if a == b else 100 * (a - b) / b if b else float("inf")
    return f"{a:.0f} / {b:.0f} ({diff:+.2f} %)"


def _compare(store: Store, run: str, hta: dict[str, object]) -> str:
    """Markdown table: per rank, prism (`window="hta"`) vs HTA, µs, and the relative difference."""
    ours = temporal(store, run, window="hta")
    ov = overlap(store, run, window="hta")
    ker = (
        kernels(store, run, per_rank=True, window="hta")
        .group_by("rank")
        .agg(pl.col("total_ns").sum())
        .sort("rank")
    )
    idl = idle(store, run, window="hta").group_by("rank").agg(pl.col("idle_ns").sum()).sort("rank")
    t = pl.from_pandas(hta["temporal"])  # type: ignore[arg-type]
    o = pl.from_pandas(hta["overlap"])  # type: ignore[arg-type]
    k = pl.from_pandas(hta["kernels"][1])  # type: ignore[index]
    k = k.group_by("rank").agg(pl.col("sum (us)").sum()).sort("rank")
    i = pl.from_pandas(hta["idle"]).group_by("rank").agg(pl.col("idle_time").sum()).sort("rank")  # type: ignore[arg-type]
    lines = [
        "| rank | temporal: compute µs | temporal: non-compute µs | temporal: idle µs"
        " | temporal: window µs | kernels: total µs | overlap % | idle: stream gaps µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, h, ovr, oh, kr, kh, ir, ih in zip(
        ours.iter_rows(named=True),
        t.iter_rows(named=True),
        ov.iter_rows(named=True),
        o.iter_rows(named=True),
        ker.iter_rows(named=True),
        k.iter_rows(named=True),
        idl.iter_rows(named=True),
        i.iter_rows(named=True),
        strict=True,
    ):
        non = (r["comm_ns"] + r["memory_ns"] + r["other_ns"]) / 1e3
        lines.append(
            f"| {r['rank']} | {_pct(r['compute_ns'] / 1e3, h['compute_time(us)'])}"
            f" | {_pct(non, h['non_compute_time(us)'])}"
            f" | {_pct(r['idle_ns'] / 1e3, h['idle_time(us)'])}"
            f" | {_pct(r['window_ns'] / 1e3, h['kernel_time(us)'])}"
            f" | {_pct(kr['total_ns'] / 1e3, kh['sum (us)'])}"
            f" | {ovr['overlap_pct']:.2f} / {oh['comp_comm_overlap_pctg']:.2f}"
            f" | {_pct(ir['idle_ns'] / 1e3, ih['idle_time'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    shared = _shared()
    tmp = Path(tempfile.mkdtemp())
    try:
        nccl_dir = tmp / "hta-nccl"
        nccl_dir.mkdir()
        shutil.copy(shared / "hta-nccl-rank0" / "nccl_data.json.gz", nccl_dir)
        sample_dir = tmp / "sample-kineto"  # HTA reads every JSON of a folder: Kineto only
        sample_dir.mkdir()
        for f in SAMPLE.glob("*.kineto.json.gz"):
            shutil.copy(f, sample_dir)
        # HTA-NCCL with Kineto's CUDA sync events (a Stream Sync after the last kernel)
        sys.path.insert(0, str(REPO))
        from tests.analysis.foreign_traces import with_cuda_sync

        sync_dir = tmp / "hta-nccl-sync"
        sync_dir.mkdir()
        with_cuda_sync(
            nccl_dir / "nccl_data.json.gz", sync_dir / "nccl_sync.json", stream=7, tail_us=75_800
        )
        sets = {
            "dlrm": (shared / "param-dlrm-8rank", shared / "param-dlrm-8rank" / "kineto"),
            "hta": (shared / "hta-nccl-rank0", nccl_dir),
            "hta_sync": (sync_dir, sync_dir),
            "sample": (SAMPLE, sample_dir),
        }
        with open_store(tmp / "a.duckdb") as s:
            for run, (src, _) in sets.items():
                ingest(s, [src], run=run, progress=False)
        store = open_store(tmp / "a.duckdb", read_only=True)
        out = [
            f"# Analyses vs HTA, {platform.machine()} {os.cpu_count()} CPUs, {dt.date.today()}",
            "",
            "Generated by `benchmarks/compare_hta.py`; differences are explained in"
            " docs/analysis.md (Comparison with HTA).",
            "",
        ]
        for run, (_, hta_dir) in sets.items():
            out += [f"## {run}", ""]
            try:
                hta, hta_s = _hta(hta_dir)
            except Exception as exc:  # HTA's own failure is the finding
                line = str(exc).splitlines()[0] if str(exc) else ""
                out += [f"HTA fails on it: {type(exc).__name__}: {line}", ""]
                continue
            out += ["prism `--window hta` / HTA (relative difference):", ""]
            out += [_compare(store, run, hta), ""]
            timings = []
            for name, fn in ANALYSES.items():
                t0 = time.perf_counter()
                fn(store, run)
                timings.append(f"{name} {time.perf_counter() - t0:.3f} s")
            out += [f"prism (first call loads the views): {', '.join(timings)}.", ""]
            out += [f"HTA (parse + the four analyses): {hta_s:.2f} s.", ""]
        text = "\n".join(out)
        print(text)
        res = REPO / "benchmarks" / "results"
        res.mkdir(exist_ok=True)
        machine = platform.machine().replace("_", "-")
        name = f"analysis-vs-hta_{machine}-{os.cpu_count()}cpu_{dt.date.today()}.md"
        (res / name).write_text(text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
