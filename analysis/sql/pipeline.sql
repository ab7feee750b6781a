-- pipeline: pipeline bubbles — the idle windows of each rank's compute lane, per stage.
-- include: core
--
-- A bubble-filling scheduler needs to know when a stage's compute lane is free, for how long,
-- and how much memory is free then. A rank's *compute lane* is, by mode: `device` (it has device
-- ops) the compute kernels of all its streams; `timeline` (op timelines such as Megatron's) its
-- events of category `compute`; `host` (CPU-only ranks, e.g. gloo) the cpu_ops of its main thread
-- — the thread that issues most communication calls — minus the time that thread is blocked in a
-- communication call. The lane is *busy* while a compute op runs (and, on the host, no call
-- blocks it); every other instant of the iteration's span is idle.

-- Each rank's stage (`rank.pp`, 0 when unknown), mode, main thread (host mode) and device memory
-- capacity (`totalGlobalMem` of the Kineto device properties, NULL when the trace has none).
CREATE VIEW _pipeline_rank AS
WITH dev AS (
    SELECT DISTINCT run_id, rank FROM core_device_op
),
tl AS (
    SELECT DISTINCT run_id, rank FROM event WHERE category = 'compute'
),
comm_thread AS (
    SELECT run_id, rank, arg_max(track_id, n) AS track_id
    FROM (SELECT run_id, rank, track_id, count(*) AS n FROM core_comm_host_op
          WHERE track_id IS NOT NULL GROUP BY ALL)
    GROUP BY ALL
),
busy_thread AS (
    SELECT run_id, rank, arg_max(track_id, total) AS track_id
    FROM (SELECT run_id, rank, track_id, sum(dur) AS total FROM event
          WHERE category = 'cpu_op' AND dur IS NOT NULL AND track_id IS NOT NULL GROUP BY ALL)
    GROUP BY ALL
)
SELECT r.run_id, r.rank, coalesce(r.pp, 0) AS stage,
       CASE WHEN d.rank IS NOT NULL THEN 'device'
            WHEN t.rank IS NOT NULL THEN 'timeline'
            ELSE 'host' END AS mode,
       coalesce(c.track_id, b.track_id) AS main_track,
       TRY_CAST(json_extract(r.args, '$.device_properties.totalGlobalMem') AS BIGINT)
           AS capacity_bytes
FROM rank r
LEFT JOIN dev d USING (run_id, rank)
LEFT JOIN tl t USING (run_id, rank)
LEFT JOIN comm_thread c USING (run_id, rank)
LEFT JOIN busy_thread b USING (run_id, rank);

-- The compute ops of each rank's lane, keyed by iteration (`it`: -1 for a rank without steps).
-- Device mode counts the compute kernels launched in a step (`core_device_op.in_steps`).
CREATE VIEW _pipeline_compute AS
SELECT d.run_id, d.rank, coalesce(d.iteration, -1) AS it, d.event_id, d.name, d.ts, d.end_ts,
       d.dur
FROM core_device_op d
JOIN _pipeline_rank r USING (run_id, rank)
WHERE r.mode = 'device' AND d.kernel_type = 'compute' AND d.in_steps AND d.dur > 0
UNION ALL
SELECT e.run_id, e.rank, coalesce(e.iteration, -1) AS it, e.event_id, e.name, e.ts,
       e.ts + e.dur AS end_ts, e.dur
FROM event e
JOIN _pipeline_rank r USING (run_id, rank)
WHERE r.mode = 'timeline' AND e.category = 'compute' AND e.ts IS NOT NULL AND e.dur > 0
UNION ALL
SELECT e.run_id, e.rank, coalesce(e.iteration, -1) AS it, e.event_id, e.name, e.ts,
       e.ts + e.dur AS end_ts, e.dur
FROM event e
JOIN _pipeline_rank r
  ON r.run_id = e.run_id AND r.rank = e.rank AND r.main_track = e.track_id
WHERE r.mode = 'host' AND e.category = 'cpu_op' AND e.ts IS NOT NULL AND e.dur > 0;

-- The span of each rank-iteration: its iteration window (`core_window`), stretched to cover its
-- compute ops (device ops launched in a step may run past the step's end), and the first start
-- and last end of those ops (`c_ts`, `c_end`).
CREATE VIEW _pipeline_span AS
WITH c AS (
    SELECT run_id, rank, it, min(ts) AS c_ts, max(end_ts) AS c_end, count(*) AS ops
    FROM _pipeline_compute GROUP BY ALL
)
SELECT w.run_id, w.rank, w.iteration, c.it, least(w.ts, c.c_ts) AS ts,
       greatest(w.end_ts, c.c_end) AS end_ts, c.c_ts, c.c_end, c.ops
FROM core_window w
JOIN c ON c.run_id = w.run_id AND c.rank = w.rank AND c.it = coalesce(w.iteration, -1);

-- Where the lane changes state: +1/-1 `dc` at each compute op's start/end, +1/-1 `dm` at each
-- blocking call's start/end (host mode: communication host ops of the main thread, clipped to
-- the span), and the span's ends.
CREATE VIEW _pipeline_point AS
WITH blocking AS (
    SELECT s.run_id, s.rank, s.it, greatest(h.ts, s.ts) AS ts, least(h.end_ts, s.end_ts) AS end_ts
    FROM core_comm_host_op h
    JOIN _pipeline_rank r
      ON r.run_id = h.run_id AND r.rank = h.rank AND r.main_track = h.track_id
    JOIN _pipeline_span s
      ON s.run_id = h.run_id AND s.rank = h.rank AND h.ts < s.end_ts AND h.end_ts > s.ts
    WHERE r.mode = 'host' AND h.dur > 0
)
SELECT run_id, rank, it, ts AS t, 0 AS dc, 0 AS dm FROM _pipeline_span
UNION ALL
SELECT run_id, rank, it, end_ts AS t, 0 AS dc, 0 AS dm FROM _pipeline_span
UNION ALL
SELECT run_id, rank, it, ts AS t, 1 AS dc, 0 AS dm FROM _pipeline_compute
UNION ALL
SELECT run_id, rank, it, end_ts AS t, -1 AS dc, 0 AS dm FROM _pipeline_compute
UNION ALL
SELECT run_id, rank, it, ts AS t, 0 AS dc, 1 AS dm FROM blocking
UNION ALL
SELECT run_id, rank, it, end_ts AS t, 0 AS dc, -1 AS dm FROM blocking;

-- The idle windows of every rank-iteration, of any length: maximal runs of instants at which no
-- compute op runs or a blocking call holds the lane. One sweep: at each distinct point the
-- running sums of `dc`, `dm` give the state of the segment up to the next point; consecutive
-- idle segments share their count of earlier busy segments, which merges them.
CREATE VIEW _pipeline_window AS
WITH state AS (
    SELECT run_id, rank, it, t,
           sum(sum(dc)) OVER w AS nc, sum(sum(dm)) OVER w AS nm, lead(t) OVER w AS t_next
    FROM _pipeline_point
    GROUP BY run_id, rank, it, t
    WINDOW w AS (PARTITION BY run_id, rank, it ORDER BY t)
),
seg AS (
    SELECT *, nc > 0 AND nm = 0 AS busy,
           sum(CASE WHEN nc > 0 AND nm = 0 THEN 1 ELSE 0 END)
               OVER (PARTITION BY run_id, rank, it ORDER BY t) AS island
    FROM state
    WHERE t_next IS NOT NULL
)
SELECT run_id, rank, it, min(t) AS ts, max(t_next) AS end_ts
FROM seg
WHERE NOT busy
GROUP BY run_id, rank, it, island;

-- Communication that may explain a window: device mode the comm kernels, timeline mode the
-- `comm` events, host mode the communication host ops (named by kind and group description).
CREATE VIEW _pipeline_comm AS
SELECT d.run_id, d.rank, d.name, d.ts, d.end_ts
FROM core_device_op d JOIN _pipeline_rank r USING (run_id, rank)
WHERE r.mode = 'device' AND d.kernel_type = 'comm'
UNION ALL
SELECT e.run_id, e.rank, e.name, e.ts, e.ts + e.dur AS end_ts
FROM event e JOIN _pipeline_rank r USING (run_id, rank)
WHERE r.mode = 'timeline' AND e.category = 'comm' AND e.ts IS NOT NULL AND e.dur > 0
UNION ALL
SELECT h.run_id, h.rank, h.kind || coalesce(' ' || g.description, '') AS name, h.ts, h.end_ts
FROM core_comm_host_op h
JOIN _pipeline_rank r USING (run_id, rank)
LEFT JOIN comm_group g USING (run_id, group_id)
WHERE r.mode = 'host' AND h.dur > 0;

-- Each window with its rank-iteration's stage, mode and iteration, and its position (head before
-- the first compute op, tail after the last, else inner).
CREATE VIEW _pipeline_placed AS
SELECT w.run_id, w.rank, w.it, w.ts, w.end_ts, w.end_ts - w.ts AS dur, s.iteration, s.c_ts,
       s.c_end, r.stage, r.mode, r.capacity_bytes,
       CASE WHEN w.end_ts <= s.c_ts THEN 'head' WHEN w.ts >= s.c_end THEN 'tail' ELSE 'inner' END
           AS position
FROM _pipeline_window w
JOIN _pipeline_span s USING (run_id, rank, it)
JOIN _pipeline_rank r USING (run_id, rank);

-- Memory state: per rank, device type and instant, the allocated total after the allocator
-- events there (the highest, when several share the ns).
CREATE VIEW _pipeline_memory AS
SELECT run_id, rank, device_type, ts, max(total_allocated) AS allocated
FROM memory
WHERE total_allocated IS NOT NULL
GROUP BY ALL;

-- The idle windows of each rank's compute lane of at least `min_ns` ns, with what surrounds
-- them and the memory free at their start. `position` says where the window lies: `head`
-- (before the iteration's first compute op: the pipeline warm-up, input loading, launch
-- latency), `inner` (between two compute ops: waiting on a peer stage or a collective), `tail`
-- (after its last compute op). Memory: the allocated total after the last allocator event at or
-- before the window's start (device type `cuda` in device mode, `cpu` in host mode), the
-- capacity from the trace's device properties, and their difference. Class members of an
-- emulated sliced run have no events of their own: their exemplar's rows stand for them.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column stage           Pipeline stage (`rank.pp`; 0 when the run has no pipeline).
-- @column mode            device | timeline | host.
-- @column iteration       Training step; NULL for a whole-trace window.
-- @column position        head | inner | tail.
-- @column ts              Window start, ns.
-- @column end_ts          Window end, ns.
-- @column dur             Window length, ns.
-- @column op_before       The compute op that ended last before the window (the longest of those ending then).
-- @column op_after        The compute op that starts the window's end (the longest of those starting then).
-- @column waiting_on      The communication overlapping the window longest (NULL if none).
-- @column allocated_bytes Allocated bytes at the window's start (NULL without memory events).
-- @column capacity_bytes  Device memory capacity (NULL when the trace does not say).
-- @column free_bytes      capacity_bytes - allocated_bytes.
CREATE MACRO pipeline_bubble_at(min_ns) AS TABLE
WITH w AS (
    SELECT *, CASE mode WHEN 'device' THEN 'cuda' WHEN 'host' THEN 'cpu' END AS mem_device
    FROM _pipeline_placed
    WHERE dur >= min_ns
),
before_t AS (
    SELECT w.run_id, w.rank, w.it, w.ts, c.end_ts AS t
    FROM w ASOF LEFT JOIN _pipeline_compute c
      ON c.run_id = w.run_id AND c.rank = w.rank AND c.it = w.it AND c.end_ts <= w.ts
),
after_t AS (
    SELECT w.run_id, w.rank, w.it, w.ts, c.ts AS t
    FROM w ASOF LEFT JOIN (SELECT run_id, rank, it, ts, -ts AS neg_ts FROM _pipeline_compute) c
      ON c.run_id = w.run_id AND c.rank = w.rank AND c.it = w.it AND c.neg_ts <= -w.end_ts
),
ends AS (
    SELECT run_id, rank, it, end_ts AS t, arg_max(name, dur) AS name
    FROM _pipeline_compute GROUP BY ALL
),
starts AS (
    SELECT run_id, rank, it, ts AS t, arg_max(name, dur) AS name
    FROM _pipeline_compute GROUP BY ALL
),
waiting AS (
    SELECT w.run_id, w.rank, w.it, w.ts,
           arg_max(c.name, least(c.end_ts, w.end_ts) - greatest(c.ts, w.ts)) AS name
    FROM w JOIN _pipeline_comm c
      ON c.run_id = w.run_id AND c.rank = w.rank AND c.ts < w.end_ts AND c.end_ts > w.ts
    GROUP BY ALL
),
mem AS (
    SELECT w.run_id, w.rank, w.it, w.ts, m.allocated
    FROM w ASOF LEFT JOIN _pipeline_memory m
      ON m.run_id = w.run_id AND m.rank = w.rank AND m.device_type = w.mem_device
     AND m.ts <= w.ts
)
SELECT w.run_id, w.rank, w.stage, w.mode, w.iteration, w.position, w.ts, w.end_ts, w.dur, eb.name AS op_before, sa.name AS op_after,
       wt.name AS waiting_on, m.allocated AS allocated_bytes, w.capacity_bytes,
       w.capacity_bytes - m.allocated AS free_bytes
FROM w
LEFT JOIN before_t b USING (run_id, rank, it, ts)
LEFT JOIN ends eb ON eb.run_id = w.run_id AND eb.rank = w.rank AND eb.it = w.it AND eb.t = b.t
LEFT JOIN after_t a USING (run_id, rank, it, ts)
LEFT JOIN starts sa ON sa.run_id = w.run_id AND sa.rank = w.rank AND sa.it = w.it AND sa.t = a.t
LEFT JOIN waiting wt USING (run_id, rank, it, ts)
LEFT JOIN mem m USING (run_id, rank, it, ts)
ORDER BY w.run_id, w.rank, w.ts;

-- Every idle window of the compute lanes (`pipeline_bubble_at(0)`).
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column stage           Pipeline stage (`rank.pp`; 0 when the run has no pipeline).
-- @column mode            device | timeline | host.
-- @column iteration       Training step; NULL for a whole-trace window.
-- @column position        head | inner | tail.
-- @column ts              Window start, ns.
-- @column end_ts          Window end, ns.
-- @column dur             Window length, ns.
-- @column op_before       The compute op that ended last before the window.
-- @column op_after        The compute op that starts at the window's end.
-- @column waiting_on      The communication overlapping the window longest (NULL if none).
-- @column allocated_bytes Allocated bytes at the window's start (NULL without memory events).
-- @column capacity_bytes  Device memory capacity (NULL when the trace does not say).
-- @column free_bytes      capacity_bytes - allocated_bytes.
CREATE VIEW pipeline_bubble AS
SELECT * FROM pipeline_bubble_at(0);

-- Bubbles per stage and iteration, over the stage's ranks: windows of at least `min_ns` ns, their
-- count, total, mean and longest, the parts at the head/inner/tail of the iteration, and the
-- bubble fraction of the ranks' spans.
--
-- @column run_id          The run.
-- @column stage           Pipeline stage.
-- @column iteration       Training step; NULL for whole-trace windows.
-- @column mode            Mode of the stage's ranks.
-- @column ranks           Ranks of the stage with compute ops in the iteration.
-- @column span_ns         Sum of the ranks' spans (iteration window covering its compute ops), ns.
-- @column busy_ns         Sum of the ranks' busy (compute) time, ns.
-- @column bubbles         Idle windows.
-- @column bubble_ns       Their total length, ns.
-- @column mean_ns         Mean window length, ns.
-- @column max_ns          Longest window, ns.
-- @column head_ns         Part before the first compute op, ns.
-- @column inner_ns        Part between compute ops, ns.
-- @column tail_ns         Part after the last compute op, ns.
-- @column bubble_pct      100 * bubble_ns / span_ns.
CREATE MACRO pipeline_stage_iteration_at(min_ns) AS TABLE
WITH sp AS (
    SELECT s.run_id, r.stage, s.iteration, min(r.mode) AS mode, count(*) AS ranks,
           sum(s.end_ts - s.ts)::BIGINT AS span_ns
    FROM _pipeline_span s JOIN _pipeline_rank r USING (run_id, rank)
    GROUP BY ALL
),
idle AS (
    SELECT s.run_id, r.stage, s.iteration, sum(w.end_ts - w.ts)::BIGINT AS idle_ns
    FROM _pipeline_window w
    JOIN _pipeline_span s USING (run_id, rank, it)
    JOIN _pipeline_rank r USING (run_id, rank)
    GROUP BY ALL
),
b AS (
    SELECT run_id, stage, iteration, count(*) AS bubbles, sum(dur)::BIGINT AS bubble_ns,
           avg(dur) AS mean_ns, max(dur) AS max_ns,
           coalesce(sum(dur) FILTER (WHERE position = 'head'), 0)::BIGINT AS head_ns,
           coalesce(sum(dur) FILTER (WHERE position = 'inner'), 0)::BIGINT AS inner_ns,
           coalesce(sum(dur) FILTER (WHERE position = 'tail'), 0)::BIGINT AS tail_ns
    FROM _pipeline_placed
    WHERE dur >= min_ns
    GROUP BY ALL
)
SELECT sp.run_id, sp.stage, sp.iteration, sp.mode, sp.ranks, sp.span_ns,
       sp.span_ns - coalesce(i.idle_ns, 0) AS busy_ns,
       coalesce(b.bubbles, 0) AS bubbles, coalesce(b.bubble_ns, 0) AS bubble_ns, b.mean_ns,
       b.max_ns, coalesce(b.head_ns, 0) AS head_ns, coalesce(b.inner_ns, 0) AS inner_ns,
       coalesce(b.tail_ns, 0) AS tail_ns,
       100.0 * coalesce(b.bubble_ns, 0) / nullif(sp.span_ns, 0) AS bubble_pct
FROM sp
LEFT JOIN idle i
  ON i.run_id = sp.run_id AND i.stage = sp.stage AND i.iteration IS NOT DISTINCT FROM sp.iteration
LEFT JOIN b
  ON b.run_id = sp.run_id AND b.stage = sp.stage AND b.iteration IS NOT DISTINCT FROM sp.iteration
ORDER BY sp.run_id, sp.stage, sp.iteration;

-- Bubbles per stage over all its iterations: `pipeline_stage_iteration_at(min_ns)` summed.
--
-- @column run_id          The run.
-- @column stage           Pipeline stage.
-- @column mode            Mode of the stage's ranks.
-- @column ranks           Ranks of the stage.
-- @column iterations      Iterations (rank-iteration spans are summed over them).
-- @column span_ns         Sum of the rank-iteration spans, ns.
-- @column busy_ns         Sum of the busy (compute) time, ns.
-- @column bubbles         Idle windows.
-- @column bubbles_per_iteration  Windows per rank and iteration.
-- @column bubble_ns       Their total length, ns.
-- @column mean_ns         Mean window length, ns.
-- @column max_ns          Longest window, ns.
-- @column head_ns         Part before the first compute op of an iteration, ns.
-- @column inner_ns        Part between compute ops, ns.
-- @column tail_ns         Part after the last compute op of an iteration, ns.
-- @column bubble_pct      100 * bubble_ns / span_ns.
CREATE MACRO pipeline_stage_at(min_ns) AS TABLE
SELECT run_id, stage, min(mode) AS mode, max(ranks) AS ranks, count(*) AS iterations,
       sum(span_ns)::BIGINT AS span_ns, sum(busy_ns)::BIGINT AS busy_ns,
       sum(bubbles)::BIGINT AS bubbles, sum(bubbles) / sum(ranks) AS bubbles_per_iteration,
       sum(bubble_ns)::BIGINT AS bubble_ns, sum(bubble_ns) / nullif(sum(bubbles), 0) AS mean_ns,
       max(max_ns) AS max_ns, sum(head_ns)::BIGINT AS head_ns,
       sum(inner_ns)::BIGINT AS inner_ns, sum(tail_ns)::BIGINT AS tail_ns,
       100.0 * sum(bubble_ns) / nullif(sum(span_ns), 0) AS bubble_pct
FROM pipeline_stage_iteration_at(min_ns)
GROUP BY run_id, stage
ORDER BY run_id, stage;

-- Bubbles per stage, every window counted (`pipeline_stage_at(0)`).
--
-- @column run_id          The run.
-- @column stage           Pipeline stage.
-- @column mode            Mode of the stage's ranks.
-- @column ranks           Ranks of the stage.
-- @column iterations      Iterations.
-- @column span_ns         Sum of the rank-iteration spans, ns.
-- @column busy_ns         Sum of the busy (compute) time, ns.
-- @column bubbles         Idle windows.
-- @column bubbles_per_iteration  Windows per rank and iteration.
-- @column bubble_ns       Their total length, ns.
-- @column mean_ns         Mean window length, ns.
-- @column max_ns          Longest window, ns.
-- @column head_ns         Part before the first compute op of an iteration, ns.
-- @column inner_ns        Part between compute ops, ns.
-- @column tail_ns         Part after the last compute op of an iteration, ns.
-- @column bubble_pct      100 * bubble_ns / span_ns.
CREATE VIEW pipeline_stage AS
SELECT * FROM pipeline_stage_at(0);
