-- core: the shared vocabulary of the analyses (windows, device ops, communication host ops).
--
-- Every view reads only schema tables, so it works on recorded, sliced, emulated and replayed
-- runs alike. Times are integer ns on the run clock; `end_ts` is always `ts + dur`.

-- The time windows an analysis covers: one per (run, rank, iteration) from the `iteration`
-- table; a rank without iteration rows gets one window spanning all its timed events, with
-- `iteration` NULL.
--
-- @column run_id     The run.
-- @column rank       The rank.
-- @column iteration  Training step of the window; NULL for a whole-trace window.
-- @column ts         Window start, ns.
-- @column end_ts     Window end, ns.
-- @column dur        Window length, ns.
CREATE VIEW core_window AS
SELECT run_id, rank, iteration, ts, ts + dur AS end_ts, dur
FROM iteration
UNION ALL
SELECT e.run_id, e.rank, NULL::INTEGER AS iteration, min(e.ts) AS ts,
       max(e.ts + coalesce(e.dur, 0)) AS end_ts,
       max(e.ts + coalesce(e.dur, 0)) - min(e.ts) AS dur
FROM event e
WHERE e.ts IS NOT NULL AND e.category <> 'instant'
  AND NOT EXISTS (SELECT 1 FROM iteration i WHERE i.run_id = e.run_id AND i.rank = e.rank)
GROUP BY e.run_id, e.rank;

-- Kernels linked to a collective or point-to-point call (always communication).
CREATE VIEW _core_comm_kernel AS
SELECT run_id, rank, kernel_event_id AS event_id FROM collective
WHERE kernel_event_id IS NOT NULL
UNION
SELECT run_id, rank, kernel_event_id AS event_id FROM p2p
WHERE kernel_event_id IS NOT NULL;

-- The start of the runtime/driver call that launched each correlation id (its first, when several).
CREATE VIEW _core_launch AS
SELECT run_id, rank, correlation, min(ts) AS launch_ts
FROM event
WHERE category IN ('cuda_runtime', 'cuda_driver') AND correlation IS NOT NULL
GROUP BY run_id, rank, correlation;

-- Each rank's step count and the start of its last step (HTA leaves the last step out).
CREATE VIEW _core_stepped AS
SELECT run_id, rank, count(*) AS steps, max(ts) AS last_step_ts
FROM iteration
GROUP BY run_id, rank;

-- Device ops (kernels, memcpy, memset) with HTA's kernel type, their stream and their launch.
--
-- `kernel_type` follows HTA's `get_kernel_type` on the name, in this order: `comm` when the
-- name matches `^nccl.*Kernel` or a collective/p2p row links the kernel; `memory` for the
-- memcpy/memset categories and names starting `Memcpy`, `Memset` or `dma`; `other` for names
-- containing `Memcpy` or `Sync`; `compute` otherwise.
--
-- @column run_id       The run.
-- @column rank         The rank.
-- @column event_id     The device event.
-- @column track_id     Its stream (track).
-- @column stream       CUDA stream id (`track.tid`).
-- @column category     kernel | memcpy | memset.
-- @column name         Kernel name.
-- @column kernel_type  compute | comm | memory | other.
-- @column ts           Start, ns.
-- @column dur          Duration, ns.
-- @column end_ts       End, ns.
-- @column correlation  CUDA correlation id.
-- @column launch_ts    Start of the runtime/driver call that launched it (NULL if unknown).
-- @column iteration    Training step the launch belongs to.
-- @column in_steps     Counted by the analyses: launched inside a step, or the rank has no steps.
-- @column in_hta       Counted by HTA: launched before the rank's last step starts (HTA drops
--                      the last profiler step), or every op when the rank has fewer than two steps.
CREATE VIEW core_device_op AS
SELECT e.run_id, e.rank, e.event_id, e.track_id, t.tid AS stream, e.category, e.name,
       CASE
           WHEN regexp_matches(e.name, '^nccl.*Kernel') OR ck.event_id IS NOT NULL THEN 'comm'
           WHEN e.category IN ('memcpy', 'memset')
                OR regexp_matches(e.name, '^(Memcpy|Memset|dma)') THEN 'memory'
           WHEN regexp_matches(e.name, 'Memcpy|Sync') THEN 'other'
           ELSE 'compute'
       END AS kernel_type,
       e.ts, e.dur, e.ts + e.dur AS end_ts, e.correlation, l.launch_ts, e.iteration,
       (e.iteration IS NOT NULL OR s.rank IS NULL) AS in_steps,
       (coalesce(s.steps, 0) < 2 OR l.launch_ts < s.last_step_ts) AS in_hta
FROM event e
LEFT JOIN track t USING (run_id, rank, track_id)
LEFT JOIN _core_comm_kernel ck USING (run_id, rank, event_id)
LEFT JOIN _core_launch l USING (run_id, rank, correlation)
LEFT JOIN _core_stepped s USING (run_id, rank)
WHERE e.category IN ('kernel', 'memcpy', 'memset') AND e.ts IS NOT NULL AND e.dur IS NOT NULL;

-- How each rank is analysed: `device` when it has device ops (kernels, memcpy, memset);
-- `timeline` when it has op-timeline events instead (categories `compute` and `comm`, e.g.
-- Megatron-style timelines); `host` otherwise (CPU-only ranks such as gloo runs: host ops).
--
-- @column run_id  The run.
-- @column rank    The rank.
-- @column mode    device | timeline | host.
CREATE VIEW core_rank_mode AS
WITH dev AS (
    SELECT DISTINCT run_id, rank FROM event WHERE category IN ('kernel', 'memcpy', 'memset')
),
tl AS (
    SELECT DISTINCT run_id, rank FROM event WHERE category IN ('compute', 'comm')
)
SELECT r.run_id, r.rank,
       CASE WHEN d.rank IS NOT NULL THEN 'device'
            WHEN t.rank IS NOT NULL THEN 'timeline'
            ELSE 'host' END AS mode
FROM (SELECT DISTINCT run_id, rank FROM event) r
LEFT JOIN dev d USING (run_id, rank)
LEFT JOIN tl t USING (run_id, rank);

-- Communication host ops: the host op of every collective and point-to-point call.
--
-- @column run_id     The run.
-- @column rank       The rank.
-- @column event_id   The host op.
-- @column track_id   Thread it ran on.
-- @column kind       Collective kind, or `send` / `recv`.
-- @column group_id   Communicator.
-- @column ts         Start of the host op, ns.
-- @column dur        Duration of the host op, ns.
-- @column end_ts     End of the host op, ns.
CREATE VIEW core_comm_host_op AS
SELECT c.run_id, c.rank, c.event_id, e.track_id, c.kind, c.group_id,
       c.host_ts AS ts, c.host_dur AS dur, c.host_ts + c.host_dur AS end_ts
FROM collective c
LEFT JOIN event e USING (run_id, rank, event_id)
WHERE c.host_ts IS NOT NULL AND c.host_dur IS NOT NULL
UNION ALL
SELECT p.run_id, p.rank, p.event_id, e.track_id, p.direction AS kind, p.group_id,
       p.host_ts AS ts, p.host_dur AS dur, p.host_ts + p.host_dur AS end_ts
FROM p2p p
LEFT JOIN event e USING (run_id, rank, event_id)
WHERE p.host_ts IS NOT NULL AND p.host_dur IS NOT NULL;
