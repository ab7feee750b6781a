"""The frames a Kineto file gives besides its events and calls: memory records, flows (launch,
fwd-bwd, stream sync) and the rank's row."""

from __future__ import annotations

import polars as pl

from prism_trace.formats.kineto.header import ranks_frame_of
from prism_trace.formats.kineto.sql import _LAUNCH_CATEGORIES
from prism_trace.formats.kineto.work import _Work

__all__: list[str] = []

# c10::DeviceType, indexed by value.
_DEVICE_TYPES = [
    "cpu",
    "cuda",
    "mkldnn",
    "opengl",
    "opencl",
    "ideep",
    "hip",
    "fpga",
    "maia",
    "xla",
    "vulkan",
    "metal",
    "xpu",
    "mps",
    "meta",
    "hpu",
    "ve",
    "lazy",
    "ipu",
    "mtia",
    "privateuseone",
]

# The columns of a ``[memory]`` record (alias ``m``): its device, address, bytes and the
# allocator's totals; the per-file and the batch reader both select them.
_DEVICE_LIST = "[" + ", ".join(f"'{t}'" for t in _DEVICE_TYPES) + "]"
# A device type outside c10's enum is kept as written: ``list_extract`` counts a negative index
# from the end, so the index is bounded first.
_MEMORY_COLUMNS = f"""CASE WHEN TRY_CAST(m.args->>'Device Type' AS BIGINT)
                                 BETWEEN 0 AND {len(_DEVICE_TYPES) - 1}
                            THEN list_extract({_DEVICE_LIST},
                                              TRY_CAST(m.args->>'Device Type' AS BIGINT) + 1)
                            WHEN TRY_CAST(m.args->>'Device Type' AS BIGINT) IS NOT NULL
                            THEN m.args->>'Device Type'
                            ELSE lower(m.args->>'Device Type') END AS device_type,
                       TRY_CAST(m.args->>'Device Id' AS INTEGER) AS device_id,
                       TRY_CAST(m.args->>'Addr' AS BIGINT) AS addr,
                       coalesce(TRY_CAST(m.args->>'Bytes' AS BIGINT), 0) AS bytes,
                       TRY_CAST(m.args->>'Total Allocated' AS BIGINT) AS total_allocated,
                       TRY_CAST(m.args->>'Total Reserved' AS BIGINT) AS total_reserved,"""


class _Frames(_Work):
    """The memory, flows and rank stage of the reader (``reader._Reader``)."""

    def memory(self) -> pl.DataFrame:
        """The ``[memory]`` records, each with its step's iteration (by time)."""
        return self.frame(
            f"""WITH m AS (SELECT * FROM mem_record)
                SELECT {self.rank} AS rank, m.ts,
                       {_MEMORY_COLUMNS}
                       CASE WHEN m.ts < s.ts + greatest(s.dur, 1) THEN s.iteration END AS iteration
                FROM m ASOF LEFT JOIN step s ON m.ts >= s.ts
                ORDER BY m.ts"""
        )

    def flows(self) -> pl.DataFrame:
        """Launch (by correlation), fwd-bwd (by flow id) and stream-sync dependencies.

        A fwd-bwd flow point binds to the innermost event of its track enclosing it
        (``innermost_enclosing``: a sorted search and a walk up the parents, not a range join).
        """
        launch = ", ".join(f"'{c}'" for c in _LAUNCH_CATEGORIES)
        bound = self.bound.filter(pl.col("event_id").is_not_null())
        self.bound = pl.DataFrame()
        self.con.register("_bound_points", bound)
        self.sql(
            """CREATE TEMP TABLE _bound AS
               SELECT id, ph, max(event_id) AS event_id FROM _bound_points GROUP BY id, ph"""
        )
        self.con.unregister("_bound_points")
        return self.frame(
            f"""WITH launcher AS (
                    SELECT correlation, min(event_id) AS event_id FROM ev
                    WHERE category IN ({launch}) AND correlation IS NOT NULL GROUP BY correlation),
                launches AS (
                    SELECT 'launch' AS kind, l.event_id AS src_event_id, d.event_id AS dst_event_id,
                           d.correlation AS flow_id
                    FROM ev d JOIN launcher l USING (correlation)
                    WHERE d.category IN ('kernel', 'memcpy', 'memset')),
                fwdbwd AS (
                    SELECT 'fwdbwd' AS kind, s.event_id AS src_event_id, f.event_id AS dst_event_id,
                           TRY_CAST(s.id AS BIGINT) AS flow_id
                    FROM _bound s JOIN _bound f ON s.id = f.id AND s.ph = 's' AND f.ph = 'f'),
                waits AS (
                    SELECT e.event_id, e.ts, t.pid,
                           TRY_CAST(e.args->>'wait_on_stream' AS BIGINT) AS stream,
                           TRY_CAST(e.args->>'wait_on_cuda_event_record_corr_id' AS BIGINT) AS rec
                    FROM eva e JOIN track t USING (track_id)
                    WHERE e.category = 'cuda_sync'),
                done AS (
                    SELECT t.pid, t.tid AS stream, e.correlation, e.event_id FROM ev e
                    JOIN track t USING (track_id)
                    WHERE e.on_device AND e.category IN ('kernel', 'memcpy', 'memset')
                      AND e.correlation IS NOT NULL),
                syncs AS (
                    SELECT 'sync' AS kind, d.event_id AS src_event_id, w.event_id AS dst_event_id,
                           NULL::BIGINT AS flow_id
                    FROM waits w ASOF JOIN done d
                      ON d.pid = w.pid AND d.stream = w.stream AND w.rec > d.correlation
                    WHERE w.stream IS NOT NULL AND w.rec IS NOT NULL AND w.rec > 0)
                SELECT {self.rank} AS rank, * FROM (
                    SELECT * FROM launches UNION ALL SELECT * FROM fwdbwd
                    UNION ALL SELECT * FROM syncs)
                ORDER BY kind, dst_event_id, src_event_id"""
        )

    def ranks_frame(self) -> pl.DataFrame:
        """The rank's row: the process of its steps (else its busiest host process) and the
        device of its busiest stream."""
        rows = self.rows(
            """SELECT coalesce(
                   (SELECT TRY_CAST(any_value(t.pid) AS BIGINT)
                    FROM ev e JOIN track t USING (track_id)
                    WHERE regexp_matches(e.name, '^ProfilerStep#\\d+$') AND NOT e.on_device),
                   (SELECT TRY_CAST(t.pid AS BIGINT) FROM ev e JOIN track t USING (track_id)
                    WHERE t.kind = 'thread' AND TRY_CAST(t.pid AS BIGINT) IS NOT NULL
                    GROUP BY t.pid ORDER BY count(*) DESC LIMIT 1)),
               (SELECT TRY_CAST(t.pid AS INTEGER) FROM ev e JOIN track t USING (track_id)
                WHERE t.kind = 'stream' GROUP BY t.pid ORDER BY count(*) DESC LIMIT 1)"""
        )
        pid, device_id = rows[0]
        return ranks_frame_of(self.rank, self.meta, self.info, pid, device_id)
