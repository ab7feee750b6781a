"""Critical path: HTA's single-rank analysis next to prism's cross-rank one, on PARAM DLRM.

HTA (``TraceAnalysis.critical_path_analysis(rank, "ProfilerStep", 0)``) walks one rank's trace;
prism (``analysis.critical_path``) walks the execution graph of every rank and jumps ranks at the
last arriver of a collective. They answer different questions, so the comparison is of what each
says bounds the step: HTA's time per ``bound_by`` class on rank 0, and prism's path per rank and
node kind. HTA 0.5 needs pandas < 3 here (with pandas 3.1 ``_create_event_nodes`` raises
``ValueError: Cannot specify both 'axis' and 'index'/'columns'``); the script says so and still
prints prism's side.

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

from _common import dataset, host_kind, write_note


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


def main() -> None:
    """Print both sides (and note them)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()
    dlrm = dataset("param-dlrm-8rank")
    text = _hta(dlrm / "kineto") + "\n\n" + _prism(dlrm)
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
