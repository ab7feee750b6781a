"""Which ranks and iteration an analysis covers: parse ``--ranks``, check both against the run.

Every analysis takes ``ranks`` and ``iteration``; a selection that names nothing in the run is an
error with one line saying what the run has, so a typo never reads as "no waiting" or as the
whole run's numbers.
"""

from __future__ import annotations

from prism_trace.errors import SelectionError
from prism_trace.store.connection import Store

__all__ = ["check_selection", "describe_selection", "exemplar_hint"]


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5`` (at most a few spans, then a count)."""
    spans: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:  # type: ignore[operator]
            prev = v
        else:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    if start is not None:
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
    if len(spans) > 6:
        return ", ".join(spans[:6]) + f", ... ({len(values)} in all)"
    return ", ".join(spans)


def check_selection(
    store: Store, run: str, *, ranks: list[int] | None = None, iteration: int | None = None
) -> None:
    """Fail with one line when ``ranks`` or ``iteration`` name nothing in ``run``.

    Raises:
        RunNotFoundError: no run of that name.
        SelectionError: none of ``ranks`` is a rank of the run; the run has no iteration
            ``iteration``.
    """
    run_id = store.require_run(run)
    if ranks is not None:
        have = [
            r[0]
            for r in store.con.execute(
                "SELECT DISTINCT rank FROM rank WHERE run_id = ? AND list_contains(?, rank)"
                " ORDER BY rank",
                [run_id, list(ranks)],
            ).fetchall()
        ]
        if not have:
            all_ranks = [
                r[0]
                for r in store.con.execute(
                    "SELECT DISTINCT rank FROM rank WHERE run_id = ? ORDER BY rank", [run_id]
                ).fetchall()
            ]
            msg = (
                f"run {run!r} has none of ranks {_spans(sorted(ranks))}"
                f" (its ranks: {_spans(all_ranks) or 'none'})"
            )
            raise SelectionError(msg)
    if iteration is not None:
        its = [
            r[0]
            for r in store.con.execute(
                "SELECT DISTINCT iteration FROM iteration WHERE run_id = ? ORDER BY iteration",
                [run_id],
            ).fetchall()
        ]
        if iteration not in its:
            have_its = f"its iterations: {_spans(its)}" if its else "it has no iterations"
            msg = f"run {run!r} has no iteration {iteration} ({have_its})"
            raise SelectionError(msg)


def describe_selection(run: str, *, ranks: list[int] | None, iteration: int | None) -> str:
    """``run 'x', iteration 5, ranks 0-3``: what an empty result was asked about."""
    parts = [f"run {run!r}"]
    if iteration is not None:
        parts.append(f"iteration {iteration}")
    if ranks is not None:
        parts.append(f"ranks {_spans(sorted(ranks))}")
    return ", ".join(parts)


def exemplar_hint(store: Store, run: str, ranks: list[int] | None) -> str:
    """Why selected ranks of a sliced or emulated run have no rows: only class exemplars store
    events. ``" (ranks 6 stand for class exemplar 0 ...)"``, or ``""`` when that is not it."""
    if ranks is None:
        return ""
    run_id = store.require_run(run)
    rows = store.con.execute(
        "WITH ex AS (SELECT r.class_id, min(r.rank) AS exemplar FROM rank r"
        "  WHERE r.run_id = $1 AND r.class_id IS NOT NULL"
        "  AND EXISTS (SELECT 1 FROM event e WHERE e.run_id = r.run_id AND e.rank = r.rank)"
        "  GROUP BY r.class_id)"
        " SELECT DISTINCT ex.exemplar FROM rank r JOIN ex USING (class_id)"
        " WHERE r.run_id = $1 AND list_contains($2, r.rank)"
        " AND NOT EXISTS (SELECT 1 FROM event e WHERE e.run_id = r.run_id AND e.rank = r.rank)"
        " ORDER BY 1",
        [run_id, list(ranks)],
    ).fetchall()
    if not rows:
        return ""
    ex = _spans([r[0] for r in rows])
    return (
        f" (a sliced or emulated run stores events only for class exemplars: for these ranks,"
        f" ask for rank {ex})"
    )
