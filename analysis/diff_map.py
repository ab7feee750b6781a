"""Which rank and iteration of one run a diff compares with which of the other.

Why: two recordings a user compares are often not of the same rank or the same steps: a control
job traced on rank 3 and a test job traced on rank 1, or a profiler schedule that kept steps
10-12 in one job and 3-5 in the other. Matching by global rank and step number found nothing in
common ("share no (rank, iteration)"). A diff takes a map (``--map 3:1``: rank 3 of the run
with rank 1 of the other; ``--map-iterations 10:3,11:4``), and without one pairs what can only
be paired one way: the one rank of each run, and the steps in order when no step number is
shared. Each pairing it makes itself is said in the diff's notes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import polars as pl

from prism_trace.errors import UsageError

__all__ = ["DiffMap", "parse_pairs", "resolve_map"]

_PAIR = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_pairs(text: str, what: str = "rank") -> dict[int, int]:
    """``"3:1"`` or ``"3:1,2:0"`` -> ``{3: 1, 2: 0}`` (this run's -> the other run's).

    Raises:
        UsageError: a part that is not ``A:B`` of whole numbers, or a number mapped twice.
    """
    out: dict[int, int] = {}
    for part in text.split(","):
        m = _PAIR.match(part)
        if m is None:
            msg = (
                f"--map{'' if what == 'rank' else '-iterations'} {text!r}: {part.strip()!r} is not"
                f" A:B ({what} A of the run compared with {what} B of --compare), e.g. 3:1"
            )
            raise UsageError(msg)
        a, b = int(m[1]), int(m[2])
        if a in out or b in out.values():
            msg = f"--map {text!r}: {what} {a if a in out else b} is mapped twice"
            raise UsageError(msg)
        out[a] = b
    return out


@dataclass
class DiffMap:
    """The pairs a diff compares: ``ranks`` and ``iterations`` map the reference run's to the
    other's (None: by equal numbers), with a note for each pairing made without being asked."""

    ranks: dict[int, int] | None = None
    iterations: dict[int, int] | None = None
    notes: list[str] = field(default_factory=list)

    def to_a(self, frame: pl.DataFrame, *, rank: bool = True) -> pl.DataFrame:
        """``frame`` (the other run's rows) in the reference run's ranks and iterations: rows
        the maps leave out are dropped; ``rank_b``/``iteration_b`` keep the other's numbers."""
        out = frame
        if rank and self.ranks is not None:
            back = {b: a for a, b in self.ranks.items()}
            out = out.filter(pl.col("rank").is_in(list(back))).with_columns(
                pl.col("rank").alias("rank_b"),
                pl.col("rank").replace_strict(back, return_dtype=out.schema["rank"]),
            )
        if self.iterations is not None and "iteration" in out.columns:
            back_i = {b: a for a, b in self.iterations.items()}
            out = out.filter(pl.col("iteration").is_in(list(back_i))).with_columns(
                pl.col("iteration").alias("iteration_b"),
                pl.col("iteration").replace_strict(back_i, return_dtype=out.schema["iteration"]),
            )
        return out

    def keep_a(self, frame: pl.DataFrame) -> pl.DataFrame:
        """The reference run's rows the maps compare."""
        out = frame
        if self.ranks is not None:
            out = out.filter(pl.col("rank").is_in(list(self.ranks)))
        if self.iterations is not None and "iteration" in out.columns:
            out = out.filter(pl.col("iteration").is_in(list(self.iterations)))
        return out


def _range(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


def resolve_map(
    it_a: pl.DataFrame,
    it_b: pl.DataFrame,
    *,
    ranks: dict[int, int] | None,
    iterations: dict[int, int] | None,
) -> DiffMap:
    """The pairs to compare, from the maps given and the runs' ``(rank, iteration)`` rows.

    Without a rank map, runs of one rank each whose ranks differ are paired; without an
    iteration map, runs that share no step number (once the ranks are paired) pair their steps
    in order, as many as the shorter has.

    Raises:
        UsageError: a mapped rank or iteration that its run does not have.
    """
    out = DiffMap(ranks=ranks, iterations=iterations)
    ranks_a = sorted(set(it_a["rank"].to_list()))
    ranks_b = sorted(set(it_b["rank"].to_list()))
    for side, given, have in (
        ("run", list((ranks or {}).keys()), ranks_a),
        ("--compare run", list((ranks or {}).values()), ranks_b),
    ):
        missing = sorted(set(given) - set(have))
        if missing:
            msg = f"--map: the {side} has no steps on rank {missing[0]} (it has {have})"
            raise UsageError(msg)
    if ranks is None and not set(ranks_a) & set(ranks_b) and len(ranks_a) == len(ranks_b) == 1:
        out.ranks = {ranks_a[0]: ranks_b[0]}
        out.notes.append(
            f"rank {ranks_a[0]} compared with rank {ranks_b[0]} (the one rank of each run;"
            " --map A:B pairs others)"
        )
    if iterations is None:
        keys_a = out.keep_a(it_a).select("rank", "iteration")
        keys_b = out.to_a(it_b).select("rank", "iteration")
        if keys_a.join(keys_b, on=["rank", "iteration"], how="inner").is_empty():
            steps_a = sorted(set(keys_a["iteration"].to_list()))
            steps_b = sorted(set(out.to_a(it_b)["iteration"].to_list()))
            n = min(len(steps_a), len(steps_b))
            if n:
                out.iterations = dict(zip(steps_a[:n], steps_b[:n], strict=True))
                out.notes.append(
                    f"iterations {_range(steps_a[:n])} compared with {_range(steps_b[:n])}"
                    " in order (no step number in common; --map-iterations A:B pairs others)"
                )
    return out
