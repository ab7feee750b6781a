"""A prediction against a recording at its scale: structure, step times, waits, memory.

``compare_runs`` reads two runs of the store (the prediction may be several runs, one per seed of
a variance emulation) and compares them the way `prism predict` and `prism report --compare`
show: the structure of one step per role (``structure``), the per-rank step times with their
KS distance (``steps``), the mean wait per collective kind and per rank the communication time,
wait and peak memory (``ranks``). Pure queries: nothing is written. See docs/predict.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prism_trace.analysis.prediction.ranks import (
    KindWait,
    RankFigures,
    kind_waits,
    rank_figures,
    summary_errors,
)
from prism_trace.analysis.prediction.sides import RunSide, common_iterations, run_side
from prism_trace.analysis.prediction.steps import StepTimes, step_times
from prism_trace.analysis.prediction.structure import StructureComparison, compare_structure
from prism_trace.analysis.prediction.text import (
    ranks_text,
    steps_text,
    structure_text,
    waits_text,
)

from prism_trace.errors import RunStateError, UsageError
from prism_trace.store.connection import Store

__all__ = ["RunComparison", "compare_replayed", "compare_runs"]


@dataclass
class RunComparison:
    """What ``compare_runs`` found; ``summary`` is its text, ``as_dict`` its JSON.

    Attributes:
        predicted: the predicted runs (several: one per seed, pooled).
        predicted_kind: their kind (``emulated``, ``replayed``, ...).
        recorded: the recording compared with.
        world_size: ranks in both worlds.
        structure: one step's ops, collectives and p2p per role.
        steps: per-rank step times.
        waits: mean wait per collective kind and group axis.
        ranks: per rank, communication time, wait and peak memory.
        notes: what was left out, and why.
    """

    predicted: list[str]
    predicted_kind: str
    recorded: str
    world_size: int
    structure: StructureComparison
    steps: StepTimes
    waits: list[KindWait]
    ranks: list[RankFigures]
    notes: list[str] = field(default_factory=list)

    @property
    def rank_errors(self) -> dict[str, float | None]:
        """Mean and largest ``|error|`` over the ranks of communication time, wait and peak
        memory, percent."""
        return summary_errors(self.ranks)

    def as_dict(self) -> dict[str, Any]:
        """Every figure, JSON-ready."""
        return {
            "predicted": self.predicted,
            "predicted_kind": self.predicted_kind,
            "recorded": self.recorded,
            "world_size": self.world_size,
            "structure": self.structure.as_dict(),
            "step_time": self.steps.as_dict(),
            "waits": [w.as_dict() for w in self.waits],
            "rank_errors": self.rank_errors,
            "ranks": [r.as_dict() for r in self.ranks],
            "notes": self.notes + self.structure.notes,
        }

    def summary(self) -> str:
        """The readable form: a few tables, the notes last."""
        runs = ", ".join(repr(n) for n in self.predicted[:2])
        if len(self.predicted) > 2:
            runs += f" and {len(self.predicted) - 2} more"
        parts = [
            f"prediction {runs} ({self.predicted_kind}) against the recording"
            f" {self.recorded!r} ({self.world_size} ranks)",
            *steps_text(self.steps, len(self.predicted)),
            *structure_text(self.structure),
            *waits_text(self.waits),
            *ranks_text(self.ranks, self.rank_errors),
        ]
        parts += [f"note: {n}" for n in self.notes + self.structure.notes]
        return "\n".join(parts)


def _variance_runs(store: Store, sides: Sequence[RunSide]) -> bool:
    """Whether any of the runs was emulated with the variance what-if."""
    rows = store.con.execute(
        "SELECT count(*) FROM run WHERE list_contains(?, run_id) AND TRY_CAST(json_extract("
        "config_json, '$.config.what_if.variance') AS BOOLEAN)",
        [[s.run_id for s in sides]],
    ).fetchall()
    return bool(rows[0][0])


def _check(predicted: Sequence[RunSide], recorded: RunSide, store: Store) -> None:
    """Refuse what cannot be compared (the messages name the run)."""
    where = store.path
    if recorded.kind != "recorded":
        msg = (
            f"{where}: run {recorded.name!r} is {recorded.kind}; a prediction is compared with"
            " a recording"
        )
        raise RunStateError(msg)
    kinds = {s.kind for s in predicted}
    for side in predicted:
        if side.run_id == recorded.run_id:
            msg = f"{where}: run {side.name!r} is the recording itself"
            raise UsageError(msg)
        if side.kind == "sliced":
            msg = (
                f"{where}: run {side.name!r} is sliced and holds no timing; emulate it first"
                " (`prism emulate`) or use `prism predict`"
            )
            raise RunStateError(msg)
        if side.world_size != recorded.world_size:
            msg = (
                f"{where}: run {side.name!r} has {side.world_size} ranks and the recording"
                f" {recorded.name!r} {recorded.world_size}; compare runs of one world size"
            )
            raise UsageError(msg)
    if len(kinds) > 1:
        msg = f"{where}: the predicted runs are of different kinds ({', '.join(sorted(kinds))})"
        raise UsageError(msg)


def compare_runs(
    store: Store,
    predicted: str | Sequence[str],
    recorded: str,
    *,
    warmup: int = 1,
    listed: int = 3,
) -> RunComparison:
    """Compare a prediction with a recording of the same world.

    Args:
        store: an open store (read-only is fine).
        predicted: the predicted run, or several (one per seed of a variance emulation: their
            step times pool into one sample, their per-rank figures are averaged, the structure
            is the first one's).
        recorded: a recorded run of the same world size.
        warmup: steps in common left out at the start (while at least one remains).
        listed: differences of the structure listed in words per role.

    Returns:
        The comparison.

    Raises:
        PrismError: no such run, a recording that is not one, a sliced run (no timing), runs
            of different world sizes or kinds.
    """
    names = [predicted] if isinstance(predicted, str) else list(predicted)
    if not names:
        msg = "compare_runs: no predicted run"
        raise UsageError(msg)
    pred = [run_side(store, n) for n in names]
    rec = run_side(store, recorded)
    _check(pred, rec, store)
    iterations, left_out = common_iterations(store, pred, rec, warmup)
    notes: list[str] = []
    if not iterations:
        notes.append(f"no step in common between {names[0]!r} and {recorded!r}")
    if pred[0].with_events:
        structure = compare_structure(
            store, pred[0], rec, iterations[0] if iterations else None, listed=listed
        )
    else:
        structure = StructureComparison(
            None,
            [],
            ops_compared=False,
            notes=[f"structure: {names[0]!r} holds no ops (only step times)"],
        )
    drawn = _variance_runs(store, pred)
    if drawn:
        notes.append(
            "waits per collective kind: from the class exemplars' calls, which miss the waits"
            " the variance draws of other replicas cause (n/a where a kind's calls have no"
            " other exemplar); the per-rank wait (rank_step) has them"
        )
    return RunComparison(
        predicted=names,
        predicted_kind=pred[0].kind,
        recorded=recorded,
        world_size=rec.world_size,
        structure=structure,
        steps=step_times(store, pred, rec, iterations, left_out),
        waits=kind_waits(store, pred, rec, iterations, drawn=drawn),
        ranks=rank_figures(store, pred, rec, iterations),
        notes=notes,
    )


def compare_replayed(
    store: Store, replayed: str, recorded: str, *, warmup: int = 1
) -> RunComparison:
    """Compare a replayed run (`prism run --world N --out-run R`, real ranks against virtual
    peers) with the recording at its scale: what it holds, its ranks' step times (and memory,
    when it has some).

    Raises:
        PrismError: ``replayed`` is not a replayed run, or what ``compare_runs`` refuses.
    """
    kind = run_side(store, replayed).kind
    if kind != "replayed":
        msg = f"{store.path}: run {replayed!r} is {kind}; --replayed takes a replayed run"
        raise RunStateError(msg)
    return compare_runs(store, replayed, recorded, warmup=warmup)
