"""Memory timeline from host-ET tensor sizes (``replay.et_memory``) vs recorded allocator events.

Two sets:

- the bundled gloo ``datasets/sample`` (8 CPU ranks), which has *both* recorded ``[memory]``
  allocator events and host ETs: per rank the recorded peak ``total_allocated``, the ET-derived
  peak and the error; the recorded peak less allocations whose free the CPU profiler never
  reported (blocks freed on gloo's worker thread, where memory profiling is off, stay counted);
  the ET level at the recorded peak's instant (what the ET misses right there); the timeline shape
  (mean |ET level - recorded level| over the recorded events' instants, % of the recorded peak);
  the earlier last-use prototype (one life per storage id, from its first output to its last use,
  no recycled-id split), for contrast; and the emulated peak when every rank's ``[memory]`` rows
  are removed, so that ``prism emulate`` falls back to the ET (``replay.emulate_frames._memory``).
- the real PARAM DLRM traces ``../shared/datasets/param-dlrm-8rank`` (V100, no memory events):
  per rank the derived ``cuda`` peak, its resident part, and the sanity bound from the FBGEMM
  table-batched embedding: ``dev_weights`` and the exact-Adagrad ``momentum1`` are two fp32
  buffers of the same numel, so the resident bytes must be at least ``2 * 4 * numel``.

Usage::

    python benchmarks/bench_et_memory.py
    python benchmarks/bench_et_memory.py --no-note
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import polars as pl
from _common import REPO, SHARED, host_kind, write_note

SAMPLE = REPO / "datasets" / "sample"
DLRM = SHARED / "param-dlrm-8rank"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2f} %"


def _err(emu: float, rec: float) -> float:
    return 100.0 * (emu - rec) / rec


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _recorded(con: Any, run_id: int, rank: int) -> pl.DataFrame:
    return con.sql(
        "SELECT ts, addr, bytes, total_allocated FROM memory"
        " WHERE run_id = $1 AND rank = $2 ORDER BY ts",
        params=[run_id, rank],
    ).pl()


def _unfreed_corrected_peak(rec: pl.DataFrame) -> int:
    """Peak of the recorded level less every allocation never freed in the window."""
    lost = np.zeros(rec.height, dtype=np.int64)
    pending: dict[int, int] = {}  # address -> index of its allocation not yet freed
    for i, (addr, b) in enumerate(rec.select("addr", "bytes").iter_rows()):
        if b > 0:
            if addr in pending:  # allocated again without a free: that free went unreported
                lost[pending[addr]] = int(rec["bytes"][pending[addr]])
            pending[addr] = i
        else:
            pending.pop(addr, None)
    for i in pending.values():  # never freed in the window
        lost[i] = int(rec["bytes"][i])
    return int((rec["total_allocated"].to_numpy() - np.cumsum(lost)).max())


def _level_at(ev: pl.DataFrame, ts: np.ndarray) -> np.ndarray:
    """The derived level (one device) just after each instant of ``ts``."""
    t = ev["ts"].to_numpy()
    lvl = ev["total_allocated"].to_numpy()
    i = np.searchsorted(t, ts, side="right") - 1
    return np.where(i >= 0, lvl[np.clip(i, 0, None)], 0)


def _naive_peak(ops: pl.DataFrame) -> int:
    """The earlier last-use prototype: one life per (storage_id, device), from its first output
    (or the start, if first read) to its last use, size the largest (offset + numel) * elem_bytes;
    residents left out (CPU convention). No recycled-id split, no nested-op care."""
    from prism_trace.replay.kernels.schema import is_tensor_ref

    first: dict[tuple[int, str], int] = {}
    last: dict[tuple[int, str], int] = {}
    size: dict[tuple[int, str], int] = {}
    resident: set[tuple[int, str]] = set()
    rows = ops.sort("node_id").select("inputs", "outputs", "ts", "dur").iter_rows()
    for ins, outs, ts, dur in rows:
        if ts is None:
            continue
        for side, text in (("in", ins), ("out", outs)):
            stack = [orjson.loads(text or "[]")]
            while stack:
                v = stack.pop()
                if is_tensor_ref(v):
                    key = (int(v[1]), str(v[5]) if len(v) == 6 else "cpu")
                    if key not in first:
                        first[key] = ts
                        if side == "in":
                            resident.add(key)
                    last[key] = max(last.get(key, ts), ts + (dur or 0))
                    size[key] = max(size.get(key, 0), (int(v[2]) + int(v[3])) * int(v[4]))
                elif isinstance(v, list):
                    stack.extend(v)
    ev = [(first[k], size[k]) for k in first if k not in resident and size[k] > 0]
    ev += [(last[k], -size[k]) for k in first if k not in resident and size[k] > 0]
    ev.sort()
    return int(np.cumsum([b for _, b in ev]).max()) if ev else 0


def bench_sample(tmp: Path) -> tuple[str, list[str]]:
    """The sample: derived vs recorded, per rank."""
    from prism_trace.replay.emulate.driver import emulate_in_memory
    from prism_trace.replay.emulate.frames import rank_peaks
    from prism_trace.replay.memory.host_et import lifetime_events, rank_et_ops, storage_lifetimes

    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    header = (
        "rank",
        "recorded",
        "rec-unfreed",
        "ET-derived",
        "err",
        "err vs rec-unfreed",
        "ET @rec peak",
        "missing there",
        "shape err",
        "prototype",
        "proto err",
        "emulated (ET)",
        "emu err",
        "derive s",
    )
    rows = [header]
    notes: list[str] = []
    with open_store(tmp / "sample.duckdb") as store:
        ingest(store, [SAMPLE], run="sample", progress=False)
        con = store.con
        run_id = con.sql("SELECT run_id FROM run WHERE name = 'sample'").fetchall()[0][0]
        ranks = [r for (r,) in con.sql("SELECT DISTINCT rank FROM et_op ORDER BY 1").fetchall()]
        recorded = {}
        for r in ranks:
            rec = _recorded(con, run_id, r)
            t0 = time.perf_counter()
            ops = rank_et_ops(con, run_id, r)
            ev = lifetime_events(storage_lifetimes(ops), rank=r).filter(
                pl.col("device_type") == "cpu"
            )
            secs = time.perf_counter() - t0
            peak = int(ev["total_allocated"].max())
            rpeak = int(rec["total_allocated"].max())
            recorded[r] = rpeak
            corrected = _unfreed_corrected_peak(rec)
            at = rec.row(int(rec["total_allocated"].arg_max()), named=True)["ts"]
            lvl_at = int(_level_at(ev, np.asarray([at]))[0])
            shape = float(
                np.mean(
                    np.abs(_level_at(ev, rec["ts"].to_numpy()) - rec["total_allocated"].to_numpy())
                )
            )
            naive = _naive_peak(ops)
            rows.append(
                (
                    str(r),
                    str(rpeak),
                    str(corrected),
                    str(peak),
                    _pct(_err(peak, rpeak)),
                    _pct(_err(peak, corrected)),
                    str(lvl_at),
                    str(rpeak - lvl_at),
                    f"{100 * shape / rpeak:.2f} %",
                    str(naive),
                    _pct(_err(naive, rpeak)),
                    "",
                    "",
                    f"{secs:.2f}",
                )
            )
        # The emulator's fallback: no [memory] rows at all, so every rank's timeline is derived.
        con.execute("DELETE FROM memory WHERE run_id = $1", [run_id])
        res, _ = emulate_in_memory(store, run="sample")
        emu = dict(rank_peaks(res).iter_rows())
        for row in rows[1:]:
            r = int(row[0])
            row_l = list(row)
            row_l[11] = str(emu.get(r, "-"))
            row_l[12] = _pct(_err(emu[r], recorded[r])) if r in emu else "n/a"
            rows[rows.index(row)] = tuple(row_l)
    for col, what in ((4, "recorded"), (5, "recorded less unreported frees")):
        errs = [float(row[col].split()[0]) for row in rows[1:]]
        notes.append(
            f"sample, ET-derived vs {what}: mean |err| {np.mean(np.abs(errs)):.2f} %,"
            f" range {min(errs):+.2f} % .. {max(errs):+.2f} %"
        )
    return _table(rows), notes


def bench_dlrm(tmp: Path) -> tuple[str, list[str]]:
    """DLRM: derived cuda peak per rank and the TBE sanity bound."""
    from prism_trace.replay.emulate.driver import emulate_in_memory
    from prism_trace.replay.emulate.frames import rank_peaks
    from prism_trace.replay.memory.host_et import lifetime_events, rank_et_ops, storage_lifetimes

    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    header = (
        "rank",
        "cuda peak",
        "GiB",
        "resident",
        "transient peak",
        "TBE numel",
        "2*4*numel",
        "resident - 2*4*numel",
        "cpu peak",
        "emulated",
        "derive s",
    )
    rows = [header]
    with open_store(tmp / "dlrm.duckdb") as store:
        ingest(store, [DLRM], run="dlrm", progress=False)
        con = store.con
        run_id = con.sql("SELECT run_id FROM run WHERE name = 'dlrm'").fetchall()[0][0]
        res, _ = emulate_in_memory(store, run="dlrm")
        emu = dict(rank_peaks(res).iter_rows())
        for (r,) in con.sql("SELECT DISTINCT rank FROM et_op ORDER BY 1").fetchall():
            t0 = time.perf_counter()
            ops = rank_et_ops(con, run_id, r)
            lt = storage_lifetimes(ops)
            ev = lifetime_events(lt, rank=r)
            secs = time.perf_counter() - t0
            cuda = ev.filter(pl.col("device_type") == "cuda")
            cpu = ev.filter(pl.col("device_type") == "cpu")
            base = int(cuda.filter(pl.col("bytes") == 0)["total_allocated"].sum())
            peak = int(cuda["total_allocated"].max())
            tbe = con.sql(
                "SELECT inputs FROM et_op WHERE run_id = $1 AND rank = $2"
                " AND name LIKE 'fbgemm::split_embedding_codegen_lookup_%' LIMIT 1",
                params=[run_id, r],
            ).fetchall()
            numel = int(orjson.loads(tbe[0][0])[1][3]) if tbe else 0
            rows.append(
                (
                    str(r),
                    str(peak),
                    f"{peak / 2**30:.3f}",
                    str(base),
                    str(peak - base),
                    str(numel),
                    str(8 * numel),
                    str(base - 8 * numel),
                    str(int(cpu["total_allocated"].max()) if cpu.height else 0),
                    str(emu.get(r, "-")),
                    f"{secs:.2f}",
                )
            )
    return _table(rows), []


def main() -> None:
    """Run both sets, print the tables and write the note."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()
    parts: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        table, notes = bench_sample(tmp)
        print("sample (gloo, CPU allocator events vs ET-derived), bytes:")
        print(table)
        print("\n".join(notes))
        parts.append(f"## sample: recorded vs ET-derived peak, bytes\n\n```\n{table}\n```\n")
        parts.extend(notes)
        if DLRM.is_dir():
            table, _ = bench_dlrm(tmp)
            print("\nDLRM (V100, no memory events), bytes:")
            print(table)
            parts.append(f"\n## DLRM: ET-derived peak per rank, bytes\n\n```\n{table}\n```\n")
        else:
            print(f"\nDLRM: {DLRM} not found (set PRISM_SHARED_DATASETS)")
    if args.no_note:
        return
    body = "\n".join(parts) + (
        "\n\nColumns (sample): recorded = max `total_allocated` of the rank's `[memory]` events;"
        " rec-unfreed = the same less allocations whose free was never reported (never freed in the"
        " window, or their address allocated again first): all are tensors handed to a gloo"
        " all-reduce, most likely released on gloo's worker thread where the profiler does not"
        " track memory, so the recorded total drifts up, differently on each rank; err = (ET -"
        " recorded)"
        " / recorded; ET @rec peak = the derived level at the recorded peak's instant, missing"
        " there = what the ET does not see at that instant (tensors Python still holds after their"
        " last op: the micro-batch outputs and tokens kept in lists until the step ends); shape"
        " err = mean |derived - recorded level| over the recorded instants / recorded peak;"
        " prototype = one life per storage id from first output to last use (no recycled-id split),"
        " the earlier attempt; emulated (ET) = `emulate_in_memory` peak with every `[memory]` row"
        " removed, i.e. through the `replay.emulate_frames._memory` fallback and `retime_memory`.\n"
        "Columns (DLRM): resident = parameters, optimizer state and buffers first read before"
        " produced (the level before the first event; counted on cuda like the caching"
        " allocator's device total); TBE numel = FBGEMM `dev_weights` elements; the exact-Adagrad"
        " `momentum1` has as many, so resident >= 2 * 4 * numel; the rest is the dense MLPs, their"
        " state and DDP buckets."
    )
    note = write_note(
        "et-memory",
        host_kind(args.host_kind),
        title="ET-derived memory timeline vs recorded allocator events",
        command="python benchmarks/bench_et_memory.py",
        body=body,
    )
    print(f"note: {note}")


if __name__ == "__main__":
    main()
