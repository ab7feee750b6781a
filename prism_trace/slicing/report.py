"""What ``slice_run`` wrote: the mapping from recorded ranks to target ranks, as text and JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.plan import SliceClass

__all__ = ["SliceReport", "one_member_note"]


@dataclass
class SliceReport:
    """What ``slice_run`` wrote: enough for the CLI to print and for tests to assert."""

    run: str
    run_id: int
    parent_run: str
    parent_run_id: int
    recorded_layout: ParallelLayout
    layout: ParallelLayout
    world_size: int
    classes: list[SliceClass]
    groups: int
    nodes: int
    edges: int
    rescaled: dict[str, int] = field(default_factory=dict)
    other_ops: list[str] = field(default_factory=list)
    """Names of comm ops that fell under the ``other`` rule (kept unchanged)."""
    built_graph: bool = False
    elapsed_s: float = 0.0
    microbatches: dict[str, Any] = field(default_factory=dict)
    """``global_batch``, and with it the recorded and target microbatches and the schedule."""
    member_runs: int = 0
    """Runs of per-member ops (``members``) repeated or dropped to their group's target size."""
    dp_from_one_member: bool = False
    """The target's data-parallel calls grow from a dp=1 recording's one-member group."""

    @property
    def mapping(self) -> dict[int, str]:
        """Recorded rank → the target ranks it represents, compactly (``; `` between classes)."""
        out: dict[int, list[str]] = {}
        for c in sorted(self.classes, key=lambda c: c.exemplar):
            out.setdefault(c.representative, []).append(c.ranks)
        return {k: "; ".join(v) for k, v in out.items()}

    @property
    def notes(self) -> list[str]:
        """Classes whose representative is a symmetric TP/CP peer, one line each; a dp grown
        from one-member groups, and what that leaves to the models."""
        notes = [
            f"rank {c.representative} stands in for tp={c.tp}, cp={c.cp} (pp={c.pp}, ep={c.ep}):"
            " no recorded rank has that coordinate; its TP/CP peers run the same program"
            for c in self.classes
            if c.symmetric
        ]
        if self.dp_from_one_member:
            notes.append(one_member_note(self.layout.dp))
        return notes

    def summary(self) -> str:
        """The mapping report as text: which recorded rank stands for which target ranks."""
        lines = [
            f"run {self.run!r} (sliced from {self.parent_run!r}): {self.world_size} ranks,"
            f" layout {self.layout.spec} (order {self.layout.order_spec}),"
            f" {len(self.classes)} classes, {self.groups} groups,"
            f" {self.nodes} nodes / {self.edges} edges stored, {self.elapsed_s:.2f} s",
            "recorded rank -> target ranks:",
        ]
        lines += [f"  {rep:>6} -> {ranks}" for rep, ranks in self.mapping.items()]
        lines += [f"  note: {n}" for n in self.notes]
        mb = self.microbatches.get("microbatches")
        if mb:
            lines.append(
                f"microbatches per rank and step: {mb['recorded']} -> {mb['target']}"
                f" ({mb['schedule']}"
                + (f" of {mb['chunks']} chunks a stage" if mb.get("chunks") else "")
                + f", global batch {self.microbatches['global_batch']})"
            )
        if self.member_runs:
            lines.append(
                f"per-member ops of list collectives: {self.member_runs} runs rescaled to the"
                " target group sizes"
            )
        if self.rescaled:
            rules = ", ".join(f"{k} {v}" for k, v in sorted(self.rescaled.items()))
            lines.append(f"communication ops by size rule: {rules}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``--json``)."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "parent_run": self.parent_run,
            "parent_run_id": self.parent_run_id,
            "recorded_layout": self.recorded_layout.spec,
            "recorded_order": self.recorded_layout.order_spec,
            "layout": self.layout.spec,
            "order": self.layout.order_spec,
            "world_size": self.world_size,
            "classes": [c.as_dict() for c in self.classes],
            "mapping": {str(k): v for k, v in self.mapping.items()},
            "notes": self.notes,
            "groups": self.groups,
            "nodes": self.nodes,
            "edges": self.edges,
            "rescaled": self.rescaled,
            "other_ops": self.other_ops,
            "built_graph": self.built_graph,
            "member_runs": self.member_runs,
            "elapsed_s": round(self.elapsed_s, 3),
            **self.microbatches,
        }


def one_member_note(dp: int) -> str:
    """What a dp grown from one-member data-parallel groups leaves to the models: said by the
    slice, and again by every emulation and prediction of it
    (``config_json.dp_from_one_member``)."""
    return (
        f"dp={dp} grows from the recording's one-member data-parallel calls: their transfer at"
        " the target is the network model's alone (nothing to scale), and no other replica's"
        " speed was recorded (replicas differ only by what a variance mode draws from the"
        " recorded one)"
    )
