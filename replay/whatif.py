"""What-ifs and run-to-run variance: the ways an emulation departs from the recorded timing.

Why a module of its own: the emulator simulates one *unit* per equivalence class, which is exact
only while every member of a class has the same timing (docs/emulator.md). A what-if that touches
some ranks (a slow rank, a failed GPU) or the variance mode (every replica draws its own
durations) breaks that symmetry. Those ranks' data-parallel *replicas* are then expanded into
units of their own before the emulation (``expand_replicas``), while the untouched replicas stay
represented by one replica. The duration changes themselves (``slow_factors``,
``resample_durations``) are frames in, arrays out: no store, no randomness without a seed.

What-ifs (``WhatIfConfig``; ``prism emulate --what-if ...``, see ``parse_what_if``):

- ``slow``: multiply the durations of chosen ranks and/or op names (glob) and/or node kinds by a
  factor. On a communication node the factor multiplies its transfer time instead (its recorded
  duration includes waiting, which the emulator recomputes).
- ``remove_gpu``: one GPU fails; its data-parallel replica runs at tensor-parallel degree
  ``tp - 1``. Every rank of that replica computes ``tp / (tp - 1)`` longer (its share of the
  work grew), its TP collectives run on ``tp - 1`` members (modelled transfer), and the GPUs of
  the failed GPU's TP slot (one per stage) leave the results. They stay in the graph as stand-ins
  that carry the re-sharded replica's timing to their pipeline and data-parallel peers.
- ``dp``: emulate at another data-parallel degree (the run is re-sliced first).
- ``bandwidth_scale``: multiply the network bandwidth (``replay.topology``).
- ``variance``: each replica draws its durations from the recorded distribution of its
  representative (seeded): by default whole iterations are drawn (``iteration`` mode: a drawn
  step keeps the correlation between the ops of one recorded step); ``op`` mode draws every op
  independently. The slowest-of-N effect at data-parallel collectives then grows with N.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import polars as pl

from prism_trace.errors import PrismError
from prism_trace.parallel import AXES, ParallelAxis, ParallelLayout

__all__ = [
    "Expansion",
    "SlowDown",
    "WhatIfConfig",
    "WhatIfError",
    "expand_replicas",
    "parse_what_if",
    "resample_durations",
    "slow_factors",
    "spans_dp",
]

_COMM = ("collective", "send", "recv")


class WhatIfError(PrismError, ValueError):
    """A what-if that cannot apply to the run (bad syntax, a rank outside the world, TP 1)."""


@dataclass(frozen=True, kw_only=True)
class SlowDown:
    """Multiply the durations of the matching nodes by ``factor``.

    A node matches when every given criterion holds; an empty criterion matches everything.

    Attributes:
        factor: > 0; 1.2 = 20 % slower.
        ranks: global ranks.
        ops: glob over the node name (``*attention*``, ``forward-*``), case sensitive.
        kinds: graph node kinds (``host``, ``kernel``, ``memcpy``, ``collective``, ...).
    """

    factor: float
    ranks: tuple[int, ...] = ()
    ops: str | None = None
    kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.factor > 0:
            msg = f"slow-down factor must be > 0, got {self.factor}"
            raise WhatIfError(msg)
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "kinds", tuple(str(k) for k in self.kinds))


@dataclass(frozen=True, kw_only=True)
class WhatIfConfig:
    """The ``what_if`` section of ``EmulationConfig``.

    Attributes:
        slow: slow-downs, applied in order (factors multiply).
        remove_gpu: global rank of a failed GPU (its replica runs at ``tp - 1``).
        dp: data-parallel degree to emulate (None: the run's own).
        bandwidth_scale: factor on the network bandwidth (None: unchanged).
        variance: each replica draws its durations from its representative's recorded ones.
        variance_mode: ``iteration`` (draw whole recorded iterations) or ``op`` (each op alone).
    """

    slow: tuple[SlowDown, ...] = ()
    remove_gpu: int | None = None
    dp: int | None = None
    bandwidth_scale: float | None = None
    variance: bool = False
    variance_mode: Literal["iteration", "op"] = "iteration"

    def __post_init__(self) -> None:
        slow = tuple(s if isinstance(s, SlowDown) else SlowDown(**s) for s in self.slow)
        object.__setattr__(self, "slow", slow)
        if self.variance_mode not in ("iteration", "op"):
            msg = f"variance_mode must be 'iteration' or 'op', got {self.variance_mode!r}"
            raise WhatIfError(msg)
        if self.dp is not None and self.dp < 1:
            msg = f"dp must be >= 1, got {self.dp}"
            raise WhatIfError(msg)
        if self.bandwidth_scale is not None and not self.bandwidth_scale > 0:
            msg = f"bandwidth scale must be > 0, got {self.bandwidth_scale}"
            raise WhatIfError(msg)

    @property
    def active(self) -> bool:
        """Whether anything departs from the recording."""
        return bool(
            self.slow
            or self.remove_gpu is not None
            or self.dp is not None
            or self.bandwidth_scale is not None
            or self.variance
        )

    def rank_targets(self) -> set[int]:
        """Ranks whose timing differs from their class (they need units of their own)."""
        out = {r for s in self.slow for r in s.ranks}
        if self.remove_gpu is not None:
            out.add(self.remove_gpu)
        return out


def _ranks(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ".." in part:
            lo, hi = part.split("..", 1)
            out += range(int(lo), int(hi) + 1)
        else:
            out.append(int(part))
    return tuple(out)


_SYNTAX = (
    "what-ifs: slow-ranks=3,5..7@1.2 | slow-ops=GLOB@1.5 | slow-kind=kernel@1.1 |"
    " remove-gpu=RANK | dp=N | bandwidth=FACTOR | variance[=iteration|op]"
)


def parse_what_if(texts: list[str] | tuple[str, ...]) -> WhatIfConfig:
    """Parse ``--what-if`` words into a config.

    Words: ``slow-ranks=3,5..7@1.2``, ``slow-ops=forward-*@1.5``, ``slow-kind=kernel@1.1``,
    ``remove-gpu=17``, ``dp=64``, ``bandwidth=0.5``, ``variance`` (``variance=op``).

    Raises:
        WhatIfError: a word that is not one of these, or a bad value; the message lists the
            syntax.
    """
    slow: list[SlowDown] = []
    kw: dict[str, Any] = {}
    for raw in texts:
        word = raw.strip()
        key, _, value = word.partition("=")
        try:
            if key in ("slow-ranks", "slow-ops", "slow-kind"):
                target, at, factor = value.rpartition("@")
                if not at or not target:
                    raise ValueError
                f = float(factor)
                if key == "slow-ranks":
                    slow.append(SlowDown(factor=f, ranks=_ranks(target)))
                elif key == "slow-ops":
                    slow.append(SlowDown(factor=f, ops=target))
                else:
                    slow.append(SlowDown(factor=f, kinds=tuple(target.split(","))))
            elif key == "remove-gpu":
                kw["remove_gpu"] = int(value)
            elif key == "dp":
                kw["dp"] = int(value)
            elif key == "bandwidth":
                kw["bandwidth_scale"] = float(value)
            elif key == "variance":
                kw["variance"] = True
                if value:
                    kw["variance_mode"] = value
            else:
                raise ValueError
        except ValueError as exc:
            if isinstance(exc, WhatIfError):
                raise
            msg = f"cannot read what-if {raw!r}; {_SYNTAX}"
            raise WhatIfError(msg) from None
    return WhatIfConfig(slow=tuple(slow), **kw)


# -- duration changes ----------------------------------------------------------------------------


def slow_factors(
    nodes: pl.DataFrame, slow: tuple[SlowDown, ...], *, extra: np.ndarray | None = None
) -> np.ndarray:
    """Per node, the product of the factors of the slow-downs that match it.

    Args:
        nodes: ``rank, name, kind`` per node (``rank`` = the unit's own rank).
        slow: the slow-downs.
        extra: a per-node factor to multiply in (e.g. the failed-GPU replica's).

    Returns:
        float64 per node (1.0 where nothing matches).
    """
    factor = np.ones(nodes.height) if extra is None else np.asarray(extra, dtype=np.float64).copy()
    for s in slow:
        cond = pl.lit(value=True)
        if not s.ops and not s.kinds:  # a slow rank computes slower; its network is unchanged
            cond = cond & ~pl.col("kind").is_in(_COMM)
        if s.ranks:
            cond = cond & pl.col("rank").is_in(list(s.ranks))
        if s.ops is not None:
            cond = cond & pl.col("name").fill_null("").str.contains(
                fnmatch.translate(s.ops).replace(r"\Z", r"\z")
            )
        if s.kinds:
            cond = cond & pl.col("kind").is_in(list(s.kinds))
        mask = nodes.select(cond.alias("m"))["m"].to_numpy()
        factor[mask] *= s.factor
    return factor


def _op_keys(nodes: pl.DataFrame) -> pl.DataFrame:
    """Each node's place in its recorded iteration: ``(source_rank, iteration, track, name, ord)``.

    ``ord`` numbers the nodes of one name on one track within one iteration by recorded start,
    so the k-th ``forward`` of step 5 corresponds to the k-th ``forward`` of step 9.
    """
    return nodes.select(
        "source_rank", "node_id", "iteration", "track_id", "name", "ts"
    ).with_columns(
        pl.col("ts")
        .rank("ordinal")
        .over("source_rank", "iteration", "track_id", "name")
        .cast(pl.Int64)
        .alias("ord")
    )


def resample_durations(
    nodes: pl.DataFrame,
    draw: np.ndarray,
    *,
    seed: int,
    mode: Literal["iteration", "op"] = "iteration",
) -> np.ndarray:
    """Durations drawn from each node's recorded distribution across iterations (seeded).

    A node's distribution is the durations of the *same op* (``_op_keys``) in every recorded
    iteration of its representative (``source_rank``). ``iteration`` mode draws, per unit and
    iteration, one recorded iteration and takes all its ops' durations from it; ``op`` mode
    draws per node. Communication nodes keep theirs (their duration is waiting, which the
    emulator recomputes), and so do nodes without an iteration or without a counterpart in the
    drawn iteration.

    Args:
        nodes: ``unit, source_rank, node_id, kind, iteration, track_id, name, ts, dur``.
        draw: per unit, whether it draws (False: keeps the recorded durations).
        seed: the seed; the same seed gives the same durations.
        mode: see above.

    Returns:
        int64 durations per node.
    """
    dur = nodes["dur"].fill_null(0).to_numpy().astype(np.int64)
    unit = nodes["unit"].to_numpy()
    draw = np.asarray(draw, dtype=bool)
    if not draw.any():
        return dur
    recorded = nodes.unique(subset=["source_rank", "node_id"], keep="first")
    keys = _op_keys(recorded)
    table = keys.join(
        recorded.select("source_rank", "node_id", pl.col("dur").alias("drawn")),
        on=["source_rank", "node_id"],
    ).drop("node_id", "ts")
    # Recorded iterations of each representative, to draw from.
    its = (
        table.filter(pl.col("iteration").is_not_null())
        .select("source_rank", "iteration")
        .unique()
        .sort("source_rank", "iteration")
    )
    per_src = its.group_by("source_rank", maintain_order=True).agg(pl.col("iteration"))
    pool = {
        int(s): np.asarray(v, dtype=np.int64)
        for s, v in zip(
            per_src["source_rank"].to_list(), per_src["iteration"].to_list(), strict=True
        )
    }
    rng = np.random.default_rng(seed)
    node_keys = nodes.select("source_rank", "node_id").join(
        keys.select("source_rank", "node_id", "iteration", "track_id", "name", "ord"),
        on=["source_rank", "node_id"],
        how="left",
        maintain_order="left",
    )
    src = node_keys["source_rank"].to_numpy().astype(np.int64)
    it = node_keys["iteration"].fill_null(-(2**31)).to_numpy().astype(np.int64)
    if mode == "iteration":
        # One draw per (unit, iteration): index the pairs, draw a uniform per pair.
        pair = unit.astype(np.int64) * (1 << 32) + (it - it.min())
        uniq, inv = np.unique(pair, return_inverse=True)
        u = rng.random(uniq.size)[inv]
    else:
        u = rng.random(nodes.height)
    chosen = np.full(nodes.height, -(2**31), dtype=np.int64)
    for s, iters in pool.items():
        m = src == s
        chosen[m] = iters[np.minimum((u[m] * iters.size).astype(np.int64), iters.size - 1)]
    drawn = (
        node_keys.select("source_rank", "track_id", "name", "ord")
        .with_columns(pl.Series("iteration", chosen))
        .join(
            table.cast({"iteration": pl.Int64}),
            on=["source_rank", "iteration", "track_id", "name", "ord"],
            how="left",
            maintain_order="left",
        )["drawn"]
        .to_numpy()
    )
    ok = (
        draw[unit]
        & (it != -(2**31))
        & ~np.isnan(drawn.astype(np.float64))
        & ~nodes["kind"].is_in(_COMM).to_numpy()
    )
    out = dur.copy()
    out[ok] = drawn[ok].astype(np.int64)
    return out


# -- expanding replicas --------------------------------------------------------------------------


def spans_dp(axis: str | None) -> bool:
    """Whether a group of this axis spans data-parallel replicas (and so is shared by them)."""
    if axis is None:
        return True  # unknown: keep it shared, the conservative choice
    return axis == "world" or "dp" in axis.split("-")


def _spans_dp_expr(col: str = "axis") -> pl.Expr:
    """``spans_dp`` as a polars expression."""
    c = pl.col(col)
    return c.is_null() | (c == "world") | c.str.split("-").list.contains("dp")


@dataclass
class Expansion:
    """The graph of a sliced run with some data-parallel replicas expanded into units.

    Attributes:
        nodes: the input node columns, one copy per expanded rank (``rank`` = that rank,
            ``group_id``/``peer`` remapped to its replica); no ``unit``/``idx`` yet.
        edges: ``rank, src, dst, kind, anchor, delay`` per expanded rank.
        rank_unit_rank: for every rank of the world, the rank whose unit it follows (itself when
            expanded, else its counterpart in the representative replica).
        replicas: the replicas that got units of their own (the representative one included).
        representative_replica: the replica that stands for all unexpanded ones (None when every
            replica is expanded).
    """

    nodes: pl.DataFrame
    edges: pl.DataFrame
    rank_unit_rank: np.ndarray
    replicas: list[int]
    representative_replica: int | None
    notes: list[str] = field(default_factory=list)


def expand_replicas(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    *,
    ranks: pl.DataFrame,
    groups: pl.DataFrame,
    layout: ParallelLayout,
    replicas: set[int],
) -> Expansion:
    """Give every rank of the chosen replicas its own copy of its class's graph.

    A sliced run stores one graph per class under its exemplar (dp coordinate 0). A copy for rank
    ``m`` keeps the node ids, takes ``m`` as rank, and points at ``m``'s own communicators: a group
    that spans dp (``dp``, ``dp-cp``, ``world``) is shared by the replicas and kept; any other
    (``tp``, ``pp``, ``embd``, ...) is replaced by the group of the same axis that holds ``m``. A
    p2p peer moves by the same coordinate offset as in slicing. The smallest unexpanded replica
    is expanded too and stands for every other unexpanded one, so no two units ever share a
    communicator copy.

    Args:
        nodes: the sliced run's graph nodes (exemplar ranks), with ``source_rank``.
        edges: its edges (``rank, src, dst, kind, anchor, delay``).
        ranks: ``rank, class_id`` for every rank of the world.
        groups: ``group_id, axis, ranks`` of the sliced run.
        layout: the sliced run's layout.
        replicas: dp coordinates whose ranks must get units of their own.

    Returns:
        The expanded graph.

    Raises:
        WhatIfError: a replica outside the layout, or communicators that do not partition the
            world along an axis.
    """
    n_dp = layout.size(ParallelAxis.DP)
    bad = [d for d in replicas if not 0 <= d < n_dp]
    if bad:
        msg = f"replica {bad[0]} is outside dp = {n_dp} of {layout}"
        raise WhatIfError(msg)
    rest = sorted(set(range(n_dp)) - replicas)
    rep_replica = rest[0] if rest else None
    chosen = sorted(replicas | ({rep_replica} if rep_replica is not None else set()))

    world = np.arange(layout.world_size, dtype=np.int64)
    coords = layout.coords(world)
    dp = coords[ParallelAxis.DP]
    follow = world.copy()
    if rep_replica is not None:
        other = ~np.isin(dp, chosen)
        c = {a: coords[a][other] for a in AXES}
        c[ParallelAxis.DP] = np.full(int(other.sum()), rep_replica, dtype=np.int64)
        follow[other] = layout.rank_of(c)

    cls = ranks.select(pl.col("rank").cast(pl.Int64), pl.col("class_id").cast(pl.Int64))
    targets = cls.filter(pl.col("rank").is_in(world[np.isin(dp, chosen)].tolist())).rename(
        {"rank": "new_rank"}
    )
    copies = nodes.with_columns(pl.col("rank").cast(pl.Int64)).join(
        targets, left_on="rank", right_on="class_id", how="inner"
    )
    g_axis = groups.select(pl.col("group_id").cast(pl.Int64), "axis")
    members = (
        groups.filter(~_spans_dp_expr())
        .select(pl.col("group_id").cast(pl.Int64).alias("new_group"), "axis", "ranks")
        .explode("ranks")
        .select("new_group", "axis", pl.col("ranks").cast(pl.Int64).alias("new_rank"))
    )
    dup = members.group_by("axis", "new_rank").len().filter(pl.col("len") > 1)
    if not dup.is_empty():
        r = dup.row(0, named=True)
        msg = (
            f"rank {r['new_rank']} is in {r['len']} `{r['axis']}` groups; a replica can only be"
            " expanded when each axis's groups partition the world"
        )
        raise WhatIfError(msg)
    copies = (
        copies.join(g_axis, on="group_id", how="left", maintain_order="left")
        .join(members, on=["axis", "new_rank"], how="left", maintain_order="left")
        .with_columns(
            pl.when(_spans_dp_expr())
            .then(pl.col("group_id"))
            .otherwise(pl.coalesce(pl.col("new_group").cast(pl.Int64), pl.col("group_id")))
            .alias("group_id")
        )
        .drop("axis", "new_group")
    )
    # p2p peers: the exemplar's peer shifted by (new rank - exemplar) coordinate-wise.
    has_peer = copies["peer"].is_not_null().to_numpy()
    if has_peer.any():
        ex = copies["rank"].to_numpy().astype(np.int64)
        peer = np.where(has_peer, copies["peer"].fill_null(0).to_numpy(), ex).astype(np.int64)
        new = copies["new_rank"].to_numpy().astype(np.int64)
        cp, ce, cn = layout.coords(peer), layout.coords(ex), layout.coords(new)
        moved = layout.rank_of({a: (cn[a] + cp[a] - ce[a]) % layout.size(a) for a in AXES})
        copies = copies.with_columns(
            pl.Series("peer", moved, dtype=pl.Int64)
            .cast(copies.schema["peer"])
            .scatter(np.flatnonzero(~has_peer), None)
        )
    copies = (
        copies.with_columns(pl.col("new_rank").cast(nodes.schema["rank"]).alias("rank"))
        .drop("new_rank", "class_id", strict=False)
        .sort("rank", "node_id")
    )
    e = edges.with_columns(pl.col("rank").cast(pl.Int64)).join(
        targets, left_on="rank", right_on="class_id", how="inner"
    )
    e = e.with_columns(pl.col("new_rank").cast(edges.schema["rank"]).alias("rank")).drop("new_rank")
    notes = [
        f"{len(replicas)} of {n_dp} data-parallel replicas expanded into units of their own"
        + (
            f"; replica {rep_replica} stands for the other {n_dp - len(chosen)}"
            if rep_replica is not None and n_dp > len(chosen)
            else ""
        )
    ]
    return Expansion(
        nodes=copies.select(nodes.columns),
        edges=e.select(edges.columns),
        rank_unit_rank=follow,
        replicas=chosen,
        representative_replica=rep_replica,
        notes=notes,
    )
