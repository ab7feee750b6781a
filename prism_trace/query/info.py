"""What a store holds: the runs, and for one run its ranks (or classes), groups and steps.

A recorded run is described rank by rank. A sliced or emulated run of thousands of ranks is
described class by class (`rank.class_id`): one line per equivalence class with its size and
exemplar, since every member of a class has the same graph; ``ranks=`` asks for chosen ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prism_trace.errors import SelectionError
from prism_trace.ranks import format_ranks
from prism_trace.store.connection import Store

__all__ = [
    "compact_ranks",
    "describe_run",
    "list_runs",
    "render_run",
    "require_ranks",
    "stored_config",
]


def _rows(store: Store, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    cur = store.con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def compact_ranks(ranks: Sequence[int]) -> str:
    """``[0, 2, 4, 6, 9]`` -> ``"0..6:2,9"``: rank lists as `prism_trace.ranks` parses them."""
    return format_ranks(ranks)


def require_ranks(
    store: Store, name: str, ranks: Sequence[int], *, option: str, recorded: bool = False
) -> None:
    """Refuse ``ranks`` that run ``name`` lacks, naming ``option``: a rank outside the run's
    world (or, with ``recorded``, one it did not record) would otherwise select nothing, and
    the command would print an empty answer, or fail later under another option's name.

    Raises:
        RunNotFoundError: no such run.
        SelectionError: a rank outside the world (not recorded).
    """
    rid = store.require_run(name)
    ((world, stored),) = store.con.execute(
        "SELECT r.world_size, (SELECT list(rank ORDER BY rank) FROM rank k WHERE k.run_id ="
        " r.run_id) FROM run r WHERE r.run_id = ?",
        [rid],
    ).fetchall()
    have = set(stored or []) if recorded else set(range(int(world)))
    bad = [r for r in ranks if r not in have]
    if not bad:
        return
    held = format_ranks(sorted(have)) or "none"
    which = f"recorded ranks {held}" if recorded else f"world 0..{world - 1}"
    msg = f"{store.path}: {option} {format_ranks(bad, limit=4)}: not in run {name!r} ({which})"
    raise SelectionError(msg)


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


# Per-rank counts, aggregated once per table (not one correlated sub-query per rank).
_RANK_ROWS = """
WITH ev AS (SELECT rank, count(*) AS events, count(*) FILTER (category = 'kernel') AS kernels
            FROM event WHERE run_id = $rid GROUP BY rank),
     co AS (SELECT rank, count(*) AS n FROM collective WHERE run_id = $rid GROUP BY rank),
     pp AS (SELECT rank, count(*) AS n FROM p2p WHERE run_id = $rid GROUP BY rank),
     gn AS (SELECT rank, count(*) AS n FROM graph_node WHERE run_id = $rid GROUP BY rank),
     it AS (SELECT rank, list(dur ORDER BY iteration) AS iteration_times_ns,
                   avg(dur) AS mean_iteration_ns
            FROM iteration WHERE run_id = $rid GROUP BY rank)
SELECT k.rank, k.class_id, k.represented_by, k.backend, k.device, k.et_ops, k.et_ops_linked,
       coalesce(ev.events, 0) AS events, coalesce(ev.kernels, 0) AS kernels,
       coalesce(co.n, 0) AS collectives, coalesce(pp.n, 0) AS p2p,
       coalesce(gn.n, 0) AS graph_nodes,
       coalesce(it.iteration_times_ns, []) AS iteration_times_ns, it.mean_iteration_ns
FROM rank k LEFT JOIN ev USING (rank) LEFT JOIN co USING (rank) LEFT JOIN pp USING (rank)
     LEFT JOIN it USING (rank) LEFT JOIN gn USING (rank)
WHERE k.run_id = $rid AND ($all OR list_contains($ranks, k.rank))
ORDER BY k.rank
"""

# One row per equivalence class: its members, its exemplar (lowest rank) and that rank's counts.
_CLASS_ROWS = """
WITH r AS ({rank_rows})
SELECT class_id, count(*) AS size, list(rank ORDER BY rank) AS members,
       min(rank) AS exemplar, any_value(represented_by ORDER BY rank) AS represented_by,
       arg_min(events, rank) AS events, arg_min(kernels, rank) AS kernels,
       arg_min(collectives, rank) AS collectives, arg_min(p2p, rank) AS p2p,
       max(graph_nodes) AS graph_nodes,
       avg(mean_iteration_ns) AS mean_iteration_ns,
       min(mean_iteration_ns) AS min_iteration_ns, max(mean_iteration_ns) AS max_iteration_ns
FROM r GROUP BY class_id ORDER BY class_id
"""


def describe_run(store: Store, name: str, *, ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """Everything `prism info --run` shows, as JSON-ready values (numbers stay numbers).

    A run whose ranks carry equivalence classes (sliced, emulated) is summarised per class under
    ``classes`` unless ``ranks`` picks ranks; other runs list every rank under ``ranks``.

    Raises:
        RunNotFoundError: no run of that name.
        SelectionError: a rank of ``ranks`` outside its world.
    """
    rid = store.require_run(name)
    if ranks is not None:
        require_ranks(store, name, ranks, option="--ranks")
    run = _rows(
        store,
        "SELECT name, kind, world_size, source_format, created_at FROM run WHERE run_id = ?",
        [rid],
    )[0]
    params = {"rid": rid, "all": ranks is None, "ranks": list(ranks or [])}
    rank_count, with_class = store.con.execute(
        "SELECT count(*), count(class_id) FROM rank WHERE run_id = ?", [rid]
    ).fetchall()[0]
    out: dict[str, Any] = {**run, "rank_count": rank_count}
    iterations = store.con.execute(
        "SELECT list(DISTINCT iteration ORDER BY iteration) FROM iteration WHERE run_id = ?", [rid]
    ).fetchall()[0][0]
    out["iterations"] = iterations or []
    if with_class and ranks is None:
        classes = _rows(store, _CLASS_ROWS.format(rank_rows=_RANK_ROWS), params)  # type: ignore[arg-type]
        for c in classes:
            c["ranks"] = compact_ranks(c.pop("members"))
        out["classes"] = classes
    else:
        out["ranks"] = _rows(store, _RANK_ROWS, params)  # type: ignore[arg-type]
    calls = """
        WITH c AS (SELECT group_id, count(*) AS n FROM collective WHERE run_id = $rid
                   GROUP BY group_id
                   UNION ALL
                   SELECT group_id, count(*) FROM p2p WHERE run_id = $rid GROUP BY group_id),
             g AS (SELECT g.*, coalesce((SELECT sum(n) FROM c WHERE c.group_id = g.group_id), 0)
                              ::BIGINT AS calls
                   FROM comm_group g WHERE g.run_id = $rid)
    """
    if "classes" in out:
        # Thousands of groups of a few shapes: one line per shape, not per group.
        out["comm_groups"] = _rows(
            store,
            calls
            + """SELECT axis, description, size, count(*) AS groups, sum(calls)::BIGINT AS calls
                 FROM g GROUP BY ALL ORDER BY size DESC, axis""",
            {"rid": rid},  # type: ignore[arg-type]
        )
    else:
        out["comm_groups"] = _rows(
            store,
            calls
            + """SELECT name, description, backend, axis, size, ranks, calls FROM g
                 WHERE $all OR list_has_any(ranks, $ranks) ORDER BY group_id""",
            params,  # type: ignore[arg-type]
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
    out["time_span_ns"] = None if span is None or span[0] is None else span[1] - span[0]
    out["start_ns"] = None if span is None else span[0]
    out["unmatched_collectives"] = 0 if unmatched is None else unmatched[0]
    out["layout"] = _layout(store, name)
    out["config"] = stored_config(store, name)[1]
    return out


CONFIGURED_BY = {"emulated": "emulate", "replayed": "replay"}
"""Run kinds whose command reads a ``--config`` file, and that command."""


def stored_config(store: Store, name: str) -> tuple[str, dict[str, Any] | None]:
    """The run's kind and the resolved config it was made with (``run.config_json.config``;
    None for a run not made from a config file).

    Every run made by a command with ``--config`` (`CONFIGURED_BY`) stores, under ``config``,
    what it ran with after defaults, the file and the flags, in the sections of that file: given
    back to ``--config`` it makes the same run. The other keys of ``config_json`` say where the
    run came from (its input run, ranks, what was measured). Emulated runs written before
    ``config`` existed kept the sections at the top level; they are read from there.

    Raises:
        RunNotFoundError: no run of that name.
    """
    import json

    rid = store.require_run(name)
    ((kind, text),) = store.con.execute(
        "SELECT kind, config_json FROM run WHERE run_id = ?", [rid]
    ).fetchall()
    data = json.loads(text or "{}")
    if isinstance(data.get("config"), dict):
        return kind, dict(data["config"])
    if kind == "emulated" and "timing" in data:
        return kind, {k: v for k, v in data.items() if k not in ("input_run", "input_kind")}
    return kind, None


def _layout(store: Store, name: str) -> dict[str, Any]:
    """The run's layout and where it came from (``layout.choose_layout``)."""
    from prism_trace.layout.choice import choose_layout

    return choose_layout(store, name).as_dict()


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms"


def _groups(groups: list[dict[str, Any]], *, limit: int = 40) -> list[str]:
    if groups and "groups" in groups[0]:  # one line per group shape (sliced/emulated runs)
        lines = [f"process groups ({sum(g['groups'] for g in groups)}, by shape):"]
        lines += [
            f"  {g['groups']:>6} x {g['axis'] or '-':<6} {g['description'] or '-':<16}"
            f" size {g['size']} calls {g['calls']}"
            for g in groups
        ]
        return lines
    lines = [f"process groups ({len(groups)}):"]
    for g in groups[:limit]:
        members = compact_ranks(g["ranks"] or [])
        lines.append(
            f"  {g['name']:<12} {g['description'] or '-':<16} size {g['size']}"
            f" ranks {members} calls {g['calls']}"
        )
    if len(groups) > limit:
        lines.append(f"  ... {len(groups) - limit} more (prism query: SELECT * FROM comm_group)")
    return lines


def render_run(info: dict[str, Any]) -> str:
    """A human-readable page for one run: per rank, or per class for sliced/emulated runs."""
    lines = [
        f"run {info['name']!r} ({info['kind']}, {info['source_format']}):"
        f" {info['rank_count']} of {info['world_size']} ranks, time span"
        f" {_ms(info['time_span_ns'])}, iterations {info['iterations']}",
        "",
    ]
    if "classes" in info:
        lines.append(
            f"{'class':>6} {'size':>6} {'exemplar':>8} {'nodes':>8} {'colls':>6} {'p2p':>5}"
            f" {'mean iteration':>15}  ranks"
        )
        for c in info["classes"]:
            lines.append(
                f"{c['class_id']:>6} {c['size']:>6} {c['exemplar']:>8} {c['graph_nodes']:>8}"
                f" {c['collectives']:>6} {c['p2p']:>5} {_ms(c['mean_iteration_ns']):>15}"
                f"  {c['ranks']}"
            )
        lines.append("(one line per equivalence class; --ranks R lists chosen ranks)")
    else:
        lines.append(
            f"{'rank':>5} {'backend':<8} {'events':>8} {'kernels':>8} {'colls':>6} {'p2p':>5}"
            f" {'ET linked':>12} {'mean iteration':>15}"
        )
        for r in info["ranks"]:
            et = "-" if r["et_ops"] is None else f"{r['et_ops_linked']}/{r['et_ops']}"
            lines.append(
                f"{r['rank']:>5} {r['backend'] or '-':<8} {r['events']:>8} {r['kernels']:>8}"
                f" {r['collectives']:>6} {r['p2p']:>5} {et:>12} {_ms(r['mean_iteration_ns']):>15}"
            )
    layout = info.get("layout") or {}
    if layout.get("spec"):
        lines += ["", f"layout {layout['spec']} (order {layout['order']}, {layout['source']})"]
    lines += ["", *_groups(info["comm_groups"])]
    if info["unmatched_collectives"]:
        lines.append(
            f"\nwarning: {info['unmatched_collectives']} collective instances do not match"
            " across ranks (see view collective_instance WHERE NOT matched)"
        )
    return "\n".join(lines)
