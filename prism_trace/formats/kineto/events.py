"""The model of a Kineto file's events in its work database: tracks, events with their ids and
nesting, the records later stages keep (memory, flow points, args), and each event's iteration."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import polars as pl

from prism_trace.errors import TraceFormatError
from prism_trace.formats.kineto.sql import _LAUNCH_CATEGORIES, ARG_ROW_SQL, track_sql
from prism_trace.formats.kineto.work import _short, _Work
from prism_trace.formats.nesting import innermost_enclosing, nest_events

__all__: list[str] = []

_DEVICE_CATEGORIES = ("kernel", "memcpy", "memset", "gpu_user_annotation", "cuda_sync")
# Events nested at a time (``_Reader.quiet_slices``): a slice's working arrays take a few hundred
# bytes an event.
_NEST_ROWS = 1 << 18


class _Events(_Work):
    """The tracks, events and iterations stage of the reader (``reader._Reader``)."""

    def build_tracks(self) -> None:
        """One track per (pid, tid): a ``stream`` if it holds device events, else a ``thread``."""
        device = ", ".join(f"'{c}'" for c in _DEVICE_CATEGORIES)
        self.sql(track_sql(device))

    def build_events(self) -> None:
        """``ev``: the timed events with their ids, track, nesting and typed columns (no args)."""
        self.sql(
            """CREATE TABLE ev_base AS
               SELECT e.ord, t.track_id, t.kind = 'stream' AS on_device, e.category, e.name,
                      e.ts, e.dur, e.correlation, e.external_id, e.rf_id
               FROM ev0 e JOIN track t ON t.pid = e.pid AND t.tid_text = e.tid"""
        )
        self.sql("DROP VIEW ev0")
        self.event_ids()
        self.sql(
            """CREATE TABLE ev AS
               SELECT i.event_id, b.*, i.parent_id, i.depth
               FROM ev_base b JOIN ev_id i USING (ord)"""
        )
        for name in ("ev_base", "ev_id", "ev_order") if self.free else ():
            self.sql(f"DROP TABLE {name}")
        self.sql("CREATE VIEW eva AS SELECT ev.*, a.args FROM ev JOIN arg_row a USING (ord)")

    def event_ids(self) -> None:
        """``ev_id``: each event's ``event_id``, ``parent_id`` and ``depth``, by ``ord``.

        ``event_id`` is the rank in (track, ts, -dur, ord) order: the rowid of ``ev_order``, the
        events' keys sorted by DuckDB (a CREATE TABLE AS keeps its ORDER BY). Nesting runs in
        polars on one slice of ``ev_order`` at a time (``slices``): whole tracks up to
        ``_NEST_ROWS`` events together, or part of a long track between two instants when
        nothing is open (``quiet_slices``), so its working arrays (a few hundred bytes an event)
        stay those of a slice, however large the trace. The fwd-bwd flow points of a slice are
        bound to their enclosing events meanwhile (``flows``), so the nested spans need not
        outlive their slice.
        """
        self.sql(
            """CREATE TABLE ev_order AS
               SELECT ord, track_id, ts, dur, category = 'instant' AS instant FROM ev_base
               ORDER BY track_id, ts, dur DESC, ord"""
        )
        self.sql(
            "CREATE TABLE ev_id (ord BIGINT, event_id BIGINT, parent_id BIGINT, depth INTEGER)"
        )
        points = self.frame("SELECT id, ph, track_id, ts FROM flow_point")
        bound: list[pl.DataFrame] = []
        for lo, hi, tracks, t_lo, t_hi in self.slices():
            rows = self.frame(
                "SELECT rowid AS event_id, ord, track_id, ts, dur, instant FROM ev_order"
                f" WHERE rowid >= {lo} AND rowid < {hi}"
            )
            spans = rows.filter(~pl.col("instant")).select("event_id", "track_id", "ts", "dur")
            nested = nest_events(spans)
            ids = rows.select("ord", "event_id").join(
                nested.select("event_id", "parent_id", "depth"), on="event_id", how="left"
            )
            self.con.register("_slice_ids", ids)
            try:
                self.sql("INSERT INTO ev_id BY NAME SELECT * FROM _slice_ids")
            finally:
                self.con.unregister("_slice_ids")
            here = points.filter(
                pl.col("track_id").is_in(tracks),
                pl.lit(value=True) if t_lo is None else pl.col("ts") >= t_lo,
                pl.lit(value=True) if t_hi is None else pl.col("ts") < t_hi,
            )
            if here.height:
                bound.append(
                    here.select("id", "ph", innermost_enclosing(nested, here).alias("event_id"))
                )
            del rows, spans, nested, ids
        self.bound = (
            pl.concat(bound)
            if bound
            else points.select("id", "ph", event_id=pl.lit(None, pl.Int64))
        )

    def slices(self) -> Iterator[tuple[int, int, list[int], int | None, int | None]]:
        """Rows of ``ev_order`` to nest at a time: ``(lo, hi, tracks, t_lo, t_hi)``.

        Consecutive short tracks go together up to ``_NEST_ROWS`` events (nesting is per track
        anyway, and one call per track would cost more than the nesting of a small file); a
        longer track is cut by ``quiet_slices``. ``t_lo``/``t_hi`` bound the times of the flow
        points to bind in a slice of one track (None: unbounded).
        """
        group: list[int] = []
        lo = at = 0
        for track, n in self.rows(
            "SELECT track_id, count(*) FROM ev_order GROUP BY track_id ORDER BY track_id"
        ):
            if group and (n > _NEST_ROWS or at + n - lo > _NEST_ROWS):
                yield lo, at, group, None, None
                group, lo = [], at
            if n > _NEST_ROWS:
                for a, b, t_lo, t_hi in self.quiet_slices(at, at + n):
                    yield a, b, [track], t_lo, t_hi
                lo = at + n
            else:
                group.append(track)
            at += n
        if group:
            yield lo, at, group, None, None

    def quiet_slices(self, lo: int, hi: int) -> list[tuple[int, int, int | None, int | None]]:
        """Cut rows ``[lo, hi)`` of ``ev_order`` (one track) where every earlier span has ended.

        A cut is made before an event that starts after every span before it has ended
        (strictly: an event ending at a point still encloses it), so nothing before it encloses
        anything from there on, and nesting each slice alone gives what nesting the whole track
        does (a parent is open when its child starts). Slices are at least ``_NEST_ROWS`` long
        where the track allows. Returns ``(lo, hi, t_lo, t_hi)``: the rows, and the times
        (None: unbounded) a flow point must have to look for its event in the slice.
        """
        if hi - lo <= _NEST_ROWS:
            return [(lo, hi, None, None)]
        keys = self.con.sql(
            "SELECT ts, CASE WHEN instant THEN NULL ELSE ts + dur END AS end_ts FROM ev_order"
            f" WHERE rowid >= {lo} AND rowid < {hi}"
        ).pl()
        ts = keys["ts"].to_numpy()
        ends = keys["end_ts"].fill_null(np.iinfo(np.int64).min).to_numpy()
        del keys
        # Row i may start a slice when every span before it has ended before its start.
        ok = np.flatnonzero(np.maximum.accumulate(ends)[:-1] < ts[1:]) + 1
        cuts: list[int] = []
        at = _NEST_ROWS
        while (k := int(np.searchsorted(ok, at))) < len(ok):
            cuts.append(int(ok[k]))
            at = int(ok[k]) + _NEST_ROWS
        bounds = [0, *cuts, hi - lo]
        times = [None, *(int(ts[c]) for c in cuts), None]
        return [
            (lo + a, lo + b, times[k], times[k + 1])
            for k, (a, b) in enumerate(itertools.pairwise(bounds))
        ]

    def keep_side_records(self) -> None:
        """Copy what later steps need from ``raw`` besides ``ev``: memory records, flow points."""
        self.sql(
            f"""CREATE TABLE mem_record AS
                SELECT ts_us_ns + {self.base_ns} AS ts, args FROM raw
                WHERE ph IN ('i', 'I') AND name = '[memory]' AND ts_us_ns IS NOT NULL"""
        )
        self.sql(
            f"""CREATE TABLE flow_point AS
                SELECT r.id, r.ph, t.track_id, r.ts_us_ns + {self.base_ns} AS ts
                FROM raw r JOIN track t ON t.pid = r.pid AND t.tid_text = r.tid
                WHERE r.ph IN ('s', 'f') AND r.cat = 'fwdbwd' AND r.ts_us_ns IS NOT NULL"""
        )
        self.sql(ARG_ROW_SQL)

    def refuse_step_beyond_int32(self) -> None:
        """A ``ProfilerStep#N`` whose ``N`` the ``iteration`` column cannot hold is refused by
        name (``step`` holds it with a NULL iteration), not a cast error of the whole file."""
        over = self.rows("SELECT name FROM step WHERE iteration IS NULL LIMIT 1")
        if over:
            msg = (
                f"{self.path}: step annotation {_short(over[0][0])!r}: the step number is"
                f" beyond {2**31 - 1}"
            )
            raise TraceFormatError(msg)

    def assign_iterations(self) -> None:
        """Steps from ``ProfilerStep#N``; host events by time, device events by their launch."""
        self.sql(
            r"""CREATE TABLE step AS
                SELECT TRY_CAST(regexp_extract(name, '^ProfilerStep#(\d+)$', 1) AS INTEGER)
                           AS iteration,
                       min(ts) AS ts, arg_min(dur, ts) AS dur, arg_min(name, ts) AS name
                FROM ev
                WHERE NOT on_device AND regexp_matches(name, '^ProfilerStep#\d+$')
                GROUP BY 1"""
        )
        self.refuse_step_beyond_int32()
        launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
        self.sql(
            f"""CREATE TABLE ev_it AS
                WITH by_time AS (
                    SELECT e.event_id, e.on_device, e.correlation, e.category,
                           CASE WHEN e.ts < s.ts + greatest(s.dur, 1) THEN s.iteration END AS it
                    FROM ev e ASOF LEFT JOIN step s ON e.ts >= s.ts),
                launched AS (
                    SELECT correlation, min(it) AS it FROM by_time
                    WHERE category IN ({launch}) AND correlation IS NOT NULL GROUP BY correlation)
                SELECT b.event_id,
                       CASE WHEN b.on_device THEN coalesce(l.it, b.it) ELSE b.it END AS iteration
                FROM by_time b
                LEFT JOIN launched l ON b.on_device AND l.correlation = b.correlation
                WHERE b.it IS NOT NULL OR l.it IS NOT NULL"""
        )

    def events_sql(self) -> str:
        """The events in ``FRAME_SCHEMAS["events"]`` order, sorted by ``event_id``.

        ``ev`` already holds every column but the iteration and the args; ``raw`` is in file
        order, so its args are joined by ``ord`` (one hash join) and the rows sorted once.
        """
        return f"""SELECT {self.rank}::INTEGER AS rank, e.event_id, e.track_id, e.category,
                       e.name, e.ts, e.dur, e.correlation, e.external_id, e.rf_id, e.parent_id,
                       e.depth, i.iteration::INTEGER AS iteration, r.args
                FROM ev e JOIN raw r ON r.rowid = e.ord LEFT JOIN ev_it i USING (event_id)
                ORDER BY e.event_id"""
