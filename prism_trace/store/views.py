"""The declared views over the tables: collective instances, mismatches, p2p pairs, op kinds.

``graph.matching`` runs ``comm_mismatch`` and ``p2p_pair`` for one run; ``prism query`` sees them
all.
"""

from __future__ import annotations

from prism_trace.store.declaration import View, col

__all__ = ["VIEWS"]

VIEWS: tuple[View, ...] = (
    View(
        "collective_instance",
        "One collective instance across ranks (group + sequence): who arrived, when, and whether"
        " it matches.",
        """
        SELECT c.run_id, c.group_id, c.seq,
               any_value(g.name) AS group_name,
               min(c.kind) AS kind,
               count(DISTINCT c.kind) AS kinds,
               count(*) AS participants,
               any_value(g.size) AS group_size,
               list(c.rank ORDER BY c.rank) AS ranks,
               min(c.host_ts) AS first_arrival_ts,
               max(c.host_ts) AS last_arrival_ts,
               max(c.host_ts) - min(c.host_ts) AS arrival_spread,
               max(c.msg_bytes) AS msg_bytes,
               count(DISTINCT c.msg_bytes) AS sizes,
               (count(*) = any_value(g.size) AND count(DISTINCT c.kind) = 1
                AND count(DISTINCT c.msg_bytes) <= 1) AS matched
        FROM collective c JOIN comm_group g USING (run_id, group_id)
        GROUP BY c.run_id, c.group_id, c.seq
        """,
        (
            col("group_name", "VARCHAR", "Process-group name."),
            col("participants", "BIGINT", "Ranks that recorded the instance."),
            col("matched", "BOOLEAN", "All members present with one kind and one size."),
        ),
    ),
    View(
        "comm_mismatch",
        "One row per collective instance that is not whole: members missing, extra ranks, or"
        " ranks whose kind or size differs from the others'. `mismatch` is false when the only"
        " missing members were never recorded in the run (a partial recording).",
        """        WITH inst AS (
            SELECT run_id, group_id, seq,
                   mode(kind) AS common_kind, mode(msg_bytes) AS common_bytes,
                   list(rank ORDER BY rank) AS present_ranks,
                   list_sort(list_distinct(list(kind))) AS kinds,
                   list_sort(list_distinct(list(msg_bytes))) AS sizes
            FROM collective GROUP BY run_id, group_id, seq),
        odd AS (
            SELECT c.run_id, c.group_id, c.seq, list(c.rank ORDER BY c.rank) AS odd_ranks
            FROM collective c JOIN inst i USING (run_id, group_id, seq)
            WHERE c.kind <> i.common_kind OR c.msg_bytes IS DISTINCT FROM i.common_bytes
            GROUP BY c.run_id, c.group_id, c.seq),
        recorded AS (SELECT run_id, list(rank) AS ranks FROM rank GROUP BY run_id),
        judged AS (
            SELECT i.run_id, i.group_id, g.name AS group_name, i.seq,
                   g.ranks AS expected_ranks, i.present_ranks,
                   list_filter(g.ranks, lambda x: NOT list_contains(i.present_ranks, x))
                       AS missing_ranks,
                   list_filter(i.present_ranks, lambda x: NOT list_contains(g.ranks, x))
                       AS extra_ranks,
                   coalesce(o.odd_ranks, []::INTEGER[]) AS odd_ranks,
                   i.kinds, i.sizes, r.ranks AS recorded_ranks,
                   len(i.present_ranks) < g.size AS short
            FROM inst i JOIN comm_group g USING (run_id, group_id)
            LEFT JOIN odd o USING (run_id, group_id, seq)
            LEFT JOIN recorded r USING (run_id))
        SELECT run_id, group_id, group_name, seq, expected_ranks, present_ranks, missing_ranks,
               list_filter(missing_ranks, lambda x: NOT list_contains(recorded_ranks, x))
                   AS unrecorded_ranks,
               extra_ranks, odd_ranks, kinds, sizes,
               (len(list_filter(missing_ranks, lambda x: list_contains(recorded_ranks, x))) > 0
                OR len(extra_ranks) > 0 OR len(odd_ranks) > 0
                OR (expected_ranks IS NULL AND coalesce(short, false))) AS mismatch
        FROM judged
        WHERE len(missing_ranks) > 0 OR len(extra_ranks) > 0 OR len(odd_ranks) > 0
           OR (expected_ranks IS NULL AND coalesce(short, false))
        """,
        (
            col("group_name", "VARCHAR", "Process-group name."),
            col("expected_ranks", "INTEGER[]", "The group's members (`comm_group.ranks`)."),
            col("present_ranks", "INTEGER[]", "Ranks that recorded the instance."),
            col("missing_ranks", "INTEGER[]", "Members that did not record it."),
            col("unrecorded_ranks", "INTEGER[]", "Missing members absent from the run's ranks."),
            col("extra_ranks", "INTEGER[]", "Ranks that recorded it but are not members."),
            col("odd_ranks", "INTEGER[]", "Ranks whose kind or msg_bytes differs from the mode."),
            col("kinds", "VARCHAR[]", "Distinct kinds recorded."),
            col("sizes", "BIGINT[]", "Distinct msg_bytes recorded."),
            col("mismatch", "BOOLEAN", "A recorded rank disagrees or is missing."),
        ),
    ),
    View(
        "p2p_pair",
        "A send matched with its receive: send(rank → peer, group, seq) ↔ recv(peer ← rank,"
        " group, seq); the side that was not recorded is NULL.",
        """        WITH s AS (SELECT * FROM p2p WHERE direction = 'send'),
             r AS (SELECT * FROM p2p WHERE direction = 'recv')
        SELECT coalesce(s.run_id, r.run_id) AS run_id,
               coalesce(s.group_id, r.group_id) AS group_id,
               g.name AS group_name,
               coalesce(s.seq, r.seq) AS seq,
               coalesce(s.rank, r.peer) AS src_rank,
               coalesce(s.peer, r.rank) AS dst_rank,
               s.bytes AS send_bytes, r.bytes AS recv_bytes,
               s.event_id AS send_event_id, r.event_id AS recv_event_id,
               s.host_ts AS send_ts, s.host_dur AS send_dur,
               r.host_ts AS recv_ts, r.host_dur AS recv_dur,
               s.kernel_ts AS send_kernel_ts, r.kernel_ts AS recv_kernel_ts,
               s.rank IS NOT NULL AND r.rank IS NOT NULL AS paired
        FROM s FULL OUTER JOIN r
          ON s.run_id = r.run_id AND s.group_id IS NOT DISTINCT FROM r.group_id
         AND s.rank = r.peer AND s.peer = r.rank AND s.seq = r.seq
        LEFT JOIN comm_group g
          ON g.run_id = coalesce(s.run_id, r.run_id)
         AND g.group_id = coalesce(s.group_id, r.group_id)
        """,
        (
            col("src_rank", "INTEGER", "Sending rank."),
            col("dst_rank", "INTEGER", "Receiving rank."),
            col("send_event_id", "BIGINT", "Host op of the send (NULL when unpaired)."),
            col("recv_event_id", "BIGINT", "Host op of the receive (NULL when unpaired)."),
            col("send_ts", "BIGINT", "Start of the send's host op, ns."),
            col("recv_ts", "BIGINT", "Start of the receive's host op, ns."),
            col("paired", "BOOLEAN", "Both sides were found."),
        ),
    ),
    View(
        "host_op",
        "Host-side events (CPU ops and annotations).",
        "SELECT * FROM event WHERE category IN ('cpu_op', 'user_annotation', 'python_function')",
    ),
    View(
        "kernel",
        "Device-side events (kernels, memcpy, memset).",
        "SELECT * FROM event WHERE category IN ('kernel', 'memcpy', 'memset')",
    ),
)
