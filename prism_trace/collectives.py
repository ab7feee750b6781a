"""Cross-rank matching of communication: collective instances and send ↔ receive pairs.

A collective instance is ``(group_id, seq)``; it is whole when every member of the group recorded
it with one kind and one size. A missing member is a *mismatch* only when that rank was recorded in
the run at all: a run may hold a few ranks of a larger job, and then the others are simply absent.
A send ``(rank → peer, group, seq)`` pairs with the receive ``(peer ← rank, group, seq)``; an
unpaired side is a mismatch when both ranks were recorded. The SQL lives in the
``comm_mismatch`` and ``p2p_pair`` views (``schema.VIEWS``); this module runs it for one run.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from prism_trace import schema
from prism_trace.errors import CollectiveMismatchError
from prism_trace.store import Store

__all__ = ["CommMatchReport", "check_comms", "match_comms"]

_SHOW = 4  # ranks named in a one-line message before "..."


def _view_sql(name: str) -> str:
    for v in schema.VIEWS:
        if v.name == name:
            return v.sql
    msg = f"no view named {name!r}"
    raise KeyError(msg)


def _ranks(values: list[int] | None) -> str:
    if not values:
        return "[]"
    head = ", ".join(str(v) for v in values[:_SHOW])
    return f"[{head}, ...]" if len(values) > _SHOW else f"[{head}]"


@dataclass
class CommMatchReport:
    """How a run's communication matches across its ranks.

    Attributes:
        run: run name.
        run_id: its id.
        recorded_ranks: ranks the run holds.
        instances: collective instances (distinct ``(group_id, seq)``).
        complete: instances every member recorded with one kind and one size.
        problems: one row per instance that is not whole (the ``comm_mismatch`` view's columns,
            less ``run_id``), in (group_id, seq) order.
        p2p: one row per send ↔ receive pair or unpaired side (the ``p2p_pair`` view's columns,
            less ``run_id``, plus ``judged``: both ranks were recorded, and ``bytes_differ``).
    """

    run: str
    run_id: int
    recorded_ranks: list[int]
    instances: int
    complete: int
    problems: pl.DataFrame
    p2p: pl.DataFrame

    @property
    def mismatched(self) -> pl.DataFrame:
        """Instances that are inconsistent among recorded ranks."""
        return self.problems.filter(pl.col("mismatch"))

    @property
    def missing(self) -> pl.DataFrame:
        """Instances with absent members (recorded or not): group, seq, expected/present/missing."""
        return self.problems.filter(pl.col("missing_ranks").list.len() > 0).select(
            "group_id",
            "group_name",
            "seq",
            "expected_ranks",
            "present_ranks",
            "missing_ranks",
            "unrecorded_ranks",
        )

    @property
    def pairs(self) -> int:
        """Sends matched with their receive."""
        return int(self.p2p["paired"].sum()) if self.p2p.height else 0

    @property
    def unpaired(self) -> pl.DataFrame:
        """Sends or receives whose other side is not in the run."""
        return self.p2p.filter(~pl.col("paired"))

    @property
    def ok(self) -> bool:
        """No mismatch among recorded ranks (collectives and p2p)."""
        bad_p2p = self.p2p.filter((~pl.col("paired") & pl.col("judged")) | pl.col("bytes_differ"))
        return self.mismatched.is_empty() and bad_p2p.is_empty()

    def message(self) -> str | None:
        """A one-line description of the first mismatch, or None when there is none."""
        bad = self.mismatched
        if bad.height:
            row = bad.row(0, named=True)
            recorded = [r for r in row["missing_ranks"] if r not in row["unrecorded_ranks"]]
            parts = []
            if recorded:
                parts.append(f"ranks {_ranks(recorded)} missing")
            if row["extra_ranks"]:
                parts.append(f"ranks {_ranks(row['extra_ranks'])} not members")
            if row["odd_ranks"]:
                parts.append(
                    f"ranks {_ranks(row['odd_ranks'])} differ (kinds {row['kinds']},"
                    f" msg_bytes {row['sizes']})"
                )
            if not parts:
                parts.append(f"{len(row['present_ranks'])} participants, group size unmatched")
            more = f"; {bad.height - 1} more instances" if bad.height > 1 else ""
            return (
                f"run {self.run!r}: collective group {row['group_name']!r} seq {row['seq']}:"
                f" {', '.join(parts)} (present {_ranks(row['present_ranks'])}){more}"
            )
        bad_p2p = self.p2p.filter((~pl.col("paired") & pl.col("judged")) | pl.col("bytes_differ"))
        if bad_p2p.height:
            row = bad_p2p.row(0, named=True)
            what = (
                "sizes differ"
                if row["paired"]
                else ("receive missing" if row["send_event_id"] is not None else "send missing")
            )
            more = f"; {bad_p2p.height - 1} more" if bad_p2p.height > 1 else ""
            return (
                f"run {self.run!r}: p2p group {row['group_name']!r} seq {row['seq']}"
                f" rank {row['src_rank']} -> {row['dst_rank']}: {what}{more}"
            )
        return None

    def as_dict(self) -> dict[str, object]:
        """JSON-ready summary."""
        return {
            "run": self.run,
            "recorded_ranks": self.recorded_ranks,
            "instances": self.instances,
            "complete": self.complete,
            "incomplete": self.instances - self.complete,
            "mismatched": self.mismatched.height,
            "p2p_pairs": self.pairs,
            "p2p_unpaired": self.unpaired.height,
            "ok": self.ok,
            "message": self.message(),
        }


def match_comms(store: Store, run: str) -> CommMatchReport:
    """Match a run's collectives and p2p calls across its ranks.

    Args:
        store: an open store.
        run: the run name.

    Returns:
        The instances and pairs, with what is missing or inconsistent.

    Raises:
        PrismError: no such run.
    """
    from prism_trace.graph import run_id_of

    run_id = run_id_of(store, run)
    con = store.con
    recorded = [
        int(r[0])
        for r in con.execute(
            "SELECT rank FROM rank WHERE run_id = ? ORDER BY rank", [run_id]
        ).fetchall()
    ]
    counts = con.execute(
        f"""SELECT count(*), count(*) FILTER (WHERE m.seq IS NULL)
            FROM (SELECT DISTINCT group_id, seq FROM collective WHERE run_id = ?) i
            LEFT JOIN (SELECT group_id, seq FROM ({_view_sql("comm_mismatch")})
                       WHERE run_id = ?) m USING (group_id, seq)""",
        [run_id, run_id],
    ).fetchall()
    instances, complete = (int(v) for v in counts[0])
    problems = con.sql(
        f"SELECT * EXCLUDE (run_id) FROM ({_view_sql('comm_mismatch')}) WHERE run_id = $1"
        " ORDER BY group_id, seq",
        params=[run_id],
    ).pl()
    p2p = con.sql(
        f"""SELECT * EXCLUDE (run_id),
                   list_contains($2, src_rank) AND list_contains($2, dst_rank) AS judged,
                   coalesce(paired AND send_bytes <> recv_bytes, false) AS bytes_differ
            FROM ({_view_sql("p2p_pair")}) WHERE run_id = $1
            ORDER BY group_id NULLS FIRST, src_rank, dst_rank, seq""",
        params=[run_id, recorded],
    ).pl()
    return CommMatchReport(
        run=run,
        run_id=run_id,
        recorded_ranks=recorded,
        instances=instances,
        complete=complete,
        problems=problems,
        p2p=p2p,
    )


def check_comms(store: Store, run: str, *, partial_ok: bool = True) -> CommMatchReport:
    """Match a run's communication and fail on the first inconsistency.

    Args:
        store: an open store.
        run: the run name.
        partial_ok: accept instances whose only missing members were never recorded in the run
            (a partial recording); when false they fail too.

    Returns:
        The report, when everything matches.

    Raises:
        CollectiveMismatchError: a recorded rank is missing from a collective or disagrees on its
            kind or size, or a send/receive between recorded ranks is unpaired; the one-line
            message names the group, the sequence number and the ranks.
        PrismError: no such run.
    """
    report = match_comms(store, run)
    msg = report.message()
    if msg is not None:
        raise CollectiveMismatchError(msg)
    if not partial_ok and report.missing.height:
        row = report.missing.row(0, named=True)
        more = f"; {report.missing.height - 1} more instances" if report.missing.height > 1 else ""
        msg = (
            f"run {run!r}: collective group {row['group_name']!r} seq {row['seq']}:"
            f" ranks {_ranks(row['missing_ranks'])} missing (never recorded; present"
            f" {_ranks(row['present_ranks'])}){more}"
        )
        raise CollectiveMismatchError(msg)
    return report
