-- breakdown: where each rank's time goes (HTA's temporal, kernel, overlap and idle breakdowns).
-- include: core

-- Ranks that have device ops; the others are analysed on the host (gloo / CPU-only runs).
CREATE VIEW _breakdown_device_rank AS
SELECT DISTINCT run_id, rank FROM core_device_op;

-- Activity intervals of each rank, with their class and precedence `level` (1 wins).
-- Device mode: device ops, compute 1 > comm 2 > memory 3 > other 4. Host mode: comm host ops 1 >
-- cpu_op events 2 (a thread inside a communication call is blocked in it, so the ops nested in
-- it are communication). `overlappable`: may count as computation hiding communication (host
-- cpu_ops only on threads that issue no communication).
CREATE VIEW _breakdown_activity AS
SELECT run_id, rank, kernel_type AS class,
       CASE kernel_type WHEN 'compute' THEN 1 WHEN 'comm' THEN 2 WHEN 'memory' THEN 3 ELSE 4 END
           AS level,
       TRUE AS overlappable, ts, end_ts
FROM core_device_op
UNION ALL
SELECT h.run_id, h.rank, 'comm' AS class, 1 AS level, TRUE AS overlappable, h.ts, h.end_ts
FROM core_comm_host_op h
ANTI JOIN _breakdown_device_rank d USING (run_id, rank)
UNION ALL
SELECT e.run_id, e.rank, 'compute' AS class, 2 AS level, ct.track_id IS NULL AS overlappable,
       e.ts, e.ts + e.dur AS end_ts
FROM event e
ANTI JOIN _breakdown_device_rank d USING (run_id, rank)
LEFT JOIN (SELECT DISTINCT run_id, rank, track_id FROM core_comm_host_op) ct
    USING (run_id, rank, track_id)
WHERE e.category = 'cpu_op' AND e.ts IS NOT NULL AND e.dur IS NOT NULL;

-- Activity clipped to the windows it overlaps (`w_ts` names the window within the rank).
CREATE VIEW _breakdown_clipped AS
SELECT a.run_id, a.rank, w.ts AS w_ts, a.class, a.level, a.overlappable,
       greatest(a.ts, w.ts) AS ts, least(a.end_ts, w.end_ts) AS end_ts
FROM _breakdown_activity a
JOIN core_window w
  ON w.run_id = a.run_id AND w.rank = a.rank AND a.ts < w.end_ts AND a.end_ts > w.ts;

-- The interval sets whose unions the breakdowns need: `level<L>` (all classes of precedence
-- <= L), `comm`, `overlap_compute` (overlappable compute) and `overlap_union` (both).
CREATE VIEW _breakdown_member AS
SELECT run_id, rank, w_ts, 'level' || l.lvl AS set_name, ts, end_ts
FROM _breakdown_clipped JOIN range(1, 5) AS l(lvl) ON level <= l.lvl
UNION ALL
SELECT run_id, rank, w_ts, 'comm' AS set_name, ts, end_ts
FROM _breakdown_clipped WHERE class = 'comm'
UNION ALL
SELECT run_id, rank, w_ts, 'overlap_compute' AS set_name, ts, end_ts
FROM _breakdown_clipped WHERE class = 'compute' AND overlappable
UNION ALL
SELECT run_id, rank, w_ts, 'overlap_union' AS set_name, ts, end_ts
FROM _breakdown_clipped WHERE class = 'comm' OR (class = 'compute' AND overlappable);

-- Length of the union of each set per window: in start order, an interval adds the part of it
-- past the running maximum of the earlier ends (one window pass, no loop).
CREATE VIEW _breakdown_union AS
SELECT run_id, rank, w_ts,
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
    SELECT run_id, rank, w_ts, set_name,
           greatest(0, end_ts - greatest(ts, coalesce(max(end_ts) OVER (
               PARTITION BY run_id, rank, w_ts, set_name ORDER BY ts, end_ts
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), ts))) AS covered
    FROM _breakdown_member
)
GROUP BY run_id, rank, w_ts;

-- Temporal breakdown per rank and iteration window: each instant of the window goes to one
-- class, the busiest-precedence one active then. Device mode: compute > comm > memory > other
-- (HTA's order: communication hidden under computation counts as computation). Host mode
-- (no device ops): comm > compute. Idle: no activity. The six parts sum to the window.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column iteration       Training step; NULL for a whole-trace window.
-- @column mode            device (kernels) | host (CPU-only rank: host ops).
-- @column window_ns       Window length, ns.
-- @column compute_ns      Computation, ns (device: compute kernels; host: cpu_op time outside communication calls).
-- @column comm_ns         Communication not hidden by computation, ns (device: NCCL kernels; host: communication host ops).
-- @column memory_ns       memcpy/memset not under computation or communication, ns.
-- @column other_ns        Other device ops (HTA's `other` kernel type) not under the above, ns.
-- @column idle_ns         Nothing running, ns.
-- @column compute_pct     compute_ns as a percentage of the window.
-- @column comm_pct        comm_ns as a percentage of the window.
-- @column memory_pct      memory_ns as a percentage of the window.
-- @column other_pct       other_ns as a percentage of the window.
-- @column idle_pct        idle_ns as a percentage of the window.
CREATE VIEW breakdown_temporal_iteration AS
WITH part AS (
    SELECT w.run_id, w.rank, w.iteration, w.ts,
           CASE WHEN d.rank IS NULL THEN 'host' ELSE 'device' END AS mode,
           w.dur AS window_ns,
           coalesce(u.level1, 0) AS l1, coalesce(u.level2, 0) AS l2,
           coalesce(u.level3, 0) AS l3, coalesce(u.level4, 0) AS l4
    FROM core_window w
    LEFT JOIN _breakdown_union u ON u.run_id = w.run_id AND u.rank = w.rank AND u.w_ts = w.ts
    LEFT JOIN _breakdown_device_rank d ON d.run_id = w.run_id AND d.rank = w.rank
),
ns AS (
    SELECT run_id, rank, iteration, ts, mode, window_ns,
           CASE mode WHEN 'device' THEN l1 ELSE l2 - l1 END AS compute_ns,
           CASE mode WHEN 'device' THEN l2 - l1 ELSE l1 END AS comm_ns,
           l3 - l2 AS memory_ns, l4 - l3 AS other_ns, window_ns - l4 AS idle_ns
    FROM part
)
SELECT run_id, rank, iteration, mode, window_ns, compute_ns, comm_ns, memory_ns, other_ns,
       idle_ns,
       100.0 * compute_ns / nullif(window_ns, 0) AS compute_pct,
       100.0 * comm_ns / nullif(window_ns, 0) AS comm_pct,
       100.0 * memory_ns / nullif(window_ns, 0) AS memory_pct,
       100.0 * other_ns / nullif(window_ns, 0) AS other_pct,
       100.0 * idle_ns / nullif(window_ns, 0) AS idle_pct
FROM ns
ORDER BY run_id, rank, ts;

-- Temporal breakdown per rank: `breakdown_temporal_iteration` summed over the rank's windows.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column mode            device | host.
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

-- Communication/computation overlap per rank and iteration window: how much of the time
-- communication runs is also computation time (HTA's `get_comm_comp_overlap`, over windows).
-- Device mode: NCCL kernels against compute kernels. Host mode: communication host ops against
-- cpu_ops of threads that issue no communication.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column iteration       Training step; NULL for a whole-trace window.
-- @column mode            device | host.
-- @column comm_ns         Union of communication intervals, ns.
-- @column compute_ns      Union of the computation intervals it is compared with, ns.
-- @column overlap_ns      Time both run, ns.
-- @column overlap_pct     overlap_ns as a percentage of comm_ns (NULL without communication).
CREATE VIEW breakdown_overlap_iteration AS
SELECT w.run_id, w.rank, w.iteration,
       CASE WHEN d.rank IS NULL THEN 'host' ELSE 'device' END AS mode,
       coalesce(u.comm, 0) AS comm_ns, coalesce(u.overlap_compute, 0) AS compute_ns,
       coalesce(u.comm + u.overlap_compute - u.overlap_union, 0) AS overlap_ns,
       100.0 * (u.comm + u.overlap_compute - u.overlap_union) / nullif(u.comm, 0) AS overlap_pct
FROM core_window w
LEFT JOIN _breakdown_union u ON u.run_id = w.run_id AND u.rank = w.rank AND u.w_ts = w.ts
LEFT JOIN _breakdown_device_rank d ON d.run_id = w.run_id AND d.rank = w.rank
ORDER BY w.run_id, w.rank, w.ts;

-- Communication/computation overlap per rank, summed over its windows.
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column mode            device | host.
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

-- Device-op time per rank, kernel type and name (the ops counted: launched in a step, or all
-- of a rank without steps); duration statistics as HTA's `get_gpu_kernel_breakdown` per rank.
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
SELECT run_id, rank, kernel_type, name, count(*) AS calls, sum(dur)::BIGINT AS total_ns,
       min(dur) AS min_ns, max(dur) AS max_ns, avg(dur) AS mean_ns,
       coalesce(stddev_samp(dur), 0) AS std_ns
FROM core_device_op
WHERE in_steps
GROUP BY run_id, rank, kernel_type, name;

-- Kernel breakdown of a run: each kernel's total over all ranks, its share of its kernel type,
-- and the spread of its per-rank totals across the ranks that ran it.
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
WITH k AS (
    SELECT run_id, kernel_type, name, sum(calls)::BIGINT AS calls,
           sum(total_ns)::BIGINT AS total_ns, count(*) AS ranks,
           min(total_ns) AS rank_min_ns, max(total_ns) AS rank_max_ns,
           avg(total_ns) AS rank_mean_ns, coalesce(stddev_samp(total_ns), 0) AS rank_std_ns,
           arg_max(rank, total_ns) AS max_rank
    FROM breakdown_kernel_rank
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

-- Idle gaps on each stream (HTA's `get_idle_time_breakdown`): between consecutive counted device
-- ops of a stream in start order, the gap `ts - previous end` is `host_wait` when the op was
-- launched after the previous op ended, else `kernel_wait` when shorter than
-- `consecutive_kernel_delay` ns (back-to-back launch overhead), else `other` (waiting on another
-- stream, another rank or a synchronisation).
--
-- @column run_id          The run.
-- @column rank            The rank.
-- @column stream          CUDA stream id.
-- @column idle_category   host_wait | kernel_wait | other.
-- @column gaps            Gaps in the category.
-- @column idle_ns         Their total, ns.
-- @column idle_ratio      Share of the stream's idle time.
CREATE MACRO breakdown_idle_at(consecutive_kernel_delay) AS TABLE
WITH g AS (
    SELECT run_id, rank, stream, ts, launch_ts,
           ts - lag(end_ts) OVER (PARTITION BY run_id, rank, track_id ORDER BY ts, end_ts)
               AS gap,
           lag(end_ts) OVER (PARTITION BY run_id, rank, track_id ORDER BY ts, end_ts)
               AS prev_end
    FROM core_device_op
    WHERE in_steps
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
