-- comm: collective skew across ranks — who arrives last, who waits, and what came before.
-- include: core

-- Each communication call with its arrival, thread, and the host op that preceded it.
--
-- Calls are collectives (instance: group + seq) and point-to-point transfers (instance: group,
-- seq and the `link` `SRC->DST`; a pair has two participants, the sender and the receiver).
-- The *arrival* is the device-side start of the call's kernel when it has one, else the start of
-- its host op: the host call of an asynchronous NCCL collective returns at once and says nothing
-- about when the rank was ready, its kernel does. The preceding op is the longest host op of its
-- thread that ran entirely between the end of the thread's previous communication call
-- (collective or p2p) and the call's host op. `free_ns` is the time from the end of the rank's
-- previous communication call (any thread; kernel end when it ran on the device) to this
-- arrival: the time the rank worked, not waited, before arriving.
CREATE VIEW _comm_arrival AS
WITH call AS (
    SELECT c.run_id, c.rank, c.group_id, c.seq, '' AS link, c.kind, c.iteration, c.event_id,
           c.host_ts, c.kernel_ts, coalesce(c.kernel_ts, c.host_ts) AS arrival_ts, e.track_id
    FROM collective c
    LEFT JOIN event e USING (run_id, rank, event_id)
    WHERE coalesce(c.kernel_ts, c.host_ts) IS NOT NULL
    UNION ALL
    SELECT p.run_id, p.rank, coalesce(p.group_id, -1) AS group_id, p.seq,
           CASE p.direction WHEN 'send' THEN p.rank || '->' || p.peer
                ELSE p.peer || '->' || p.rank END AS link,
           p.direction AS kind, p.iteration, p.event_id, p.host_ts, p.kernel_ts,
           coalesce(p.kernel_ts, p.host_ts) AS arrival_ts, e.track_id
    FROM p2p p
    LEFT JOIN event e USING (run_id, rank, event_id)
    WHERE p.peer IS NOT NULL AND p.seq IS NOT NULL
      AND coalesce(p.kernel_ts, p.host_ts) IS NOT NULL
),
call_end AS (
    SELECT c.run_id, c.rank, coalesce(c.kernel_ts + c.kernel_dur, c.host_ts + c.host_dur) AS end_ts
    FROM collective c
    UNION ALL
    SELECT p.run_id, p.rank, coalesce(p.kernel_ts + p.kernel_dur, p.host_ts + p.host_dur) AS end_ts
    FROM p2p p
),
rank_start AS (
    SELECT run_id, rank, min(ts) AS ts FROM event WHERE ts IS NOT NULL GROUP BY run_id, rank
),
freed AS (
    SELECT call.*, call.arrival_ts - coalesce(ce.end_ts, rs.ts, call.arrival_ts) AS free_ns
    FROM call
    ASOF LEFT JOIN (SELECT * FROM call_end WHERE end_ts IS NOT NULL) ce
      ON ce.run_id = call.run_id AND ce.rank = call.rank AND ce.end_ts <= call.arrival_ts
    LEFT JOIN rank_start rs ON rs.run_id = call.run_id AND rs.rank = call.rank
),
gap AS (
    SELECT call.*, coalesce(h.end_ts, 0) AS prev_comm_end
    FROM freed AS call
    ASOF LEFT JOIN core_comm_host_op h
      ON h.run_id = call.run_id AND h.rank = call.rank AND h.track_id = call.track_id
     AND h.end_ts <= call.host_ts
),
host AS (
    SELECT run_id, rank, track_id, ts, ts + dur AS end_ts, dur, name
    FROM event
    WHERE category IN ('cpu_op', 'user_annotation', 'python_function')
      AND ts IS NOT NULL AND dur IS NOT NULL
),
prev AS (
    SELECT call.run_id, call.rank, call.group_id, call.seq, call.link,
           arg_max(host.name, host.dur) AS preceding_op
    FROM gap AS call
    JOIN host
      ON host.run_id = call.run_id AND host.rank = call.rank AND host.track_id = call.track_id
     AND host.ts >= call.prev_comm_end AND host.end_ts <= call.host_ts
    GROUP BY call.run_id, call.rank, call.group_id, call.seq, call.link
)
SELECT call.*, prev.preceding_op
FROM freed AS call
LEFT JOIN prev USING (run_id, rank, group_id, seq, link);

-- One row per rank and communication instance: when the rank arrived, how long it waited for
-- the last participant, and whether it was the last (ties: the lowest rank).
--
-- @column run_id          The run.
-- @column group_id        Communicator (-1: a p2p transfer without one).
-- @column seq             Instance number within the group (p2p: within the group and link).
-- @column link            `SRC->DST` for a point-to-point transfer; empty for a collective.
-- @column rank            The rank.
-- @column kind            Collective kind, or `send` / `recv`.
-- @column iteration       Training step of the call on this rank.
-- @column arrival_ts      Device-side start of its kernel when it has one, else start of its host op, ns.
-- @column on_device       The arrival is a kernel start.
-- @column lateness_ns     arrival_ts minus the first participant's arrival, ns.
-- @column wait_ns         Last participant's arrival minus arrival_ts, ns (time this rank waited).
-- @column free_ns         Time from the end of the rank's previous communication call to arrival_ts, ns (it worked, not waited).
-- @column is_last         This rank arrived last (only when at least two participants recorded it).
-- @column participants    Ranks that recorded the instance.
-- @column matched         Whole: all group members present with one kind and one size (p2p: both sides).
-- @column preceding_op    Longest host op of its thread between its previous communication call and this one.
CREATE VIEW comm_collective_wait AS
WITH a AS (
    SELECT a.*,
           min(a.arrival_ts) OVER inst AS first_arrival_ts,
           max(a.arrival_ts) OVER inst AS last_arrival_ts,
           count(*) OVER inst AS participants,
           row_number() OVER (PARTITION BY a.run_id, a.group_id, a.seq, a.link
                              ORDER BY a.arrival_ts DESC, a.rank) AS arrival_order
    FROM _comm_arrival a
    WINDOW inst AS (PARTITION BY a.run_id, a.group_id, a.seq, a.link)
)
SELECT a.run_id, a.group_id, a.seq, a.link, a.rank, a.kind, a.iteration, a.arrival_ts,
       a.kernel_ts IS NOT NULL AS on_device,
       a.arrival_ts - a.first_arrival_ts AS lateness_ns,
       a.last_arrival_ts - a.arrival_ts AS wait_ns, a.free_ns,
       (a.participants > 1 AND a.arrival_order = 1) AS is_last,
       a.participants,
       CASE WHEN a.link = '' THEN coalesce(ci.matched, false) ELSE a.participants = 2 END
           AS matched,
       a.preceding_op
FROM a
LEFT JOIN collective_instance ci
  ON a.link = '' AND ci.run_id = a.run_id AND ci.group_id = a.group_id AND ci.seq = a.seq;

-- One row per communication instance: the arrival spread, the total wait it cost and who was
-- last.
--
-- @column run_id          The run.
-- @column group_id        Communicator.
-- @column seq             Instance number within the group.
-- @column link            `SRC->DST` for a point-to-point transfer; empty for a collective.
-- @column kind            Collective kind (p2p: `recv`/`send`, the first by name).
-- @column iteration       Earliest training step among the participants' calls.
-- @column participants    Ranks that recorded it.
-- @column matched         Whole: all group members present with one kind and one size (p2p: both sides).
-- @column arrival_spread_ns  Last minus first arrival, ns.
-- @column host_spread_ns  Last minus first host-op start, ns.
-- @column kernel_spread_ns   Last minus first kernel start, ns (NULL on CPU backends).
-- @column total_wait_ns   Sum of the participants' waits, ns.
-- @column blamed_wait_ns  Sum of the participants' waits, each capped at the last rank's free_ns, ns: the waiting the last rank's own work caused.
-- @column last_rank       Rank that arrived last (NULL with one participant).
-- @column last_preceding_op  Host op before the call on the last rank.
CREATE VIEW comm_collective_skew AS
WITH w AS MATERIALIZED (
    SELECT w.*, a.host_ts, a.kernel_ts
    FROM comm_collective_wait w
    JOIN _comm_arrival a USING (run_id, group_id, seq, link, rank)
)
SELECT run_id, group_id, seq, link, min(kind) AS kind, min(iteration) AS iteration,
       any_value(participants) AS participants, bool_and(matched) AS matched,
       max(arrival_ts) - min(arrival_ts) AS arrival_spread_ns,
       max(host_ts) - min(host_ts) AS host_spread_ns,
       max(kernel_ts) - min(kernel_ts) AS kernel_spread_ns,
       sum(wait_ns)::BIGINT AS total_wait_ns,
       sum(least(wait_ns, last_free_ns))::BIGINT AS blamed_wait_ns,
       any_value(rank) FILTER (WHERE is_last) AS last_rank,
       any_value(preceding_op) FILTER (WHERE is_last) AS last_preceding_op
FROM (
    SELECT *, max(free_ns) FILTER (WHERE is_last) OVER (PARTITION BY run_id, group_id, seq, link)
              AS last_free_ns
    FROM w
)
GROUP BY run_id, group_id, seq, link;

-- Late arrivals attributed to the host op that preceded them, per rank; `it` keeps only the
-- calls of that iteration (NULL: all).
--
-- @column run_id          The run.
-- @column rank            The rank that arrived last.
-- @column preceding_op    Host op just before its late call.
-- @column times_last      Instances it reached last after this op.
-- @column caused_wait_ns  Others' wait on those instances that its own work caused (`blamed_wait_ns`), ns.
CREATE MACRO comm_straggler_op_at(it := NULL) AS TABLE
WITH w AS MATERIALIZED (
    SELECT *, max(free_ns) FILTER (WHERE is_last) OVER (PARTITION BY run_id, group_id, seq, link)
              AS last_free_ns
    FROM comm_collective_wait
),
blame AS (
    SELECT run_id, group_id, seq, link, sum(least(wait_ns, last_free_ns))::BIGINT AS blamed
    FROM w GROUP BY ALL
)
SELECT w.run_id, w.rank, coalesce(w.preceding_op, '(none)') AS preceding_op,
       count(*) AS times_last, sum(b.blamed)::BIGINT AS caused_wait_ns
FROM w
JOIN blame b USING (run_id, group_id, seq, link)
WHERE w.is_last AND (it IS NULL OR w.iteration = it)
GROUP BY w.run_id, w.rank, coalesce(w.preceding_op, '(none)')
ORDER BY w.run_id, caused_wait_ns DESC;

-- `comm_straggler_op_at` over every iteration.
--
-- @column run_id          The run.
-- @column rank            The rank that arrived last.
-- @column preceding_op    Host op just before its late call.
-- @column times_last      Instances it reached last after this op.
-- @column caused_wait_ns  Others' wait on those instances that its own work caused (`blamed_wait_ns`), ns.
CREATE VIEW comm_straggler_op AS
SELECT * FROM comm_straggler_op_at();

-- Straggler ranking per rank: the time the other participants spent waiting for it (summed over
-- the instances it reached last, collectives and p2p transfers), how often it was last, and its
-- own waiting; `it` keeps only the calls of that iteration (NULL: all). A rank that arrives last
-- only because it was itself waiting for another rank passes the blame on: each participant's
-- wait counts against the last rank only up to the time that rank worked since its previous
-- communication call (`free_ns`), so a slow pipeline stage, not its neighbours that wait for it
-- and then arrive late downstream, ranks first.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column straggler_place  Place in the straggler ranking (not a rank id): 1 for the rank that made others wait longest, 2 next, ...; NULL for a rank never last at an instance with two or more participants.
-- @column calls           Communication calls of the rank (collectives and p2p).
-- @column times_last      Instances it reached last.
-- @column last_pct        times_last as a percentage of its calls with two or more participants.
-- @column caused_wait_ns  Others' wait on the instances it reached last, each capped at the time it worked before arriving (`blamed_wait_ns`), ns.
-- @column last_wait_ns    Others' total wait on the instances it reached last, uncapped, ns.
-- @column wait_ns         Its own total wait for later ranks, ns.
-- @column mean_wait_ns    Its mean wait per call, ns.
-- @column top_preceding_op  Host op before its late arrivals that cost the most waiting.
CREATE MACRO comm_straggler_at(it := NULL) AS TABLE
WITH w AS MATERIALIZED (
    SELECT *, max(free_ns) FILTER (WHERE is_last) OVER (PARTITION BY run_id, group_id, seq, link)
              AS last_free_ns
    FROM comm_collective_wait
),
inst AS (
    SELECT run_id, group_id, seq, link, sum(wait_ns)::BIGINT AS total_wait_ns,
           sum(least(wait_ns, last_free_ns))::BIGINT AS blamed_wait_ns
    FROM w GROUP BY ALL
),
sel AS (
    SELECT w.*, i.total_wait_ns, i.blamed_wait_ns
    FROM w JOIN inst i USING (run_id, group_id, seq, link)
    WHERE it IS NULL OR w.iteration = it
),
r AS (
    SELECT run_id, rank, count(*) AS calls,
           count(*) FILTER (WHERE is_last) AS times_last,
           count(*) FILTER (WHERE participants > 1) AS multi_calls,
           coalesce(sum(blamed_wait_ns) FILTER (WHERE is_last), 0)::BIGINT AS caused_wait_ns,
           coalesce(sum(total_wait_ns) FILTER (WHERE is_last), 0)::BIGINT AS last_wait_ns,
           sum(wait_ns)::BIGINT AS wait_ns, avg(wait_ns) AS mean_wait_ns
    FROM sel
    GROUP BY run_id, rank
),
op AS (
    SELECT run_id, rank, arg_max(preceding_op, caused) AS top_preceding_op
    FROM (SELECT run_id, rank, coalesce(preceding_op, '(none)') AS preceding_op,
                 sum(blamed_wait_ns) AS caused
          FROM sel WHERE is_last GROUP BY ALL)
    GROUP BY run_id, rank
)
SELECT r.run_id, r.rank,
       CASE WHEN r.times_last > 0 THEN
           row_number() OVER (PARTITION BY r.run_id, r.times_last > 0
                              ORDER BY r.caused_wait_ns DESC, r.times_last DESC, r.rank)
       END AS straggler_place,
       r.calls, r.times_last, 100.0 * r.times_last / nullif(r.multi_calls, 0) AS last_pct,
       r.caused_wait_ns, r.last_wait_ns, r.wait_ns, r.mean_wait_ns, op.top_preceding_op
FROM r
LEFT JOIN op USING (run_id, rank)
ORDER BY r.run_id, straggler_place NULLS LAST, r.rank;

-- `comm_straggler_at` over every iteration: the `skew` analysis.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column straggler_place  Place in the straggler ranking (not a rank id): 1 for the rank that made others wait longest, 2 next, ...; NULL for a rank never last at an instance with two or more participants.
-- @column calls           Communication calls of the rank (collectives and p2p).
-- @column times_last      Instances it reached last.
-- @column last_pct        times_last as a percentage of its calls with two or more participants.
-- @column caused_wait_ns  Others' wait on the instances it reached last, each capped at the time it worked before arriving (`blamed_wait_ns`), ns.
-- @column last_wait_ns    Others' total wait on the instances it reached last, uncapped, ns.
-- @column wait_ns         Its own total wait for later ranks, ns.
-- @column mean_wait_ns    Its mean wait per call, ns.
-- @column top_preceding_op  Host op before its late arrivals that cost the most waiting.
CREATE VIEW comm_straggler AS
SELECT * FROM comm_straggler_at();
