"""What a store holds: the runs, and for one run its ranks, groups, steps and time span."""

from __future__ import annotations

from typing import Any

from prism_trace.store import Store

__all__ = ["describe_run", "list_runs", "render_run"]


def _rows(store: Store, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    cur = store.con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def list_runs(store: Store) -> list[dict[str, Any]]:
    """One summary row per run, in creation order."""
    return _rows(
        store,
        """
        SELECT r.name, r.kind, r.world_size, r.source_format,
               (SELECT count(*) FROM rank k WHERE k.run_id = r.run_id) AS ranks,
               (SELECT count(DISTINCT iteration) FROM iteration i WHERE i.run_id = r.run_id)
                   AS iterations,
               r.created_at
        FROM run r ORDER BY r.run_id
        """,
        [],
    )


def describe_run(store: Store, name: str) -> dict[str, Any]:
    """Everything `prism info --run` shows, as plain JSON-ready values.

    Raises:
        PrismError: no run of that name.
    """
    rid = store.require_run(name)
    run = _rows(
        store,
        "SELECT name, kind, world_size, source_format, created_at FROM run WHERE run_id = ?",
        [rid],
    )[0]
    ranks = _rows(
        store,
        """
        SELECT k.rank, k.backend, k.device, k.et_ops, k.et_ops_linked,
               (SELECT count(*) FROM event e WHERE e.run_id = k.run_id AND e.rank = k.rank)
                   AS events,
               (SELECT count(*) FROM event e WHERE e.run_id = k.run_id AND e.rank = k.rank
                    AND e.category = 'kernel') AS kernels,
               (SELECT count(*) FROM collective c WHERE c.run_id = k.run_id AND c.rank = k.rank)
                   AS collectives,
               (SELECT count(*) FROM p2p p WHERE p.run_id = k.run_id AND p.rank = k.rank)
                   AS p2p
        FROM rank k WHERE k.run_id = ? ORDER BY k.rank
        """,
        [rid],
    )
    steps = _rows(
        store,
        "SELECT rank, iteration, dur FROM iteration WHERE run_id = ? ORDER BY rank, iteration",
        [rid],
    )
    per_rank: dict[int, dict[int, int]] = {}
    for s in steps:
        per_rank.setdefault(s["rank"], {})[s["iteration"]] = s["dur"]
    for r in ranks:
        times = per_rank.get(r["rank"], {})
        r["iteration_times_ns"] = times
        r["mean_iteration_ns"] = sum(times.values()) / len(times) if times else None
    groups = _rows(
        store,
        """
        SELECT g.name, g.description, g.backend, g.size, g.ranks,
               (SELECT count(*) FROM collective c WHERE c.run_id = g.run_id
                    AND c.group_id = g.group_id)
               + (SELECT count(*) FROM p2p p WHERE p.run_id = g.run_id
                    AND p.group_id = g.group_id) AS calls
        FROM comm_group g WHERE g.run_id = ? ORDER BY g.group_id
        """,
        [rid],
    )
    span = store.con.execute(
        "SELECT min(ts), max(ts + dur) FROM event WHERE run_id = ? AND ts IS NOT NULL", [rid]
    ).fetchall()[0]
    unmatched = store.con.execute(
        "SELECT count(*) FROM collective_instance i JOIN comm_group g USING (run_id, group_id)"
        " WHERE i.run_id = ? AND NOT i.matched"
        " AND list_has_all((SELECT list(rank) FROM rank WHERE run_id = ?), g.ranks)",
        [rid, rid],
    ).fetchall()[0]
    return {
        **run,
        "iterations": sorted({s["iteration"] for s in steps}),
        "ranks": ranks,
        "comm_groups": groups,
        "time_span_ns": None if span is None or span[0] is None else span[1] - span[0],
        "start_ns": None if span is None else span[0],
        "unmatched_collectives": 0 if unmatched is None else unmatched[0],
        "layout": _layout(store, name),
    }


def _layout(store: Store, name: str) -> dict[str, Any]:
    """The run's layout and where it came from (``layout.choose_layout``)."""
    from prism_trace.layout import choose_layout

    return choose_layout(store, name).as_dict()


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms"


def render_run(info: dict[str, Any]) -> str:
    """A human-readable page for one run."""
    lines = [
        f"run {info['name']!r} ({info['kind']}, {info['source_format']}):"
        f" {len(info['ranks'])} of {info['world_size']} ranks, time span"
        f" {_ms(info['time_span_ns'])}, iterations {info['iterations']}",
        "",
        f"{'rank':>5} {'backend':<8} {'events':>8} {'kernels':>8} {'colls':>6} {'p2p':>5}"
        f" {'ET linked':>12} {'mean iteration':>15}",
    ]
    for r in info["ranks"]:
        et = "-" if r["et_ops"] is None else f"{r['et_ops_linked']}/{r['et_ops']}"
        lines.append(
            f"{r['rank']:>5} {r['backend'] or '-':<8} {r['events']:>8} {r['kernels']:>8}"
            f" {r['collectives']:>6} {r['p2p']:>5} {et:>12} {_ms(r['mean_iteration_ns']):>15}"
        )
    layout = info.get("layout") or {}
    if layout.get("spec"):
        lines += ["", f"layout {layout['spec']} (order {layout['order']}, {layout['source']})"]
    lines += ["", "process groups:"]
    for g in info["comm_groups"]:
        lines.append(
            f"  {g['name']:<12} {g['description'] or '-':<16} size {g['size']}"
            f" ranks {g['ranks']} calls {g['calls']}"
        )
    if info["unmatched_collectives"]:
        lines.append(
            f"\nwarning: {info['unmatched_collectives']} collective instances do not match"
            " across ranks (see view collective_instance WHERE NOT matched)"
        )
    return "\n".join(lines)
