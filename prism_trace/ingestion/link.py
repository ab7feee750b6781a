"""Link the host execution-trace ops of one rank to the Kineto host events of the same rank.

Two keys, tried in order:

1. ``rf_id``: newer Kineto traces give every CPU op a ``Record function id`` equal to the ET node's
   ``rf_id`` (``events.rf_id``); a pair links when the ids are equal and the names agree.
2. Sequence, for Kineto traces without ``Record function id`` (older PyTorch, e.g. the PARAM DLRM
   and ResNet traces). Both traces list each thread's ops in start order: the ET by ``rf_id``,
   Kineto by ``External id`` (numbered per thread in start order), else by ``ts``. ET threads are
   paired with Kineto tracks by how many op names they share; then each pair's name sequences are
   aligned monotonically. The alignment is anchored at the first run of 8 (else 3) equal names;
   where that run occurs several times (one ET iteration, many Kineto iterations) the place with
   the longest exact run wins, then the nearest in id. It walks forward while names agree, skips
   the fewest ops on either side to re-sync after a mismatch, and re-anchors when no short skip
   re-syncs. Ops outside the other trace's window stay unlinked; no op or event links twice. This
   is what PARAM's old ``trace_link`` did (``exact_match``/``approximate_match`` of op-name
   sequences per iteration), done per thread and without an iteration annotation.

Only Kineto ``cpu_op`` and ``user_annotation`` events are candidates. ET-only nodes (the
``[pytorch|profiler|execution_...]`` process/thread roots and ``## process_group:init ##``) are not
linkable.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass

import polars as pl

from prism_trace.formats.host_et.comms import PG_INIT_NAME
from prism_trace.formats.host_et.reader import ET_ONLY_PREFIX

__all__ = ["HOST_CATEGORIES", "LinkReport", "link_et_to_kineto"]

HOST_CATEGORIES = ("cpu_op", "user_annotation")
"""Kineto event categories an ET node can correspond to."""

_ANCHORS = (8, 3)  # names in a row that anchor an alignment: tried long first
_RESYNC_WINDOW = 48  # most ops skipped (both sides together) to re-sync after a mismatch
_RESYNC_RUN = 3  # names in a row that confirm a re-sync
_ANCHOR_SCORE_CAP = 4096  # longest exact run measured when choosing among anchor candidates


@dataclass(frozen=True)
class LinkReport:
    """How many ET ops of one rank found their Kineto event, and by which key."""

    total: int
    """ET ops given."""
    linkable: int
    """Ops that should have a Kineto counterpart (all but ET-only roots and process-group init)."""
    linked: int
    """Ops linked to an event (``by_rf_id + by_sequence``)."""
    by_rf_id: int
    """Linked through ``rf_id`` = Kineto ``Record function id``."""
    by_sequence: int
    """Linked by aligning per-thread op-name sequences (Kineto without ``Record function id``)."""

    @property
    def linked_fraction(self) -> float:
        """``linked / linkable`` (1.0 when nothing is linkable)."""
        return self.linked / self.linkable if self.linkable else 1.0

    @property
    def linked_by(self) -> dict[str, int]:
        """Linked op counts per key."""
        return {"rf_id": self.by_rf_id, "sequence": self.by_sequence}


def link_et_to_kineto(
    et_ops: pl.DataFrame, events: pl.DataFrame
) -> tuple[pl.DataFrame, LinkReport]:
    """Fill ``et_ops.event_id`` with the Kineto event of each op, for one rank.

    Args:
        et_ops: the ``et_ops`` frame of one rank (``node_id``, ``name``, ``tid``, ``rf_id``, ...).
        events: the ``events`` frame of the same rank (``event_id``, ``name``, ``category``, ``ts``,
            ``external_id``, ``rf_id``, ``track_id``).

    Returns:
        ``et_ops`` with ``event_id`` set where linked (other rows keep their value, normally
        null), in the same row order, and a ``LinkReport``. Links are 1:1.
    """
    ops = et_ops.with_row_index("_row")
    linkable = ops.filter(
        ~pl.col("name").str.starts_with(ET_ONLY_PREFIX) & (pl.col("name") != PG_INIT_NAME)
    )
    host = _host_events(events)

    by_rf = _link_by_rf_id(linkable, host)
    linked_rows = set(by_rf["_row"].to_list())
    linked_events = set(by_rf["event_id"].to_list())

    rest_ops = linkable.filter(~pl.col("_row").is_in(list(linked_rows)))
    rest_events = host.filter(
        pl.col("rf_id").is_null() & ~pl.col("event_id").is_in(list(linked_events))
    )
    by_seq = _link_by_sequence(rest_ops, rest_events)

    links = pl.concat([by_rf, by_seq]).rename({"event_id": "_linked"})
    out = (
        ops.join(links, on="_row", how="left")
        .with_columns(pl.coalesce("_linked", "event_id").cast(pl.Int64).alias("event_id"))
        .sort("_row")
        .drop("_row", "_linked")
        .select(et_ops.columns)
    )
    report = LinkReport(
        total=et_ops.height,
        linkable=linkable.height,
        linked=by_rf.height + by_seq.height,
        by_rf_id=by_rf.height,
        by_sequence=by_seq.height,
    )
    return out, report


def _host_events(events: pl.DataFrame) -> pl.DataFrame:
    cols = {
        "event_id": pl.Int64,
        "name": pl.Utf8,
        "ts": pl.Int64,
        "external_id": pl.Int64,
        "rf_id": pl.Int64,
        "track_id": pl.Int64,
    }
    host = events.filter(pl.col("category").is_in(HOST_CATEGORIES)) if events.height else events
    return host.select(
        [
            (pl.col(c) if c in host.columns else pl.lit(None)).cast(t).alias(c)
            for c, t in cols.items()
        ]
    )


_EMPTY_LINKS = {"_row": pl.UInt32, "event_id": pl.Int64}


def _link_by_rf_id(ops: pl.DataFrame, host: pl.DataFrame) -> pl.DataFrame:
    keyed = host.filter(pl.col("rf_id").is_not_null())
    if keyed.is_empty():
        return pl.DataFrame(schema=_EMPTY_LINKS)
    # rf_ids are unique per process; keep one event per id should a trace repeat one.
    keyed = keyed.sort("ts", "event_id", nulls_last=True).unique("rf_id", keep="first")
    return (
        ops.filter(pl.col("rf_id").is_not_null())
        .select("_row", "rf_id", "name")
        .join(keyed.select("rf_id", "event_id", pl.col("name").alias("_k_name")), on="rf_id")
        .filter(pl.col("name") == pl.col("_k_name"))
        .select("_row", "event_id")
    )


def _link_by_sequence(ops: pl.DataFrame, host: pl.DataFrame) -> pl.DataFrame:
    if ops.is_empty() or host.is_empty():
        return pl.DataFrame(schema=_EMPTY_LINKS)
    et_threads = {
        key[0]: df.sort("rf_id", "node_id", nulls_last=True)
        for key, df in ops.with_columns(pl.col("tid").fill_null(-1)).group_by("tid")
    }
    k_tracks: dict[object, pl.DataFrame] = {}
    for key, df in host.with_columns(pl.col("track_id").fill_null(-1)).group_by("track_id"):
        by_ext = df["external_id"].null_count() == 0
        order = ["external_id", "ts", "event_id"] if by_ext else ["ts", "event_id"]
        k_tracks[key[0]] = df.sort(order, nulls_last=True)

    rows: list[int] = []
    event_ids: list[int] = []
    for tid, track in _pair_threads(et_threads, k_tracks):
        e, k = et_threads[tid], k_tracks[track]
        e_key = e["rf_id"].to_list()
        k_key = k["external_id"].to_list()
        pairs = _align(e["name"].to_list(), k["name"].to_list(), e_key, k_key)
        e_rows, k_ids = e["_row"].to_list(), k["event_id"].to_list()
        rows += [e_rows[i] for i, _ in pairs]
        event_ids += [k_ids[j] for _, j in pairs]
    return pl.DataFrame({"_row": rows, "event_id": event_ids}, schema=_EMPTY_LINKS)


def _pair_threads(
    et_threads: dict[object, pl.DataFrame], k_tracks: dict[object, pl.DataFrame]
) -> list[tuple[object, object]]:
    """Pair each ET thread with at most one Kineto track, most shared op names first."""
    e_counts = {t: Counter(df["name"].to_list()) for t, df in et_threads.items()}
    k_counts = {t: Counter(df["name"].to_list()) for t, df in k_tracks.items()}
    scores = sorted(
        (
            (sum((ec & kc).values()), str(et), str(kt), et, kt)
            for et, ec in e_counts.items()
            for kt, kc in k_counts.items()
        ),
        key=lambda s: (-s[0], s[1], s[2]),
    )
    used_e: set[object] = set()
    used_k: set[object] = set()
    pairs: list[tuple[object, object]] = []
    for score, _, _, et, kt in scores:
        if score == 0 or et in used_e or kt in used_k:
            continue
        used_e.add(et)
        used_k.add(kt)
        pairs.append((et, kt))
    return pairs


def _align(
    e: list[str], k: list[str], e_key: list[int | None], k_key: list[int | None]
) -> list[tuple[int, int]]:
    """Monotone 1:1 alignment of two name sequences; returns (e index, k index) pairs."""
    n, m = len(e), len(k)
    levels = sorted({min(g, n, m) for g in _ANCHORS} - {0}, reverse=True)
    starts: dict[int, dict[tuple[str, ...], list[int]]] = {}
    for g in levels:
        starts[g] = defaultdict(list)
        for q in range(m - g + 1):
            starts[g][tuple(k[q : q + g])].append(q)

    def run_length(i: int, j: int) -> int:
        r, cap = 0, min(n - i, m - j, _ANCHOR_SCORE_CAP)
        while r < cap and e[i + r] == k[j + r]:
            r += 1
        return r

    def anchor(i_from: int, j_from: int) -> tuple[int, int] | None:
        """First ET position whose next names occur in K at or after ``j_from``.

        Long runs of names are tried before short ones; of the places a run occurs, the one with
        the longest exact run wins, then the nearest in id, then the first.
        """
        for g in levels:
            for i in range(i_from, n - g + 1):
                qs = starts[g].get(tuple(e[i : i + g]))
                if not qs:
                    continue
                qs = qs[bisect_left(qs, j_from) :]
                if not qs:
                    continue
                ek = e_key[i]

                def rank(q: int, i: int = i, ek: int | None = ek) -> tuple[int, int, int]:
                    kk = k_key[q]
                    dist = abs(kk - ek) if kk is not None and ek is not None else 0
                    return (-run_length(i, q), dist, q)

                return i, min(qs, key=rank)
        return None

    def resync(i: int, j: int) -> tuple[int, int] | None:
        for s in range(1, _RESYNC_WINDOW + 1):
            for di in (0, s, *range(1, s)):
                dj = s - di
                a, b = i + di, j + dj
                if a >= n or b >= m:
                    continue
                run = min(_RESYNC_RUN, n - a, m - b)
                if e[a : a + run] == k[b : b + run]:
                    return a, b
        return None

    pairs: list[tuple[int, int]] = []
    at = anchor(0, 0)
    while at is not None:
        i, j = at
        while i < n and j < m:
            if e[i] == k[j]:
                pairs.append((i, j))
                i += 1
                j += 1
                continue
            nxt = resync(i, j)
            if nxt is None:
                break
            i, j = nxt
        if i >= n or j >= m:
            break
        at = anchor(i, j)
    return pairs
