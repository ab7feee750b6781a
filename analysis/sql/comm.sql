-- comm: collective skew across ranks — who arrives last, who waits, and what came before.
-- include: core

-- Each collective call with its arrival (host op start), thread, and the host op that preceded
-- it: the longest host op of its thread that ran entirely between the end of the thread's
-- previous communication call (collective or p2p) and this arrival.
CREATE VIEW _comm_arrival AS
WITH call AS (
    SELECT c.run_id, c.rank, c.group_id, c.seq, c.kind, c.iteration, c.event_id,
           c.host_ts, c.host_dur, c.kernel_ts, e.track_id
    FROM collective c
    LEFT JOIN event e USING (run_id, rank, event_id)
    WHERE c.host_ts IS NOT NULL
),
gap AS (
    SELECT call.*, coalesce(h.end_ts, 0) AS prev_comm_end
    FROM call
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
    SELECT call.run_id, call.rank, call.group_id, call.seq,
           arg_max(host.name, host.dur) AS preceding_op
    FROM gap AS call
    JOIN host
      ON host.run_id = call.run_id AND host.rank = call.rank AND host.track_id = call.track_id
     AND host.ts >= call.prev_comm_end AND host.end_ts <= call.host_ts
    GROUP BY call.run_id, call.rank, call.group_id, call.seq
)
SELECT call.*, prev.preceding_op
FROM call
LEFT JOIN prev USING (run_id, rank, group_id, seq);

-- One row per rank and collective instance: when the rank arrived, how long it waited for the
-- last participant, and whether it was the last (ties: the lowest rank).
--
-- @column run_id          The run.
-- @column group_id        Communicator.
-- @column seq             Instance number within the group.
-- @column rank            The rank.
-- @column kind            Collective kind.
-- @column iteration       Training step of the call on this rank.
-- @column arrival_ts      Start of the rank's host op, ns.
-- @column lateness_ns     arrival_ts minus the first participant's arrival, ns.
-- @column wait_ns         Last participant's arrival minus arrival_ts, ns (time this rank waited).
-- @column is_last         This rank arrived last (only when at least two participants recorded it).
-- @column participants    Ranks that recorded the instance.
-- @column matched         All group members present with one kind and one size.
-- @column preceding_op    Longest host op of its thread between its previous communication call and this one.
CREATE VIEW comm_collective_wait AS
SELECT a.run_id, a.group_id, a.seq, a.rank, a.kind, a.iteration, a.host_ts AS arrival_ts,
       a.host_ts - i.first_arrival_ts AS lateness_ns, i.last_arrival_ts - a.host_ts AS wait_ns,
       (i.participants > 1 AND row_number() OVER (
           PARTITION BY a.run_id, a.group_id, a.seq ORDER BY a.host_ts DESC, a.rank) = 1)
           AS is_last,
       i.participants, i.matched, a.preceding_op
FROM _comm_arrival a
JOIN collective_instance i USING (run_id, group_id, seq);

-- One row per collective instance: the arrival spread, the total wait it cost and who was last.
--
-- @column run_id          The run.
-- @column group_id        Communicator.
-- @column seq             Instance number within the group.
-- @column kind            Collective kind.
-- @column participants    Ranks that recorded it.
-- @column matched         All group members present with one kind and one size.
-- @column arrival_spread_ns  Last minus first host arrival, ns.
-- @column kernel_spread_ns   Last minus first kernel start, ns (NULL on CPU backends).
-- @column total_wait_ns   Sum of the participants' waits, ns.
-- @column last_rank       Rank that arrived last (NULL with one participant).
-- @column last_preceding_op  Host op before the call on the last rank.
CREATE VIEW comm_collective_skew AS
SELECT w.run_id, w.group_id, w.seq, min(w.kind) AS kind, any_value(w.participants) AS participants,
       bool_and(w.matched) AS matched,
       max(w.arrival_ts) - min(w.arrival_ts) AS arrival_spread_ns,
       max(a.kernel_ts) - min(a.kernel_ts) AS kernel_spread_ns,
       sum(w.wait_ns)::BIGINT AS total_wait_ns,
       any_value(w.rank) FILTER (WHERE w.is_last) AS last_rank,
       any_value(w.preceding_op) FILTER (WHERE w.is_last) AS last_preceding_op
FROM comm_collective_wait w
JOIN _comm_arrival a USING (run_id, group_id, seq, rank)
GROUP BY w.run_id, w.group_id, w.seq;

-- Late arrivals attributed to the host op that preceded them, per rank.
--
-- @column run_id          The run.
-- @column rank            The rank that arrived last.
-- @column preceding_op    Host op just before its late call.
-- @column times_last      Instances it reached last after this op.
-- @column caused_wait_ns  Others' total wait on those instances, ns.
CREATE VIEW comm_straggler_op AS
SELECT w.run_id, w.rank, coalesce(w.preceding_op, '(none)') AS preceding_op,
       count(*) AS times_last, sum(s.total_wait_ns)::BIGINT AS caused_wait_ns
FROM comm_collective_wait w
JOIN comm_collective_skew s USING (run_id, group_id, seq)
WHERE w.is_last
GROUP BY w.run_id, w.rank, coalesce(w.preceding_op, '(none)')
ORDER BY w.run_id, caused_wait_ns DESC;

-- Straggler ranking per rank: the time the other participants spent waiting for it (summed over
-- the instances it reached last), how often it was last, and its own waiting.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column straggler_rank  1 for the rank that made others wait longest, 2 next, ...
-- @column calls           Collective calls of the rank.
-- @column times_last      Instances it reached last.
-- @column last_pct        times_last as a percentage of its calls with two or more participants.
-- @column caused_wait_ns  Others' total wait on the instances it reached last, ns.
-- @column wait_ns         Its own total wait for later ranks, ns.
-- @column mean_wait_ns    Its mean wait per call, ns.
-- @column top_preceding_op  Host op before its late arrivals that cost the most waiting.
CREATE VIEW comm_straggler AS
WITH r AS (
    SELECT w.run_id, w.rank, count(*) AS calls,
           count(*) FILTER (WHERE w.is_last) AS times_last,
           count(*) FILTER (WHERE w.participants > 1) AS multi_calls,
           coalesce(sum(s.total_wait_ns) FILTER (WHERE w.is_last), 0)::BIGINT AS caused_wait_ns,
           sum(w.wait_ns)::BIGINT AS wait_ns, avg(w.wait_ns) AS mean_wait_ns
    FROM comm_collective_wait w
    JOIN comm_collective_skew s USING (run_id, group_id, seq)
    GROUP BY w.run_id, w.rank
),
op AS (
    SELECT run_id, rank, arg_max(preceding_op, caused_wait_ns) AS top_preceding_op
    FROM comm_straggler_op
    GROUP BY run_id, rank
)
SELECT r.run_id, r.rank,
       row_number() OVER (PARTITION BY r.run_id
                          ORDER BY r.caused_wait_ns DESC, r.times_last DESC, r.rank)
           AS straggler_rank,
       r.calls, r.times_last, 100.0 * r.times_last / nullif(r.multi_calls, 0) AS last_pct,
       r.caused_wait_ns, r.wait_ns, r.mean_wait_ns, op.top_preceding_op
FROM r
LEFT JOIN op USING (run_id, rank)
ORDER BY r.run_id, straggler_rank;
