"""Critical path: HTA's single-rank analysis next to prism's cross-rank one, on PARAM DLRM.

HTA (``TraceAnalysis.critical_path_analysis(rank, "ProfilerStep", 0)``) walks one rank's trace;
prism (``analysis.critical_path``) walks the execution graph of every rank and jumps ranks at the
last arriver of a collective. They answer different questions, so the comparison is of what each
says bounds the step: HTA's time per ``bound_by`` class on rank 0, and prism's path per rank and
node kind. HTA 0.5 needs pandas < 3 here (with pandas 3.1 ``_create_event_nodes`` raises
``ValueError: Cannot specify both 'axis' and 'index'/'columns'``); the script says so and still
prints prism's side.

A second comparison, on a single GPU where the host bounds a step: PARAM's ResNet trace cut to
5 steps with ProfilerStep added (``tests/analysis/foreign_traces.resnet_steps``). Per step,
HTA's path time that is ``cpu_bound`` against prism's ``host_ns``, and HTA's ``gpu_*`` against
prism's ``compute_ns``: both must say the first step (1.9 s in the data loader) is the host's
and the later ones the GPU's.

Usage::

    python benchmarks/compare_hta_critical_path.py [--no-note]
    pip install --target /tmp/pd2 'pandas<3' pytz --no-deps
    PYTHONPATH=/tmp/pd2 python benchmarks/compare_hta_critical_path.py
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from _common import REPO, SHARED, dataset, host_kind, write_note


def _hta(kineto: Path) -> str:
    try:
        import pandas as pd
        from hta.trace_analysis import TraceAnalysis
    except ImportError as exc:
        return f"HTA not importable: {exc}"
    logging.disable(logging.WARNING)
    try:
        ta = TraceAnalysis(trace_dir=str(kineto))
        graph, ok = ta.critical_path_analysis(rank=0, annotation="ProfilerStep", instance_id=0)
    except ValueError as exc:
        return f"HTA critical_path_analysis failed with pandas {pd.__version__}: {exc}"
    df = graph.get_critical_path_breakdown()
    by = df.groupby(["type", "bound_by"])["duration"].agg(["sum", "count"])
    return (
        f"HTA rank 0, ProfilerStep instance 0 (ok={ok}): path total"
        f" {df['duration'].sum() / 1e3:.3f} ms (us in the table)\n{by.to_string()}"
    )


def _prism(path: Path) -> str:
    import polars as pl
    from prism_trace.analysis.critical_path import critical_path_shares, critical_path_summary

    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    with tempfile.TemporaryDirectory() as tmp, open_store(Path(tmp) / "c.duckdb") as store:
        ingest(store, [path], run="dlrm", progress=False)
        build_graph(store, "dlrm")
        summary = critical_path_summary(store, "dlrm")
        ranks = critical_path_shares(store, "dlrm", by="rank")
        kinds = critical_path_shares(store, "dlrm", by="kind")
    with pl.Config(tbl_cols=-1, tbl_width_chars=200):
        return f"prism, all 8 ranks:\n{summary}\n{ranks}\n{kinds}"


def _resnet() -> str:
    """HTA's and prism's critical paths per step of the 5-step single-GPU ResNet."""
    import sys

    import polars as pl
    from prism_trace.analysis.critical_path import critical_path_summary

    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    sys.path.insert(0, str(REPO))
    from tests.analysis.foreign_traces import resnet_steps

    with tempfile.TemporaryDirectory() as tmp:
        trace = resnet_steps(SHARED, Path(tmp) / "resnet_steps.json", steps=5)
        hta: dict[int, tuple[float, float]] = {}
        try:
            from hta.trace_analysis import TraceAnalysis

            logging.disable(logging.WARNING)
            ta = TraceAnalysis(trace_dir=tmp)
            for step in range(4):
                graph, _ok = ta.critical_path_analysis(
                    rank=0, annotation="ProfilerStep", instance_id=step
                )
                df = graph.get_critical_path_breakdown()
                cpu = df[df["bound_by"] == "cpu_bound"]["duration"].sum() / 1e3
                gpu = df[df["bound_by"].str.startswith("gpu")]["duration"].sum() / 1e3
                hta[step] = (float(cpu), float(gpu))
        except (ImportError, ValueError) as exc:
            hta = {}
            note = f"HTA not run ({exc})"
        else:
            note = "HTA: ProfilerStep instance i, ms"
        with open_store(Path(tmp) / "r.duckdb") as store:
            ingest(store, [trace], run="resnet", rank=0, progress=False)
            build_graph(store, "resnet")
            summary = critical_path_summary(store, "resnet")
    rows = [
        "| step | HTA cpu_bound | prism host_ns | HTA gpu_* | prism compute_ns | prism path_pct |"
    ]
    rows.append("|---|---|---|---|---|---|")
    for r in summary.iter_rows(named=True):
        cpu, gpu = hta.get(r["iteration"], (float("nan"), float("nan")))
        rows.append(
            f"| {r['iteration']} | {cpu:.3f} | {r['host_ns'] / 1e6:.3f} | {gpu:.3f}"
            f" | {r['compute_ns'] / 1e6:.3f} | {r['path_pct']:.1f} |"
        )
    with pl.Config(tbl_cols=-1):
        return f"single-GPU ResNet, 5 steps ({note}; prism ms):\n" + "\n".join(rows)


def main() -> None:
    """Print both sides (and note them)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()
    dlrm = dataset("param-dlrm-8rank")
    text = _hta(dlrm / "kineto") + "\n\n" + _prism(dlrm) + "\n\n" + _resnet()
    print(text)
    if not args.no_note:
        note = write_note(
            "critical-path-vs-hta",
            host_kind(None),
            title="critical path: HTA (rank 0) vs prism (all ranks) on param-dlrm-8rank",
            command="PYTHONPATH=/tmp/pd2 python benchmarks/compare_hta_critical_path.py",
            body=f"```\n{text}\n```",
        )
        print(f"note: {note}")


if __name__ == "__main__":
    main()
