"""What `prism graph` does to a recorded run: build its graph, match collectives, settle its layout.

One public function, so the CLI only prints, and scripts and tests get the same steps in the same
order: a declared layout first, then the graph, then collective matching with the TP/CP copies
that layout implies, then each rank's role coordinates and each group's axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prism_trace.errors import PrismError
from prism_trace.graph.base import GraphReport
from prism_trace.graph.build import build_graph
from prism_trace.graph.matching import CommMatchReport, match_comms
from prism_trace.layout.assign import assign_axes
from prism_trace.layout.choice import LayoutChoice, choose_layout
from prism_trace.layout.declare import declare_layout
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.layout.symmetry import missing_ranks, symmetric_partners
from prism_trace.store.connection import Store

__all__ = ["GraphSetup", "set_up_graph"]


@dataclass
class GraphSetup:
    """The outcome of `set_up_graph`: the graph, the collective matching and the layout."""

    graph: GraphReport
    comms: CommMatchReport
    layout: LayoutChoice
    missing_ranks: str | None
    layout_text: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``prism graph --json``)."""
        return {
            "graph": self.graph.as_dict(),
            "comms": self.comms.as_dict(),
            "layout": self.layout.as_dict(),
            "missing_ranks": self.missing_ranks,
        }

    def lines(self, run: str) -> list[str]:
        """The human summary `prism graph` prints, one entry a line."""
        report, match = self.graph, self.comms
        out = [
            f"run {run!r}: {report.nodes} nodes, {report.edges} edges over"
            f" {len(report.ranks)} ranks in {report.seconds:.2f} s"
        ]
        out += [f"  {note}" for note in report.notes()]
        m = match.as_dict()
        with_copies = (
            f" ({m['complete_with_copies']} with the TP/CP copies)"
            if m["complete_with_copies"] != m["complete"]
            else ""
        )
        out.append(
            f"collectives: {m['complete']}/{m['instances']} instances complete{with_copies};"
            f" p2p: {m['p2p_pairs']} pairs, {m['p2p_unpaired']} unpaired"
        )
        by_trace = [e for e in match.matching if e["mode"] == "trace"]
        if by_trace:
            calls = sum(int(str(e["calls"])) for e in by_trace)
            out.append(
                f"  {len(by_trace)} groups ({calls} calls)"
                " matched by trace: group and sequence from the trace"
            )
        for entry in match.matching:
            mode = entry["mode"]
            if mode == "trace":
                continue
            how = "left unmatched" if mode == "unmatched" else f"matched by {mode}"
            out.append(
                f"  group {entry['group']!r}: {entry['calls']} calls {how} ({entry['reason']})"
            )
        if match.mixed:
            out.append(f"warning: {match.mixed} instances join calls of different kinds or sizes")
        if not match.ok:
            out.append(f"warning: {match.message()}")
        if self.missing_ranks:
            label = "partial recording" if "not recorded" in self.missing_ranks else "recording"
            out.append(f"{label}: {self.missing_ranks}")
        out.append(self.layout_text)
        return out


def set_up_graph(store: Store, run: str, *, declared: ParallelLayout | None = None) -> GraphSetup:
    """Build RUN's graph and give every rank its role and every group its axis, when they allow.

    One transaction: a refused command (a declared layout the run cannot hold, a rank without a
    timeline) leaves the store exactly as it was, graph rows included. A layout the groups do
    not fit is no refusal: the graph is kept and ``layout.error`` says why.

    Args:
        store: a writable store.
        run: a recorded run.
        declared: a layout the user states (``--layout``); it overrides the inferred one.
    """
    with store.transaction():
        if declared is not None:
            declare_layout(store, run, declared)
        report = build_graph(store, run)
        choice = choose_layout(store, run)
        copies: list[int] = []
        if choice.layout is not None:
            copies = symmetric_partners(choice.layout, list(report.ranks))[0].tolist()
        match = match_comms(store, run, copies=copies)
        if choice.layout is not None:
            try:
                # Checks every group before its first write, so a refusal leaves no half.
                assign_axes(store, run, choice.layout)
            except PrismError as exc:
                choice.error = str(exc).splitlines()[0]
                choice.layout = None
        ((world,),) = store.con.execute(
            "SELECT world_size FROM run WHERE run_id = ?", [report.run_id]
        ).fetchall()
    missing = missing_ranks(int(world or 0), list(report.ranks), choice.layout)
    return GraphSetup(report, match, choice, missing, choice.text())
