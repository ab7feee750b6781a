"""Calibration benchmark: the network model fitted to the real traces, and what it predicts.

Ingests ``param-dlrm-8rank`` (8 V100, NCCL, every rank) and ``hta-nccl-rank0`` (rank 0 of 2
A100, NCCL) into a temporary store and runs ``replay.calibrate.calibrate_run`` on each against
the ``generic`` preset. Prints, per run and link class, the fitted latency per step and bus
bandwidth, the points and instances used, the fit quality (median |relative error|, R^2) and
where a value came from; then the per-kind fits; then what the ``h100`` preset predicts
for nccl-tests-like all_reduce sizes (``collective_cost``: algorithm, time, busbw); then the
``scaled`` transfer of DLRM's recorded all_reduce instances at 1, 2 and 8 nodes with the
calibrated topology. Writes ``results/calibrate_<host>_<date>.md`` unless ``--no-note``.

Usage::

    python benchmarks/bench_calibrate.py
    python benchmarks/bench_calibrate.py --no-note
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import SHARED, host_kind, write_note

SETS = (("dlrm", SHARED / "param-dlrm-8rank"), ("hta", SHARED / "hta-nccl-rank0"))


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main() -> None:
    """Calibrate on the real traces and print (and note) the fits and predictions."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    from prism_trace.replay.model.calibrate import calibrate_run, collective_samples
    from prism_trace.replay.model.cost import collective_cost
    from prism_trace.replay.model.timing import ScaledTransfer, TransferQuery
    from prism_trace.replay.model.topology import Topology

    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    head = ("run", "link", "kind", "alpha us/step", "busbw GB/s", "points", "inst")
    fits = [(*head, "med|rel|", "R^2", "source")]
    notes: list[str] = []
    scaled_rows = [("instance", "bytes", "recorded us", "8 GPU/1 node", "16/2 nodes", "64/8 nodes")]
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp, open_store(Path(tmp) / "c.duckdb") as store:
        for name, path in SETS:
            if not path.is_dir():
                notes.append(f"{name}: {path} missing")
                continue
            ingest(store, [path], run=name, progress=False)
            t0 = time.perf_counter()
            cal = calibrate_run(store, name)
            seconds[name] = time.perf_counter() - t0
            for f in (cal.intra, cal.inter, *cal.per_kind):
                fits.append(
                    (
                        name,
                        f.link,
                        f.kind or "(pooled)",
                        f"{f.alpha_ns / 1e3:.2f}",
                        f"{f.gbps:.1f}",
                        str(f.points),
                        str(f.instances),
                        _fmt(f.median_rel_error, ".3f"),
                        _fmt(f.r2, ".3f"),
                        f.source + (f" ({f.note})" if f.note else ""),
                    )
                )
            notes.append(
                f"{name}: {cal.instances} instances, waiting included: {cal.waiting_included},"
                " median |model / recorded - 1| over instances"
                f" {_fmt(cal.median_rel_error, '.3f')},"
                f" calibration {seconds[name] * 1e3:.0f} ms"
            )
            if name != "dlrm":
                continue
            s = collective_samples(store, name, cal.topology)
            s = s.filter(s["kind"] == "all_reduce")
            k = s["kind"].to_numpy().astype(object)
            cols = []
            for n, nodes in ((8, 1), (16, 2), (64, 8)):
                q = TransferQuery(
                    kind=k,
                    msg_bytes=s["msg_bytes"].to_numpy(),
                    group_size=np.full(k.size, n),
                    spans_nodes=np.full(k.size, nodes > 1),
                    recorded_ns=s["transfer_ns"].to_numpy(),
                    n_nodes=np.full(k.size, nodes),
                    recorded_group_size=s["group_size"].to_numpy(),
                    recorded_n_nodes=s["n_nodes"].to_numpy(),
                )
                cols.append(ScaledTransfer(cal.topology).transfer(q))
            for i in range(k.size):
                scaled_rows.append(
                    (
                        f"all_reduce seq {s['seq'][i]}",
                        str(s["msg_bytes"][i]),
                        f"{s['transfer_ns'][i] / 1e3:.1f}",
                        *(f"{c[i] / 1e3:.1f}" for c in cols),
                    )
                )

    preset_rows = [("preset", "GPUs", "nodes", "bytes", "algorithm", "time us", "busbw GB/s")]
    for system in ("h100",):  # h200 has the same network (docs/network.md)
        topo = Topology.preset(system)
        for n, nodes in ((8, 1), (16, 2), (1024, 128)):
            for size in (1 << 10, 1 << 20, 1 << 30):
                kind = np.array(["all_reduce"], dtype=object)
                c = collective_cost(kind, [size], [n], [nodes], topo)
                t = float(c.time_ns(topo)[0])
                preset_rows.append(
                    (
                        system,
                        str(n),
                        str(nodes),
                        str(size),
                        str(c.algorithm[0]),
                        f"{t / 1e3:.1f}",
                        f"{size / t * 2 * (n - 1) / n:.1f}",
                    )
                )

    body = (
        "Fits (`calibrate_run(store, run)`, base preset `generic`):\n\n```\n"
        + _columns(fits)
        + "\n```\n\n"
        + "\n".join(f"- {x}" for x in notes)
        + "\n\nPresets, all_reduce (`collective_cost`, algorithm `auto`; busbw = S/t * 2(n-1)/n):"
        "\n\n```\n"
        + _columns(preset_rows)
        + "\n```\n\nDLRM's recorded all_reduce instances, `scaled` model with the calibrated"
        " topology (recorded on 8 GPUs of one node; 8 GPUs per node at the wider scales):\n\n```\n"
        + _columns(scaled_rows)
        + "\n```"
    )
    print(body)
    if not args.no_note:
        note = write_note(
            "calibrate",
            host_kind(args.host_kind),
            title="calibrate: the network model fitted to the real traces",
            command="python benchmarks/bench_calibrate.py",
            body=body,
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()
