"""Cross-rank matching of communication: collective instances and send ↔ receive pairs.

A collective instance is ``(group_id, seq)``; it is whole when every member of the group recorded
it with one kind and one size. A missing member is a *mismatch* only when that rank was recorded in
the run at all: a run may hold a few ranks of a larger job, and then the others are simply absent.
A send ``(rank → peer, group, seq)`` pairs with the receive ``(peer ← rank, group, seq)``; an
unpaired side is a mismatch when both ranks were recorded. The SQL lives in the
``comm_mismatch`` and ``p2p_pair`` views (``store.views.VIEWS``); this module runs it for one run.

Matching is only as good as what the trace says. Group name and sequence number come from the
trace where it gives them (``record_param_comms`` args, the NCCL kernel's args, the host ET's
``pg_name``); otherwise each rank's calls of a group are numbered in order, and
``settle_order_matching`` keeps that numbering as cross-rank instances only where every recorded
member issued the same sequence of (kind, size). Where the sequences differ, pairing by order
would join unrelated calls (a 3 KB all-to-all with a 340 MB one), so each rank's calls of that
group move to a one-rank group of their own (description ``unmatched``): they are instances of
one, and the emulator runs them at that rank's recorded timing. How each group was matched is
stored in ``run.config_json`` (``comm_matching``) and shown by ``prism graph``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from prism_trace.errors import CollectiveMismatchError
from prism_trace.layout.symmetry import ranges
from prism_trace.store.connection import Store
from prism_trace.store.views import VIEWS

__all__ = [
    "SIZED_KINDS",
    "UNMATCHED",
    "CommMatchReport",
    "check_comms",
    "check_member_counts",
    "match_comms",
    "settle_order_matching",
]

SIZED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
"""Kinds whose every participant passes the same size: an instance of one mixes no sizes."""

_A2A_RATIO = 16
"""All-to-all sizes of one exchange may differ across ranks (uneven splits), by small factors; a
larger ratio means two different exchanges were paired."""

UNMATCHED = "unmatched"
"""``comm_group.description`` of the one-rank groups holding calls that could not be matched."""

_SHOW = 4  # ranks named in a one-line message before "..."


def _view_sql(name: str) -> str:
    for v in VIEWS:
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
        mixed: instances joining calls of different kinds, or of different sizes for a kind in
            ``SIZED_KINDS``: what an honest matching never makes.
        matching: how each group's instances were matched (``settle_order_matching``'s
            entries, from ``run.config_json``; empty for runs ingested before it existed).
    """

    run: str
    run_id: int
    recorded_ranks: list[int]
    instances: int
    complete: int
    problems: pl.DataFrame
    p2p: pl.DataFrame
    mixed: int = 0
    matching: list[dict[str, object]] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)

    @property
    def complete_with_copies(self) -> int:
        """Instances complete once the unrecorded TP/CP peers that copy a recorded partner
        (``copies``, see ``prism_trace.layout.symmetry``) count as present."""
        if not self.copies or self.problems.is_empty():
            return self.complete
        covered = self.problems.filter(
            ~pl.col("mismatch")
            & pl.col("missing_ranks").list.set_difference(pl.lit(self.copies)).list.len().eq(0)
            & pl.col("extra_ranks").list.len().eq(0)
            & pl.col("odd_ranks").list.len().eq(0)
        )
        return self.complete + covered.height

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
            "complete_with_copies": self.complete_with_copies,
            "mismatched": self.mismatched.height,
            "p2p_pairs": self.pairs,
            "p2p_unpaired": self.unpaired.height,
            "mixed": self.mixed,
            "matching": self.matching,
            "ok": self.ok,
            "message": self.message(),
        }


def match_comms(store: Store, run: str, *, copies: list[int] | None = None) -> CommMatchReport:
    """Match a run's collectives and p2p calls across its ranks.

    Args:
        store: an open store.
        run: the run name.
        copies: unrecorded ranks that copy a recorded TP/CP peer (for ``complete_with_copies``).

    Returns:
        The instances and pairs, with what is missing or inconsistent.

    Raises:
        RunNotFoundError: no such run.
    """
    from prism_trace.graph.build import run_id_of

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
    sized = ", ".join(f"'{k}'" for k in SIZED_KINDS)
    ((mixed,),) = con.execute(
        f"""SELECT count(*) FROM (
                SELECT group_id, seq FROM collective WHERE run_id = ? GROUP BY ALL
                HAVING count(DISTINCT kind) > 1
                    OR (min(kind) IN ({sized}) AND count(DISTINCT msg_bytes) > 1))""",
        [run_id],
    ).fetchall()
    (config,) = con.execute("SELECT config_json FROM run WHERE run_id = ?", [run_id]).fetchall()[0]
    try:
        matching = json.loads(config or "{}").get("comm_matching") or []
    except (ValueError, AttributeError):
        matching = []
    return CommMatchReport(
        mixed=int(mixed),
        matching=matching,
        copies=sorted(copies or []),
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
        RunNotFoundError: no such run.
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


def check_member_counts(calls: pl.DataFrame, groups: pl.DataFrame, paths: dict[int, Path]) -> None:
    """Refuse a file whose rank issues fewer collectives of a communicator than another member.

    For graph traces (Chakra ET) only, at ingest: such a file holds one whole iteration of its
    rank, and every member of a communicator issues each of its collectives, so the members given
    together must issue the same number. A file cut exactly at a record boundary is otherwise a
    valid, shorter graph; beside a whole file of another member of one of its groups it shows here.
    (Timed traces are not checked: their profiling windows may start and end at different calls.)

    Args:
        calls: collective rows of every rank (``rank``, ``group_name``).
        groups: the run's merged groups (``name``, ``ranks``: NULL when unknown).
        paths: the file of each rank to check.

    Raises:
        CollectiveMismatchError: one line naming the file with fewer calls, the group and counts.
    """
    if len(paths) < 2 or calls.is_empty():
        return
    counts = (
        calls.filter(pl.col("rank").is_in(list(paths)))
        .group_by("group_name", "rank")
        .len()
        .sort("group_name", "rank")
    )
    members = dict(zip(groups["name"].to_list(), groups["ranks"].to_list(), strict=True))
    per_group: dict[str, dict[int, int]] = {}
    for g, r, n in counts.iter_rows():
        per_group.setdefault(g, {})[int(r)] = int(n)
    for g, issued in sorted(per_group.items()):
        known = members.get(g)
        present = sorted(set(paths) & {int(x) for x in known}) if known else sorted(issued)
        if len(present) < 2:
            continue
        n_of = {r: issued.get(r, 0) for r in present}
        most = max(present, key=lambda r: (n_of[r], -r))
        least = min(present, key=lambda r: (n_of[r], r))
        if n_of[least] == n_of[most]:
            continue
        msg = (
            f"{paths[least]}: rank {least} issues {n_of[least]} collectives of process group"
            f" {g!r}, rank {most} ({paths[most].name}) issues {n_of[most]}: every member issues"
            " each one, so this file is cut short (truncated) or from another job"
        )
        raise CollectiveMismatchError(msg)


def _first_difference(calls: pl.DataFrame, expected: list[int]) -> str:
    """Where the order-numbered calls of one group stop agreeing across ranks, in words."""
    per = (
        calls.sort("rank")
        .group_by("seq")
        .agg(
            pl.col("rank"),
            pl.col("kind"),
            pl.col("msg_bytes"),
            (pl.col("kind").n_unique() > 1).alias("_kinds"),
            (pl.col("msg_bytes").n_unique() > 1).alias("_sizes"),
        )
        .sort("seq")
    )
    for row in per.iter_rows(named=True):
        absent = sorted(set(expected) - set(row["rank"]))
        sizes = [b for b in row["msg_bytes"] if b is not None]
        kind = row["kind"][0]
        odd_size = row["_sizes"] and (
            kind in SIZED_KINDS
            or (kind == "all_to_all" and sizes and max(sizes) > min(sizes) * _A2A_RATIO)
        )
        if row["_kinds"] or odd_size:
            a = (row["rank"][0], row["kind"][0], row["msg_bytes"][0])
            j = next(
                i
                for i in range(len(row["rank"]))
                if (row["kind"][i], row["msg_bytes"][i]) != (a[1], a[2])
            )
            b = (row["rank"][j], row["kind"][j], row["msg_bytes"][j])
            return f"call {row['seq']}: rank {a[0]} {a[1]} {a[2]} B, rank {b[0]} {b[1]} {b[2]} B"
        if absent:
            return f"call {row['seq']}: ranks {_ranks(absent)} issue fewer calls"
    return "the ranks issue different numbers of calls"


def settle_order_matching(
    calls: pl.DataFrame, groups: pl.DataFrame, recorded: list[int]
) -> tuple[pl.DataFrame, pl.DataFrame, list[dict[str, object]]]:
    """Keep order-numbered collectives as instances only where the ranks' sequences agree.

    Args:
        calls: collective rows of every rank (``group_name``, ``seq``, ``kind``, ``msg_bytes``,
            ``host_ts``, ``seq_by_order``: the trace gave no sequence number).
        groups: the run's groups (``group_id, name, description, backend, size, ranks``).
        recorded: the recorded ranks.

    Returns:
        The calls (unmatched ones renamed to their rank's one-rank group, ``seq_by_order``
        dropped), the groups with those one-rank groups appended, and one entry per group that
        calls use: ``group``, ``mode`` (``trace``: group and sequence from the trace; ``order``:
        numbered in order, every recorded member issued the same kinds and sizes;
        ``unmatched``), ``calls``, ``ranks`` (compact ranges: ``0..7``) and ``reason``.
    """
    if calls.is_empty():
        return calls.drop("seq_by_order", strict=False), groups, []
    if "seq_by_order" not in calls.columns:
        calls = calls.with_columns(seq_by_order=pl.lit(value=False))
    members = dict(zip(groups["name"].to_list(), groups["ranks"].to_list(), strict=True))
    recorded_set = set(recorded)
    stats = (
        calls.group_by("group_name")
        .agg(
            pl.col("seq_by_order").any().alias("ordered"),
            pl.len().alias("n"),
            pl.col("rank").unique().sort().alias("ranks"),
        )
        .sort("group_name")
    )
    sized = pl.col("kind").first().is_in(list(SIZED_KINDS))
    lo, hi = pl.col("msg_bytes").min(), pl.col("msg_bytes").max()
    per_call = (
        calls.filter(pl.col("seq_by_order"))
        .group_by("group_name", "seq")
        .agg(
            pl.col("rank").unique().sort().alias("issued"),
            (
                (pl.col("kind").n_unique() == 1)
                & pl.when(sized)
                .then(pl.col("msg_bytes").n_unique() == 1)
                .when(pl.col("kind").first() == "all_to_all")
                .then((hi <= lo * _A2A_RATIO).fill_null(value=True))
                .otherwise(pl.lit(value=True))
            ).alias("same"),
        )
    )
    matching: list[dict[str, object]] = []
    unmatched: list[str] = []
    for row in stats.iter_rows(named=True):
        name, issuing = row["group_name"], [int(r) for r in row["ranks"]]
        entry: dict[str, object] = {"group": name, "calls": int(row["n"]), "ranks": ranges(issuing)}
        if not row["ordered"]:
            how = "group and sequence from the trace"
            matching.append({**entry, "mode": "trace", "reason": how})
            continue
        known = members.get(name)
        expected = sorted(recorded_set & set(known)) if known else issuing
        mine = per_call.filter(pl.col("group_name").eq_missing(name))
        agree = bool(mine["same"].all()) and all(
            set(expected) <= set(r) for r in mine["issued"].to_list()
        )
        if agree:
            how = (
                "one recorded rank: numbered in order"
                if len(expected) <= 1
                else f"numbered in order; kinds and sizes agree on ranks {_ranks(expected)}"
            )
            matching.append({**entry, "mode": "order", "reason": how})
            continue
        diff = _first_difference(
            calls.filter(pl.col("group_name").eq_missing(name) & pl.col("seq_by_order")), expected
        )
        matching.append(
            {
                **entry,
                "mode": UNMATCHED,
                "reason": f"no sequence numbers in the trace and the ranks disagree ({diff});"
                " each rank's calls run at its recorded timing",
            }
        )
        unmatched.append(name)
    if not unmatched:
        return calls.drop("seq_by_order"), groups, matching
    lone = pl.col("group_name").is_in(unmatched)
    private = pl.format("{}/{}/{}", pl.col("group_name"), pl.lit(UNMATCHED), pl.col("rank"))
    calls = calls.with_columns(
        group_name=pl.when(lone).then(private).otherwise(pl.col("group_name"))
    ).drop("seq_by_order")
    backend = dict(zip(groups["name"].to_list(), groups["backend"].to_list(), strict=True))
    new = (
        calls.filter(pl.col("group_name").str.contains(f"/{UNMATCHED}/", literal=True))
        .group_by("group_name")
        .agg(pl.col("rank").first())
        .sort("group_name")
    )
    top = groups["group_id"].max() if groups.height else None
    start = 0 if top is None else int(top) + 1  # type: ignore[arg-type]
    extra = pl.DataFrame(
        {
            "group_id": list(range(start, start + new.height)),
            "name": new["group_name"].to_list(),
            "description": [UNMATCHED] * new.height,
            "backend": [backend.get(n.rsplit("/", 2)[0]) for n in new["group_name"].to_list()],
            "size": [1] * new.height,
            "ranks": [[int(r)] for r in new["rank"].to_list()],
        },
        schema={
            "group_id": groups.schema["group_id"],
            "name": pl.Utf8,
            "description": pl.Utf8,
            "backend": pl.Utf8,
            "size": groups.schema["size"],
            "ranks": groups.schema["ranks"],
        },
    )
    return calls, pl.concat([groups, extra.select(groups.columns)], how="vertical"), matching
