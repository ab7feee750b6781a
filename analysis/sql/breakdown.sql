-- breakdown: where each rank's time goes (HTA's temporal, kernel, overlap and idle breakdowns).
-- include: core

-- CUDA synchronisation events that HTA counts as device time (`hta` windows only): the
-- `cuda_sync` events on a stream (`args.stream` >= 0: `Stream Sync`, `Stream Wait Event`; HTA's
-- `stream != -1`, so `Event Sync` and `Context Sync`, on stream -1, are left out), launched
-- before the rank's last step starts when it has two or more (HTA keeps them with the kernels
-- in `_filter_irrelevant_gpu_kernels`). HTA's temporal breakdown takes every event on a stream
-- as device activity: a sync widens its window and counts as `other` (its name matches `Sync`),
-- never as idle. The kernel, overlap and idle breakdowns leave them out, as HTA's do.
--
-- @column run_id   The run.
-- @column rank     The rank.
-- @column ts       Start, ns.
-- @column end_ts   End, ns.
CREATE VIEW _breakdown_hta_sync AS
SELECT e.run_id, e.rank, e.ts, e.ts + e.dur AS end_ts
FROM event e
JOIN core_rank_mode m USING (run_id, rank)
LEFT JOIN _core_launch l USING (run_id, rank, correlation)
LEFT JOIN _core_stepped s USING (run_id, rank)
WHERE e.category = 'cuda_sync' AND m.mode = 'device' AND e.ts IS NOT NULL AND e.dur IS NOT NULL
  AND TRY_CAST(json_extract_string(e.args, '$.stream') AS BIGINT) >= 0
  AND (coalesce(s.steps, 0) < 2 OR l.launch_ts < s.last_step_ts);

-- The windows each breakdown covers, in two flavours (`window_kind`).
--
-- `step` (prism's default): one window per iteration of the rank. On a device rank the device
-- ops *launched* in a step count to that step, wherever they run: the window starts at the
-- step's start (or where the previous step's window ended, if later) and ends at the step's end
-- or the end of the last device op launched in it, whichever is later, so no device work is
-- clipped at the ProfilerStep end. Other ranks, and ranks without steps, keep the `core_window`
-- windows.
-- `hta` (HTA's semantics): one window per device rank, from the first start to the last end of
-- the device ops HTA keeps (`core_device_op.in_hta`) and the syncs it counts
-- (`_breakdown_hta_sync`), on HTA's integer-µs clock (a start rounded up, an end down to whole
-- µs, as HTA's `round_down_time_stamps`); other ranks keep their `step` windows.
CREATE VIEW _breakdown_window AS
WITH dev_end AS (
    SELECT run_id, rank, iteration, max(end_ts) AS dev_end
    FROM core_device_op
    WHERE iteration IS NOT NULL
    GROUP BY run_id, rank, iteration
),
stretched AS (
    SELECT w.run_id, w.rank, w.iteration, m.mode, w.ts,
           greatest(w.end_ts, coalesce(d.dev_end, w.end_ts)) AS end_ts
    FROM core_window w
    JOIN core_rank_mode m ON m.run_id = w.run_id AND m.rank = w.rank
    LEFT JOIN dev_end d
      ON m.mode = 'device' AND d.run_id = w.run_id AND d.rank = w.rank
     AND d.iteration = w.iteration
),
step AS (
    SELECT run_id, rank, iteration, mode, end_ts,
           greatest(ts, coalesce(max(end_ts) OVER (
               PARTITION BY run_id, rank ORDER BY ts, end_ts
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), ts)) AS ts
    FROM stretched
)
SELECT 'step' AS window_kind, run_id, rank, iteration, mode, ts, greatest(end_ts, ts) AS end_ts
FROM step
UNION ALL
SELECT 'hta' AS window_kind, run_id, rank, iteration, mode, ts, greatest(end_ts, ts) AS end_ts
FROM step
WHERE mode <> 'device'
UNION ALL
SELECT 'hta' AS window_kind, run_id, rank, NULL::INTEGER AS iteration, 'device' AS mode,
       min((ts + 999) // 1000 * 1000) AS ts, max(end_ts // 1000 * 1000) AS end_ts
FROM (SELECT run_id, rank, ts, end_ts FROM core_device_op WHERE in_hta
      UNION ALL
      SELECT run_id, rank, ts, end_ts FROM _breakdown_hta_sync)
GROUP BY run_id, rank;

-- Activity intervals of each rank, with their class and precedence `level` (1 wins), by mode.
-- Device: device ops, compute 1 > comm 2 > memory 3 > other 4 (and, in `hta` windows only, the
-- syncs HTA counts, as other). Timeline: events of category
-- `compute` (class compute, 1) and `comm` (class comm, 2). Host: comm host ops 1 > cpu_op
-- events 2 (a thread inside a communication call is blocked in it, so the ops nested in it are
-- communication). `overlappable`: may count as computation hiding communication (host cpu_ops
-- only on threads that issue no communication). `iteration`, `in_steps`, `in_hta` select the
-- device ops of a window (see `_breakdown_window`); `hta_ts`, `hta_end_ts` are HTA's integer-µs
-- view of a device op (start rounded up, end down to whole µs).
CREATE VIEW _breakdown_activity AS
SELECT run_id, rank, kernel_type AS class,
       CASE kernel_type WHEN 'compute' THEN 1 WHEN 'comm' THEN 2 WHEN 'memory' THEN 3 ELSE 4 END
           AS level,
       TRUE AS overlappable, ts, end_ts, iteration, in_steps, in_hta,
       (ts + 999) // 1000 * 1000 AS hta_ts, end_ts // 1000 * 1000 AS hta_end_ts
FROM core_device_op
UNION ALL
SELECT run_id, rank, 'other' AS class, 4 AS level, TRUE AS overlappable, ts, end_ts,
       NULL::INTEGER AS iteration, FALSE AS in_steps, TRUE AS in_hta,
       (ts + 999) // 1000 * 1000 AS hta_ts, end_ts // 1000 * 1000 AS hta_end_ts
FROM _breakdown_hta_sync
UNION ALL
SELECT e.run_id, e.rank, e.category AS class,
       CASE e.category WHEN 'compute' THEN 1 ELSE 2 END AS level, TRUE AS overlappable,
       e.ts, e.ts + e.dur AS end_ts, e.iteration, TRUE AS in_steps, TRUE AS in_hta,
       e.ts AS hta_ts, e.ts + e.dur AS hta_end_ts
FROM event e
JOIN core_rank_mode m USING (run_id, rank)
WHERE m.mode = 'timeline' AND e.category IN ('compute', 'comm')
  AND e.ts IS NOT NULL AND e.dur IS NOT NULL
UNION ALL
SELECT h.run_id, h.rank, 'comm' AS class, 1 AS level, TRUE AS overlappable, h.ts, h.end_ts,
       NULL::INTEGER AS iteration, TRUE AS in_steps, TRUE AS in_hta, h.ts AS hta_ts,
       h.end_ts AS hta_end_ts
FROM core_comm_host_op h
JOIN core_rank_mode m USING (run_id, rank)
WHERE m.mode = 'host'
UNION ALL
SELECT e.run_id, e.rank, 'compute' AS class, 2 AS level, ct.track_id IS NULL AS overlappable,
       e.ts, e.ts + e.dur AS end_ts, NULL::INTEGER AS iteration, TRUE AS in_steps,
       TRUE AS in_hta, e.ts AS hta_ts, e.ts + e.dur AS hta_end_ts
FROM event e
JOIN core_rank_mode m USING (run_id, rank)
LEFT JOIN (SELECT DISTINCT run_id, rank, track_id FROM core_comm_host_op) ct
    USING (run_id, rank, track_id)
WHERE m.mode = 'host' AND e.category = 'cpu_op' AND e.ts IS NOT NULL AND e.dur IS NOT NULL;

-- Activity clipped to the windows it counts to (`w_ts` names the window within the rank and
-- window kind). Device ops go to the window of the step that launched them (`step`) or to the
-- one `hta` window when HTA keeps them; other activity to the windows it overlaps.
CREATE VIEW _breakdown_clipped AS
WITH a AS (
    SELECT k.window_kind, a.run_id, a.rank, a.class, a.level, a.overlappable, a.iteration,
           a.in_steps, a.in_hta,
           CASE k.window_kind WHEN 'hta' THEN a.hta_ts ELSE a.ts END AS ts,
           CASE k.window_kind WHEN 'hta' THEN a.hta_end_ts ELSE a.end_ts END AS end_ts
    FROM _breakdown_activity a
    CROSS JOIN (VALUES ('step'), ('hta')) AS k(window_kind)
)
SELECT w.window_kind, a.run_id, a.rank, w.ts AS w_ts, a.class, a.level, a.overlappable,
       greatest(a.ts, w.ts) AS ts, least(a.end_ts, w.end_ts) AS end_ts
FROM a
JOIN _breakdown_window w
  ON w.window_kind = a.window_kind AND w.run_id = a.run_id AND w.rank = a.rank
 AND a.ts < w.end_ts AND a.end_ts > w.ts
WHERE CASE WHEN w.mode <> 'device' THEN TRUE
           WHEN w.window_kind = 'hta' THEN a.in_hta
           WHEN w.iteration IS NULL THEN a.in_steps
           ELSE a.iteration IS NOT DISTINCT FROM w.iteration END;

-- The interval sets whose unions the breakdowns need: `level<L>` (all classes of precedence
-- <= L), `comm`, `overlap_compute` (overlappable compute) and `overlap_union` (both).
CREATE VIEW _breakdown_member AS
SELECT window_kind, run_id, rank, w_ts, 'level' || l.lvl AS set_name, ts, end_ts
FROM _breakdown_clipped JOIN range(1, 5) AS l(lvl) ON level <= l.lvl
UNION ALL
SELECT window_kind, run_id, rank, w_ts, 'comm' AS set_name, ts, end_ts
FROM _breakdown_clipped WHERE class = 'comm'
UNION ALL
SELECT window_kind, run_id, rank, w_ts, 'overlap_compute' AS set_name, ts, end_ts
FROM _breakdown_clipped WHERE class = 'compute' AND overlappable
UNION ALL
SELECT window_kind, run_id, rank, w_ts, 'overlap_union' AS set_name, ts, end_ts
FROM _breakdown_clipped WHERE class = 'comm' OR (class = 'compute' AND overlappable);

-- Length of the union of each set per window: in start order, an interval adds the part of it
-- past the running maximum of the earlier ends (one window pass, no loop).
CREATE VIEW _breakdown_union AS
SELECT window_kind, run_id, rank, w_ts,
       coalesce(sum(covered) FILTER (WHERE set_name = 'level1'), 0)::BIGINT AS level1,
       coalesce(sum(covered) FILTER (WHERE set_name = 'level2'), 0)::BIGINT AS level2,
       coalesce(sum(covered) FILTER (WHERE set_name = 'level3'), 0)::BIGINT AS level3,
       coalesce(sum(covered) FILTER (WHERE set_name = 'level4'), 0)::BIGINT AS level4,
       coalesce(sum(covered) FILTER (WHERE set_name = 'comm'), 0)::BIGINT AS comm,
       coalesce(sum(covered) FILTER (WHERE set_name = 'overlap_compute'), 0)::BIGINT
           AS overlap_compute,
       coalesce(sum(covered) FILTER (WHERE set_name = 'overlap_union'), 0)::BIGINT
           AS overlap_union
FROM (
    SELECT window_kind, run_id, rank, w_ts, set_name,
           greatest(0, end_ts - greatest(ts, coalesce(max(end_ts) OVER (
               PARTITION BY window_kind, run_id, rank, w_ts, set_name ORDER BY ts, end_ts
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), ts))) AS covered
    FROM _breakdown_member
)
GROUP BY window_kind, run_id, rank, w_ts;

-- The temporal parts of every window of both kinds (see `breakdown_temporal_iteration`).
CREATE VIEW _breakdown_temporal_window AS
WITH part AS (
    SELECT w.window_kind, w.run_id, w.rank, w.iteration, w.ts, w.mode,
           w.end_ts - w.ts AS window_ns,
           coalesce(u.level1, 0) AS l1, coalesce(u.level2, 0) AS l2,
           coalesce(u.level3, 0) AS l3, coalesce(u.level4, 0) AS l4
    FROM _breakdown_window w
    LEFT JOIN _breakdown_union u
      ON u.window_kind = w.window_kind AND u.run_id = w.run_id AND u.rank = w.rank
     AND u.w_ts = w.ts
),
ns AS (
    SELECT window_kind, run_id, rank, iteration, ts, mode, window_ns,
           CASE mode WHEN 'host' THEN l2 - l1 ELSE l1 END AS compute_ns,
           CASE mode WHEN 'host' THEN l1 ELSE l2 - l1 END AS comm_ns,
           l3 - l2 AS memory_ns, l4 - l3 AS other_ns, window_ns - l4 AS idle_ns
    FROM part
)
SELECT window_kind, run_id, rank, iteration, ts, mode, window_ns, compute_ns, comm_ns,
       memory_ns, other_ns, idle_ns,
       100.0 * compute_ns / nullif(window_ns, 0) AS compute_pct,
       100.0 * comm_ns / nullif(window_ns, 0) AS comm_pct,
       100.0 * memory_ns / nullif(window_ns, 0) AS memory_pct,
       100.0 * other_ns / nullif(window_ns, 0) AS other_pct,
       100.0 * idle_ns / nullif(window_ns, 0) AS idle_pct
FROM ns;

-- Temporal breakdown per rank and iteration window (`step` windows, see `_breakdown_window`):
-- each instant of the window goes to one class, the busiest-precedence one active then. Device
-- and timeline mode: compute > comm > memory > other (HTA's order: communication hidden under
-- computation counts as computation). Host mode (no device ops): comm > compute. Idle: no
-- activity. The parts sum to the window.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column iteration       Training step; NULL for a whole-trace window.
-- @column mode            device (kernels) | timeline (op-timeline ops) | host (CPU-only rank: host ops).
-- @column window_ns       Window length, ns (a device rank's step stretches to the end of the device work it launched).
-- @column compute_ns      Computation, ns (device: compute kernels; timeline: `compute` ops; host: cpu_op time outside communication calls).
-- @column comm_ns         Communication not hidden by computation, ns (device: NCCL kernels; timeline: `comm` ops; host: communication host ops).
-- @column memory_ns       memcpy/memset not under computation or communication, ns.
-- @column other_ns        Other device ops (HTA's `other` kernel type) not under the above, ns.
-- @column idle_ns         Nothing running, ns.
-- @column compute_pct     compute_ns as a percentage of the window.
-- @column comm_pct        comm_ns as a percentage of the window.
-- @column memory_pct      memory_ns as a percentage of the window.
-- @column other_pct       other_ns as a percentage of the window.
-- @column idle_pct        idle_ns as a percentage of the window.
CREATE VIEW breakdown_temporal_iteration AS
SELECT run_id, rank, iteration, mode, window_ns, compute_ns, comm_ns, memory_ns, other_ns,
       idle_ns, compute_pct, comm_pct, memory_pct, other_pct, idle_pct
FROM _breakdown_temporal_window
WHERE window_kind = 'step'
ORDER BY run_id, rank, ts;

-- Temporal breakdown per rank: `breakdown_temporal_iteration` summed over the rank's windows.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column mode            device | timeline | host.
-- @column iterations      Windows summed (0 when the rank has only a whole-trace window).
-- @column window_ns       Total window length, ns.
-- @column compute_ns      Computation, ns.
-- @column comm_ns         Communication not hidden by computation, ns.
-- @column memory_ns       memcpy/memset not under computation or communication, ns.
-- @column other_ns        Other device ops, ns.
-- @column idle_ns         Nothing running, ns.
-- @column compute_pct     compute_ns as a percentage of window_ns.
-- @column comm_pct        comm_ns as a percentage of window_ns.
-- @column memory_pct      memory_ns as a percentage of window_ns.
-- @column other_pct       other_ns as a percentage of window_ns.
-- @column idle_pct        idle_ns as a percentage of window_ns.
CREATE VIEW breakdown_temporal AS
WITH s AS (
    SELECT run_id, rank, any_value(mode) AS mode, count(iteration) AS iterations,
           sum(window_ns)::BIGINT AS window_ns, sum(compute_ns)::BIGINT AS compute_ns,
           sum(comm_ns)::BIGINT AS comm_ns, sum(memory_ns)::BIGINT AS memory_ns,
           sum(other_ns)::BIGINT AS other_ns, sum(idle_ns)::BIGINT AS idle_ns
    FROM breakdown_temporal_iteration
    GROUP BY run_id, rank
)
SELECT *,
       100.0 * compute_ns / nullif(window_ns, 0) AS compute_pct,
       100.0 * comm_ns / nullif(window_ns, 0) AS comm_pct,
       100.0 * memory_ns / nullif(window_ns, 0) AS memory_pct,
       100.0 * other_ns / nullif(window_ns, 0) AS other_pct,
       100.0 * idle_ns / nullif(window_ns, 0) AS idle_pct
FROM s
ORDER BY run_id, rank;

-- Temporal breakdown per rank with HTA's window (`hta` windows, see `_breakdown_window`): on a
-- device rank one window from the first start to the last end of the device ops HTA keeps, as
-- `get_temporal_breakdown`'s `kernel_time`; other ranks are summed over their steps.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column mode            device | timeline | host.
-- @column window_ns       Window length, ns (HTA's `kernel_time` on a device rank).
-- @column compute_ns      Computation, ns (HTA's `compute_time`).
-- @column comm_ns         Communication not hidden by computation, ns.
-- @column memory_ns       memcpy/memset not under computation or communication, ns.
-- @column other_ns        Other device ops, ns.
-- @column idle_ns         Nothing running, ns (HTA's `idle_time`).
-- @column compute_pct     compute_ns as a percentage of window_ns.
-- @column comm_pct        comm_ns as a percentage of window_ns.
-- @column memory_pct      memory_ns as a percentage of window_ns.
-- @column other_pct       other_ns as a percentage of window_ns.
-- @column idle_pct        idle_ns as a percentage of window_ns.
CREATE VIEW breakdown_temporal_hta AS
WITH s AS (
    SELECT run_id, rank, any_value(mode) AS mode,
           sum(window_ns)::BIGINT AS window_ns, sum(compute_ns)::BIGINT AS compute_ns,
           sum(comm_ns)::BIGINT AS comm_ns, sum(memory_ns)::BIGINT AS memory_ns,
           sum(other_ns)::BIGINT AS other_ns, sum(idle_ns)::BIGINT AS idle_ns
    FROM _breakdown_temporal_window
    WHERE window_kind = 'hta'
    GROUP BY run_id, rank
)
SELECT *,
       100.0 * compute_ns / nullif(window_ns, 0) AS compute_pct,
       100.0 * comm_ns / nullif(window_ns, 0) AS comm_pct,
       100.0 * memory_ns / nullif(window_ns, 0) AS memory_pct,
       100.0 * other_ns / nullif(window_ns, 0) AS other_pct,
       100.0 * idle_ns / nullif(window_ns, 0) AS idle_pct
FROM s
ORDER BY run_id, rank;

-- Overlap parts of every window of both kinds (see `breakdown_overlap_iteration`).
CREATE VIEW _breakdown_overlap_window AS
SELECT w.window_kind, w.run_id, w.rank, w.iteration, w.ts, w.mode,
       coalesce(u.comm, 0) AS comm_ns, coalesce(u.overlap_compute, 0) AS compute_ns,
       coalesce(u.comm + u.overlap_compute - u.overlap_union, 0) AS overlap_ns
FROM _breakdown_window w
LEFT JOIN _breakdown_union u
  ON u.window_kind = w.window_kind AND u.run_id = w.run_id AND u.rank = w.rank
 AND u.w_ts = w.ts;

-- Communication/computation overlap per rank and iteration window (`step` windows): how much
-- of the time communication runs is also computation time (HTA's `get_comm_comp_overlap`, over
-- windows). Device mode: NCCL kernels against compute kernels. Timeline mode: `comm` ops
-- against `compute` ops. Host mode: communication host ops against cpu_ops of threads that
-- issue no communication.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column iteration       Training step; NULL for a whole-trace window.
-- @column mode            device | timeline | host.
-- @column comm_ns         Union of communication intervals, ns.
-- @column compute_ns      Union of the computation intervals it is compared with, ns.
-- @column overlap_ns      Time both run, ns.
-- @column overlap_pct     overlap_ns as a percentage of comm_ns (NULL without communication).
CREATE VIEW breakdown_overlap_iteration AS
SELECT run_id, rank, iteration, mode, comm_ns, compute_ns, overlap_ns,
       100.0 * overlap_ns / nullif(comm_ns, 0) AS overlap_pct
FROM _breakdown_overlap_window
WHERE window_kind = 'step'
ORDER BY run_id, rank, ts;

-- Communication/computation overlap per rank, summed over its windows.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column mode            device | timeline | host.
-- @column comm_ns         Union of communication intervals, ns.
-- @column compute_ns      Union of the computation intervals it is compared with, ns.
-- @column overlap_ns      Time both run, ns.
-- @column overlap_pct     overlap_ns as a percentage of comm_ns (NULL without communication).
CREATE VIEW breakdown_overlap AS
SELECT run_id, rank, any_value(mode) AS mode, sum(comm_ns)::BIGINT AS comm_ns,
       sum(compute_ns)::BIGINT AS compute_ns, sum(overlap_ns)::BIGINT AS overlap_ns,
       100.0 * sum(overlap_ns) / nullif(sum(comm_ns), 0) AS overlap_pct
FROM breakdown_overlap_iteration
GROUP BY run_id, rank
ORDER BY run_id, rank;

-- Communication/computation overlap per rank with HTA's window (`hta` windows): on a device rank
-- the device ops HTA keeps, as `get_comm_comp_overlap`.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column mode            device | timeline | host.
-- @column comm_ns         Union of communication intervals, ns.
-- @column compute_ns      Union of the computation intervals it is compared with, ns.
-- @column overlap_ns      Time both run, ns.
-- @column overlap_pct     overlap_ns as a percentage of comm_ns (NULL without communication).
CREATE VIEW breakdown_overlap_hta AS
SELECT run_id, rank, any_value(mode) AS mode, sum(comm_ns)::BIGINT AS comm_ns,
       sum(compute_ns)::BIGINT AS compute_ns, sum(overlap_ns)::BIGINT AS overlap_ns,
       100.0 * sum(overlap_ns) / nullif(sum(comm_ns), 0) AS overlap_pct
FROM _breakdown_overlap_window
WHERE window_kind = 'hta'
GROUP BY run_id, rank
ORDER BY run_id, rank;

-- Device-op time per rank, kernel type and name of the counted ops, with duration statistics
-- as HTA's `get_gpu_kernel_breakdown` per rank. `window_kind` `step` counts the ops launched in
-- a step (all ops of a rank without steps), `hta` those HTA keeps (`core_device_op.in_hta`),
-- with HTA's integer-µs durations (end rounded down minus start rounded up); `it` keeps only the ops launched in that iteration (NULL: all).
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column kernel_type     compute | comm | memory | other.
-- @column name            Kernel name.
-- @column calls           Executions.
-- @column total_ns        Sum of durations, ns.
-- @column min_ns          Shortest execution, ns.
-- @column max_ns          Longest execution, ns.
-- @column mean_ns         Mean duration, ns.
-- @column std_ns          Sample standard deviation of durations, ns (0 for one call).
CREATE MACRO breakdown_kernel_rank_at(window_kind := 'step', it := NULL) AS TABLE
SELECT run_id, rank, kernel_type, name, count(*) AS calls, sum(d)::BIGINT AS total_ns,
       min(d) AS min_ns, max(d) AS max_ns, avg(d) AS mean_ns,
       coalesce(stddev_samp(d), 0) AS std_ns
FROM (SELECT *, CASE WHEN window_kind = 'hta'
                      THEN end_ts // 1000 * 1000 - (ts + 999) // 1000 * 1000 ELSE dur END AS d
      FROM core_device_op)
WHERE CASE WHEN window_kind = 'hta' THEN in_hta ELSE in_steps END
  AND (it IS NULL OR iteration = it)
GROUP BY run_id, rank, kernel_type, name;

-- `breakdown_kernel_rank_at` with prism's default window (ops launched in a step), all
-- iterations.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column kernel_type     compute | comm | memory | other.
-- @column name            Kernel name.
-- @column calls           Executions.
-- @column total_ns        Sum of durations, ns.
-- @column min_ns          Shortest execution, ns.
-- @column max_ns          Longest execution, ns.
-- @column mean_ns         Mean duration, ns.
-- @column std_ns          Sample standard deviation of durations, ns (0 for one call).
CREATE VIEW breakdown_kernel_rank AS
SELECT * FROM breakdown_kernel_rank_at();

-- Kernel breakdown of a run: each kernel's total over all ranks, its share of its kernel type,
-- and the spread of its per-rank totals across the ranks that ran it. `window_kind` and `it`
-- as in `breakdown_kernel_rank_at`; `rank_list` keeps only those ranks (NULL: all).
--
-- @column run_id          The run.
-- @column kernel_type     compute | comm | memory | other.
-- @column name            Kernel name.
-- @column type_rank       1 for the kernel with the largest total within its type, 2 next, ...
-- @column calls           Executions over all ranks.
-- @column total_ns        Sum of durations over all ranks, ns.
-- @column type_pct        total_ns as a percentage of its kernel type's total.
-- @column ranks           Ranks that ran it.
-- @column rank_min_ns     Smallest per-rank total, ns.
-- @column rank_max_ns     Largest per-rank total, ns.
-- @column rank_mean_ns    Mean per-rank total, ns.
-- @column rank_std_ns     Sample standard deviation of the per-rank totals, ns (0 for one rank).
-- @column max_rank        Rank with the largest total.
CREATE MACRO breakdown_kernel_at(window_kind := 'step', it := NULL, rank_list := NULL) AS TABLE
WITH k AS (
    SELECT run_id, kernel_type, name, sum(calls)::BIGINT AS calls,
           sum(total_ns)::BIGINT AS total_ns, count(*) AS ranks,
           min(total_ns) AS rank_min_ns, max(total_ns) AS rank_max_ns,
           avg(total_ns) AS rank_mean_ns, coalesce(stddev_samp(total_ns), 0) AS rank_std_ns,
           arg_max(rank, total_ns) AS max_rank
    FROM breakdown_kernel_rank_at(window_kind := window_kind, it := it)
    WHERE rank_list IS NULL OR list_contains(rank_list, rank)
    GROUP BY run_id, kernel_type, name
)
SELECT run_id, kernel_type, name,
       row_number() OVER (PARTITION BY run_id, kernel_type ORDER BY total_ns DESC, name)
           AS type_rank,
       calls, total_ns,
       100.0 * total_ns / sum(total_ns) OVER (PARTITION BY run_id, kernel_type) AS type_pct,
       ranks, rank_min_ns, rank_max_ns, rank_mean_ns, rank_std_ns, max_rank
FROM k
ORDER BY run_id, kernel_type, type_rank;

-- `breakdown_kernel_at` over every rank and iteration with prism's default window.
--
-- @column run_id          The run.
-- @column kernel_type     compute | comm | memory | other.
-- @column name            Kernel name.
-- @column type_rank       1 for the kernel with the largest total within its type, 2 next, ...
-- @column calls           Executions over all ranks.
-- @column total_ns        Sum of durations over all ranks, ns.
-- @column type_pct        total_ns as a percentage of its kernel type's total.
-- @column ranks           Ranks that ran it.
-- @column rank_min_ns     Smallest per-rank total, ns.
-- @column rank_max_ns     Largest per-rank total, ns.
-- @column rank_mean_ns    Mean per-rank total, ns.
-- @column rank_std_ns     Sample standard deviation of the per-rank totals, ns (0 for one rank).
-- @column max_rank        Rank with the largest total.
CREATE VIEW breakdown_kernel AS
SELECT * FROM breakdown_kernel_at();

-- Idle gaps on each stream (HTA's `get_idle_time_breakdown`): between consecutive counted device
-- ops of a stream in start order, the gap `ts - previous end` is `host_wait` when the op was
-- launched after the previous op ended, else `kernel_wait` when shorter than
-- `consecutive_kernel_delay` ns (back-to-back launch overhead), else `other` (waiting on another
-- stream, another rank or a synchronisation). `window_kind` and `it` select the counted ops as
-- in `breakdown_kernel_rank_at` (`hta` also puts times on HTA's integer-µs clock).
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column stream          CUDA stream id.
-- @column idle_category   host_wait | kernel_wait | other.
-- @column gaps            Gaps in the category.
-- @column idle_ns         Their total, ns.
-- @column idle_ratio      Share of the stream's idle time.
CREATE MACRO breakdown_idle_at(consecutive_kernel_delay, window_kind := 'step', it := NULL)
AS TABLE
WITH o AS (
    SELECT run_id, rank, stream, track_id, iteration, in_steps, in_hta,
           CASE WHEN window_kind = 'hta' THEN (ts + 999) // 1000 * 1000 ELSE ts END AS ts,
           CASE WHEN window_kind = 'hta' THEN end_ts // 1000 * 1000 ELSE end_ts END AS end_ts,
           CASE WHEN window_kind = 'hta' THEN (launch_ts + 999) // 1000 * 1000
                ELSE launch_ts END AS launch_ts
    FROM core_device_op
),
g AS (
    SELECT run_id, rank, stream, ts, launch_ts,
           ts - lag(end_ts) OVER (PARTITION BY run_id, rank, track_id ORDER BY ts, end_ts)
               AS gap,
           lag(end_ts) OVER (PARTITION BY run_id, rank, track_id ORDER BY ts, end_ts)
               AS prev_end
    FROM o
    WHERE CASE WHEN window_kind = 'hta' THEN in_hta ELSE in_steps END
      AND (it IS NULL OR iteration = it)
),
c AS (
    SELECT run_id, rank, stream,
           CASE WHEN launch_ts > prev_end THEN 'host_wait'
                WHEN gap < consecutive_kernel_delay THEN 'kernel_wait'
                ELSE 'other' END AS idle_category,
           count(*) AS gaps, sum(gap)::BIGINT AS idle_ns
    FROM g
    WHERE prev_end IS NOT NULL
    GROUP BY ALL
)
SELECT *, idle_ns / nullif(sum(idle_ns) OVER (PARTITION BY run_id, rank, stream), 0)
              AS idle_ratio
FROM c
ORDER BY run_id, rank, stream, idle_category;

-- `breakdown_idle_at` with HTA's default threshold: `consecutive_kernel_delay = 30` in HTA's
-- trace time unit (µs), i.e. 30000 ns.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column stream          CUDA stream id.
-- @column idle_category   host_wait | kernel_wait | other.
-- @column gaps            Gaps in the category.
-- @column idle_ns         Their total, ns.
-- @column idle_ratio      Share of the stream's idle time.
CREATE VIEW breakdown_idle AS
SELECT * FROM breakdown_idle_at(30000);
