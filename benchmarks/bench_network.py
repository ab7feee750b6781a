"""Extrapolation of the fitted network model: fit on small node counts, predict larger ones.

Issue 34's target: fit ``prism network fit`` on a cluster's 1- and 2-node nccl-tests logs
(8 and 16 GPUs), predict the same cluster's 4-, 8- and 16-node logs, and report the median
|relative error| of the predicted time per collective, over sizes >= 1 MiB (target <= 10 %) and
over smaller sizes (target <= 25 %).

The public logs found (tests/data/nccl/README.md) hold no cluster with all five scales; each
case below is one cluster (or one cluster under one set of NCCL settings) with the scales it
has, fitted on its smallest and scored on the rest:

- ``gj-default``: nccl-tests#309 (gj-aion), 8 nodes of 8 H100 + 8x400G IB, default NCCL:
  all_reduce at 2, 4 and 8 nodes, 1 MiB - 8 GiB. Fit on 2 nodes.
- ``gj-default-2n4n``: the same logs, fitted on 2 and 4 nodes (a scale where the NIC bounds
  the all_reduce), predicting 8 nodes: what one more small scale buys.
- ``gj-tuned``: the same cluster with ``NCCL_MIN_CTAS=24 NCCL_IB_QPS_PER_CONNECTION=2``: fit
  on 2 nodes run with ``NCCL_ALGO=Ring``, predict 8 nodes at NCCL's own choice.
- ``qoofyk``: nccl-tests#309 (qoofyk), H100 + 8x400G IB, all_reduce 8 B - 16 GiB at 2 nodes
  (bare metal) and 4 nodes (VMs with an NCCL topology file). Fit on 2 nodes.

Writes ``results/network_<case>_<date>.md`` per case (``--date`` fixes the name's date).
Another cluster's logs are checked the same way with ``--name``, ``--fit`` and ``--predict``
(paths; the built-in cases are then skipped).

Usage::

    python benchmarks/bench_network.py [--date 2026-11-27]
    python benchmarks/bench_network.py --name mycluster --fit ar_1n.log ar_2n.log \
        --predict ar_4n.log ar_8n.log ar_16n.log
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
from pathlib import Path

import numpy as np
from _common import HERE, REPO
from prism_trace.replay.network.fit import (
    FITTED_PARAMETERS,
    fit_network,
    fit_rows,
    predict_rows,
)
from prism_trace.replay.network.model import network_time_us
from prism_trace.replay.network.parse import read_nccl_log

DATA = REPO / "tests" / "data" / "nccl" / "nccl-tests-309"
MIB = 1 << 20
CASES: dict[str, tuple[str, list[str], list[str]]] = {
    "gj-default": (
        "nccl-tests#309, gj-aion's cluster (8x H100, 8x 400G IB per node), default NCCL;"
        " logs in tests/data/nccl/nccl-tests-309/ (its README cites them)",
        ["gj_all_reduce_2n.log"],
        ["gj_all_reduce_4n.log", "gj_all_reduce_8n.log"],
    ),
    "gj-default-2n4n": (
        "nccl-tests#309, gj-aion's cluster (8x H100, 8x 400G IB per node), default NCCL;"
        " logs in tests/data/nccl/nccl-tests-309/ (its README cites them)",
        ["gj_all_reduce_2n.log", "gj_all_reduce_4n.log"],
        ["gj_all_reduce_8n.log"],
    ),
    "gj-tuned": (
        "nccl-tests#309, gj-aion's cluster with NCCL_MIN_CTAS=24 NCCL_IB_QPS_PER_CONNECTION=2;"
        " logs in tests/data/nccl/nccl-tests-309/ (its README cites them)",
        ["gj_tuned_ring_all_reduce_2n.log"],
        ["gj_tuned_all_reduce_8n.log"],
    ),
    "qoofyk": (
        "nccl-tests#309, qoofyk's H100 nodes (8x 400G IB), default NCCL;"
        " logs in tests/data/nccl/nccl-tests-309/ (its README cites them)",
        ["qoofyk_all_reduce_2n.log"],
        ["qoofyk_all_reduce_4n.log"],
    ),
    "alps-gh200": (
        "CSCS Alps (GH200, 4 per node, Slingshot, NCCL 2.23.4 + aws-ofi-nccl 1.9.2), from"
        " boeschf/nccl-benchmark-on-alps-2025: all_reduce at 1, 2, 4, 8 and 16 nodes, two runs"
        " of the larger scales; logs in tests/data/nccl/alps-gh200/ (its README cites them)",
        ["../alps-gh200/run_0000/all_reduce_1n.log", "../alps-gh200/run_0000/all_reduce_2n.log"],
        [
            *(f"../alps-gh200/run_0000/all_reduce_{n}n.log" for n in (4, 8, 16)),
            *(f"../alps-gh200/run_0001/all_reduce_{n}n.log" for n in (4, 8, 16)),
        ],
    ),
    "xxrjun-h100": (
        "xxrjun/nccl-tests-cluster's cnode3 H100 nodes (8 per node, NCCL 2.29.2): all five"
        " collectives on 1 node, alltoall and sendrecv on 2, all five on 10 (32 MiB and up);"
        " logs in tests/data/nccl/xxrjun-h100/ (its README cites them)",
        ["../xxrjun-h100/all_five_1n.log", "../xxrjun-h100/alltoall_sendrecv_2n.log"],
        ["../xxrjun-h100/all_five_10n.log"],
    ),
}
TARGET_BIG, TARGET_SMALL = 0.10, 0.25


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(v: float | None) -> str:
    return "no rows" if v is None else f"{100 * v:.1f} %"


def _not_measured(fitted: list, predicted_nodes: set[int]) -> list[str]:
    """What issue 34's target asks that this case's logs cannot show, as a note."""
    missing = []
    if not any(lg.nodes == 1 for lg in fitted):
        missing.append("a fit including a 1-node log (none public for this cluster)")
    if 16 not in predicted_nodes:
        missing.append("a 16-node prediction (no 16-node log)")
    if not missing:
        return []
    return ["", f"Not measurable here: {' and '.join(missing)}; see docs/network.md."]


def run_case(name: str, title: str, fit_on: list[str], predict: list[str], date: str) -> str:
    """Fit, predict, write the case's note; returns its summary line."""
    logs = [lg for f in fit_on for lg in read_nccl_log(DATA / f)]  # an absolute f stays itself
    model = fit_network(logs)
    lines = [
        f"# Network model extrapolation: {name}",
        "",
        "Command: `python benchmarks/bench_network.py --date "
        + date
        + ("`" if name in CASES else f" --name {name} --fit ... --predict ...`"),
        "",
        f"Cluster: {title}.",
        "",
        f"Fitted on: {', '.join(fit_on)} ({', '.join(model.fitted_from)}); fit error (median"
        f" |rel|) on its own rows {_pct(model.fit_error)}.",
        "",
        "Fitted model: "
        + ", ".join(f"{k} = {getattr(model, k):.4g}" for k in FITTED_PARAMETERS)
        + f"; determined by the logs: {', '.join(model.determined) or 'none'}.",
        "",
        "| predicted log | collective | ranks/nodes | rows >= 1 MiB | median abs err >= 1 MiB"
        " | rows < 1 MiB | median abs err < 1 MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    big_all: list[float] = []
    small_all: list[float] = []
    detail = [
        "",
        "Per size (measured us -> predicted us, error, the model's algorithm/protocol):",
        "",
    ]
    predicted_nodes: set[int] = set()
    for f in predict:
        for lg in read_nccl_log(DATA / f):
            predicted_nodes.add(lg.nodes or 0)
            failed = [r.line for r in lg.rows if r.failed_check]
            if failed:
                detail.append(
                    f"{f}: data check failed (#wrong > 0) on lines {', '.join(map(str, failed))};"
                    " a failed column's time is left out (both failed: the row is)."
                )
            rows = fit_rows([lg])
            pred = predict_rows(model, rows)
            _, choice = network_time_us(
                model, rows.op, rows.size, rows.ranks, rows.nodes, algo=lg.algo, proto=lg.proto
            )
            err = np.abs(pred / rows.time_us - 1.0)
            big = [float(e) for e, s in zip(err, rows.size, strict=True) if s >= MIB]
            small = [float(e) for e, s in zip(err, rows.size, strict=True) if s < MIB]
            big_all += big
            small_all += small
            lines.append(
                f"| {f} | {lg.op} | {lg.ranks}/{lg.nodes} | {len(big)} | {_pct(_median(big))}"
                f" | {len(small)} | {_pct(_median(small))} |"
            )
            detail.append(f"{f}:")
            detail += [
                f"- {int(s)} B: {t:.1f} -> {p:.1f} ({100 * (p / t - 1):+.1f} %, {c})"
                for s, t, p, c in zip(rows.size, rows.time_us, pred, choice, strict=True)
            ]
    mb, ms = _median(big_all), _median(small_all)
    verdict_big = "no rows" if mb is None else ("met" if mb <= TARGET_BIG else "missed")
    verdict_small = "no rows" if ms is None else ("met" if ms <= TARGET_SMALL else "missed")
    lines += [
        "",
        f"All predicted rows: median |error| {_pct(mb)} over sizes >= 1 MiB (target <= 10 %:"
        f" {verdict_big}), {_pct(ms)} over smaller sizes (target <= 25 %: {verdict_small}).",
        *_not_measured(logs, predicted_nodes),
        *detail,
    ]
    out = HERE / "results" / f"network_{name}_{date}.md"
    out.write_text("\n".join(lines) + "\n")
    return (
        f"{name}: >= 1 MiB {_pct(mb)} ({verdict_big}), < 1 MiB {_pct(ms)} ({verdict_small})"
        f" -> {out.name}"
    )


def main() -> None:
    """Run every case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--date", default=dt.date.today().isoformat())
    ap.add_argument("--name", default=None, help="a case of your own: its name")
    ap.add_argument("--fit", nargs="+", default=[], help="with --name: the logs to fit")
    ap.add_argument("--predict", nargs="+", default=[], help="with --name: the logs to predict")
    args = ap.parse_args()
    cases = CASES
    if args.name:
        if not args.fit or not args.predict:
            raise SystemExit("--name needs --fit LOG... and --predict LOG...")
        own = (
            [str(Path(p).resolve()) for p in args.fit],
            [str(Path(p).resolve()) for p in args.predict],
        )
        cases = {args.name: (f"logs given on the command line ({args.name})", *own)}
    for name, (title, fit_on, predict) in cases.items():
        print(run_case(name, title, fit_on, predict, args.date))


if __name__ == "__main__":
    main()
