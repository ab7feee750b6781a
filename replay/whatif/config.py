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
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import polars as pl

from prism_trace.errors import PrismError
from prism_trace.graph.base import NODE_KINDS
from prism_trace.layout.mesh import AXES, ParallelAxis, ParallelLayout
from prism_trace.limits import MAX_RANKS

__all__ = [
    "MAX_SLOW_FACTOR",
    "Expansion",
    "SlowDown",
    "WhatIfConfig",
    "WhatIfError",
    "check_slow_matches",
    "expand_replicas",
    "parse_what_if",
    "resample_durations",
    "slow_factors",
    "spans_dp",
]

_COMM = ("collective", "send", "recv")


class WhatIfError(PrismError, ValueError):
    """A what-if that cannot apply to the run (bad syntax, a rank outside the world, TP 1)."""


MAX_SLOW_FACTOR = 1e6
"""The largest slow-down factor, and the largest product of the factors that can meet on a node.

Emulated times are int64 nanoseconds (at most 9.2e18 ns, 292 years). A factor of 1e6 makes a
recorded hour 3.6e18 ns, still inside; a larger one overflows on realistic runs (the durations
wrapped to -2**63 and ts went negative) and models nothing a what-if asks about: a rank a
million times slower is a dead one (``remove-gpu``, ``dp=N-1``). The same bound, inverted,
bounds the bandwidth what-if from below (a transfer takes ``1 / scale`` longer).
"""


def _check_factor(factor: float, what: str) -> float:
    """``factor`` when it is finite and in ``(0, MAX_SLOW_FACTOR]``; else a one-line error."""
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        msg = f"{what} must be a number, got {factor!r}"
        raise WhatIfError(msg)
    if not (math.isfinite(factor) and 0 < factor <= MAX_SLOW_FACTOR):
        msg = f"{what} must be > 0 and <= {MAX_SLOW_FACTOR:g} (finite), got {factor}"
        raise WhatIfError(msg)
    return float(factor)


def _check_glob(glob: str) -> None:
    """Refuse a glob whose ``[`` opens no character class (fnmatch would take it literally, so
    ``slow-ops=[@2`` silently matched nothing); ``[[]`` still matches a literal ``[``."""
    i = 0
    while (i := glob.find("[", i)) >= 0:
        j = i + 1
        if j < len(glob) and glob[j] in "!^":
            j += 1
        if j < len(glob) and glob[j] == "]":
            j += 1  # a ']' first in a class is a member
        close = glob.find("]", j)
        if close < 0:
            msg = f"slow-ops glob {glob!r} is malformed: '[' at {i} opens no class (no ']')"
            raise WhatIfError(msg)
        i = close + 1


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
        object.__setattr__(self, "factor", _check_factor(self.factor, "slow-down factor"))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "kinds", tuple(str(k) for k in self.kinds))
        bad = [r for r in self.ranks if not 0 <= r < MAX_RANKS]
        if bad:
            msg = f"slow-down rank {bad[0]} is outside [0, {MAX_RANKS}) (the rank limit)"
            raise WhatIfError(msg)
        unknown = [k for k in self.kinds if k not in NODE_KINDS]
        if unknown:
            msg = (
                f"slow-down kind {unknown[0]!r} is not a node kind; kinds: {', '.join(NODE_KINDS)}"
            )
            raise WhatIfError(msg)
        if self.ops is not None:
            _check_glob(self.ops)


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
        no_stragglers: every op takes its type's typical time (``replay.typical``); own delays
            before computations stay, communication is posted as soon as its dependencies
            allow (the counterpart of StragglerAnalysis's ``step_t_noblk``).
        no_launch_delay: every op's own delay is 0 (``step_t_nodelay``).
    """

    slow: tuple[SlowDown, ...] = ()
    remove_gpu: int | None = None
    dp: int | None = None
    bandwidth_scale: float | None = None
    variance: bool = False
    variance_mode: Literal["iteration", "op"] = "iteration"
    no_stragglers: bool = False
    no_launch_delay: bool = False

    def __post_init__(self) -> None:
        slow = tuple(s if isinstance(s, SlowDown) else SlowDown(**s) for s in self.slow)
        object.__setattr__(self, "slow", slow)
        if self.variance_mode not in ("iteration", "op"):
            msg = f"variance_mode must be 'iteration' or 'op', got {self.variance_mode!r}"
            raise WhatIfError(msg)
        if self.dp is not None and not 1 <= self.dp <= MAX_RANKS:
            msg = f"dp must be >= 1 and <= {MAX_RANKS} (the world-size limit), got {self.dp}"
            raise WhatIfError(msg)
        if self.remove_gpu is not None and not 0 <= self.remove_gpu < MAX_RANKS:
            msg = f"remove-gpu rank {self.remove_gpu} is outside [0, {MAX_RANKS}) (the rank limit)"
            raise WhatIfError(msg)
        if self.bandwidth_scale is not None:
            b = self.bandwidth_scale
            if not (isinstance(b, int | float) and math.isfinite(b) and b > 0):
                msg = f"bandwidth scale must be a finite number > 0, got {b}"
                raise WhatIfError(msg)
            if not 1 / MAX_SLOW_FACTOR <= b <= MAX_SLOW_FACTOR:
                msg = (
                    f"bandwidth scale must be in [{1 / MAX_SLOW_FACTOR:g}, {MAX_SLOW_FACTOR:g}]"
                    f" (a transfer 1/scale as long must fit int64 ns), got {b}"
                )
                raise WhatIfError(msg)
        product = math.prod(s.factor for s in slow)
        if product > MAX_SLOW_FACTOR:
            msg = (
                f"the slow-down factors multiply to {product:g} (a node that all of them match"
                f" takes that much longer); at most {MAX_SLOW_FACTOR:g} (int64 ns)"
            )
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
            or self.no_stragglers
            or self.no_launch_delay
        )

    def rank_targets(self) -> set[int]:
        """Ranks whose timing differs from their class (they need units of their own)."""
        out = {r for s in self.slow for r in s.ranks}
        if self.remove_gpu is not None:
            out.add(self.remove_gpu)
        return out


def _ranks(text: str) -> tuple[int, ...]:
    """``3,5..7`` as ranks; a rank outside ``[0, MAX_RANKS)`` is refused before a range is
    expanded (``0..99999999999`` must not build a list of 1e11 ranks)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dots, hi = part.partition("..")
        ends = (int(lo), int(hi)) if dots else (int(part),)
        bad = [r for r in ends if not 0 <= r < MAX_RANKS]
        if bad:
            msg = f"slow-ranks rank {bad[0]} is outside [0, {MAX_RANKS}) (the rank limit)"
            raise WhatIfError(msg)
        if ends[-1] < ends[0]:
            msg = f"slow-ranks range {part!r} is empty (its end is below its start)"
            raise WhatIfError(msg)
        out += range(ends[0], ends[-1] + 1)
    if not out:
        msg = f"slow-ranks {text!r} names no rank"
        raise WhatIfError(msg)
    return tuple(out)


_SYNTAX = (
    "what-ifs: slow-ranks=3,5..7@1.2 | slow-ops=GLOB@1.5 | slow-kind=kernel@1.1 |"
    " remove-gpu=RANK | dp=N | bandwidth=FACTOR | variance[=iteration|op] | no-stragglers |"
    " no-launch-delay"
)


def _once(kw: dict[str, Any], before: dict[str, Any], raw: str) -> None:
    """Refuse a what-if given twice with different values (``dp=2`` then ``dp=8``): one would
    silently win. The slow-downs are exempt: several of them apply in turn (factors multiply)."""
    for key, value in kw.items():
        if key in before and before[key] != value:
            msg = (
                f"what-if {raw.strip()!r} contradicts an earlier one ({key} = {before[key]!r});"
                " give each what-if once"
            )
            raise WhatIfError(msg)


def parse_what_if(texts: list[str] | tuple[str, ...]) -> WhatIfConfig:
    """Parse ``--what-if`` words into a config.

    Words: ``slow-ranks=3,5..7@1.2``, ``slow-ops=forward-*@1.5``, ``slow-kind=kernel@1.1``,
    ``remove-gpu=17``, ``dp=64``, ``bandwidth=0.5``, ``variance`` (``variance=op``),
    ``no-stragglers``, ``no-launch-delay``.

    Raises:
        WhatIfError: a word that is not one of these, or a bad value; the message lists the
            syntax. The same word twice with different values (not ``slow-*``, which stack).
    """
    slow: list[SlowDown] = []
    kw: dict[str, Any] = {}
    for raw in texts:
        word = raw.strip()
        key, _, value = word.partition("=")
        before = dict(kw)
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
            elif key in ("no-stragglers", "no-launch-delay") and not value:
                kw[key.replace("-", "_")] = True
            elif key == "variance":
                kw["variance"] = True
                kw["variance_mode"] = value or "iteration"
            else:
                raise ValueError
        except ValueError as exc:
            if isinstance(exc, WhatIfError):
                raise
            msg = f"cannot read what-if {raw!r}; {_SYNTAX}"
            raise WhatIfError(msg) from None
        _once(kw, before, raw)
    return WhatIfConfig(slow=tuple(slow), **kw)


# -- duration changes ----------------------------------------------------------------------------


def _slow_mask(nodes: pl.DataFrame, s: SlowDown) -> np.ndarray:
    """The nodes ``s`` matches (``rank, name, kind`` per node), as a bool array."""
    cond = pl.lit(value=True)
    if not s.ops and not s.kinds:  # a slow rank computes slower; its network is unchanged
        cond = cond & ~pl.col("kind").is_in(_COMM)
    if s.ranks:
        cond = cond & pl.col("rank").is_in(list(s.ranks))
    if s.ops is not None:
        # Matched per distinct name in Python: fnmatch.translate's regex (atomic groups since
        # Python 3.12) is not one polars' regex engine reads.
        names = nodes["name"].fill_null("").unique().to_list()
        hit = [n for n in names if fnmatch.fnmatchcase(n, s.ops)]
        cond = cond & pl.col("name").fill_null("").is_in(hit)
    if s.kinds:
        cond = cond & pl.col("kind").is_in(list(s.kinds))
    return nodes.select(cond.alias("m"))["m"].to_numpy()


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
        factor[_slow_mask(nodes, s)] *= s.factor
    return factor


def check_slow_matches(nodes: pl.DataFrame, slow: tuple[SlowDown, ...], run: str) -> None:
    """Refuse a slow-down by op name or node kind that matches no node of ``run``.

    Such a what-if changes nothing, and the emulation would quietly report the baseline as
    its result (a typo in a glob, a kind the run has none of). Rank-only slow-downs are not
    checked: their ranks are checked against the world instead.

    Raises:
        WhatIfError: the first slow-down that matches nothing, as one line.
    """
    for s in slow:
        if (s.ops is not None or s.kinds) and not _slow_mask(nodes, s).any():
            what = f"glob {s.ops!r}" if s.ops is not None else f"kind {','.join(s.kinds)}"
            where = f" on ranks {_rank_text(s.ranks)}" if s.ranks else ""
            msg = f"slow-down {what}{where} matches no node of run {run!r}; nothing would change"
            raise WhatIfError(msg)


def _rank_text(ranks: tuple[int, ...]) -> str:
    """A short list of ranks for a message."""
    text = ",".join(str(r) for r in ranks[:8])
    return text + ",..." if len(ranks) > 8 else text


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


def _first_rows(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first row of each distinct ``(a, b)`` pair, and each row's pair.

    Returns ``(first, pair)``: ``first[k]`` is the row where the ``k``-th pair (numbered by
    first appearance) occurs first, ascending; ``pair[i]`` is the number of row ``i``'s pair.
    Without sorting the rows when the pairs fit a dense table (a class graph copied to many
    units: few distinct pairs).
    """
    n = a.size
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    a = a - int(a.min())
    b = b - int(b.min())
    b_span = int(b.max()) + 1
    cells = (int(a.max()) + 1) * b_span
    if cells <= max(4 * n, 1 << 20):
        key = a * b_span + b
        first = np.full(cells, n, dtype=np.int64)
        np.minimum.at(first, key, np.arange(n, dtype=np.int64))
        rows = np.sort(first[first < n])
        number = np.empty(cells, dtype=np.int64)
        number[key[rows]] = np.arange(rows.size, dtype=np.int64)
        return rows, number[key]
    _, idx, inv = np.unique(
        np.stack([a, b], axis=1), axis=0, return_index=True, return_inverse=True
    )
    order = np.argsort(idx, kind="stable")
    number = np.empty(order.size, dtype=np.int64)
    number[order] = np.arange(order.size, dtype=np.int64)
    return idx[order].astype(np.int64), number[inv.ravel()]


def _dense_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """Each row's pair ``(a, b)`` numbered in sorted pair order, and the number of pairs.

    The numbering of ``np.unique(pairs, return_inverse=True)`` for non-negative ``a`` and
    ``b``; without sorting the rows when the pairs fit a dense table.
    """
    if a.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    b_span = int(b.max()) + 1
    cells = (int(a.max()) + 1) * b_span
    key = a * b_span + b
    if cells <= max(4 * a.size, 1 << 20):
        seen = np.zeros(cells, dtype=bool)
        seen[key] = True
        number = np.cumsum(seen) - 1
        return number[key], int(number[-1]) + 1
    uniq, inv = np.unique(key, return_inverse=True)
    return inv.ravel(), int(uniq.size)


@dataclass(frozen=True)
class DrawTable:
    """Each node's recorded distribution, worked out once per recorded node (see
    ``resample_durations``): ``pool[r_off + i]`` for ``i < r_len`` are the iterations a node can
    draw from, ``recorded[cell]`` (where ``present[cell]``) the op's duration in the iteration
    of ``cell = pool[...] + r_cell``; ``r_draws`` whether the node can draw at all; ``r_code`` its
    recorded iteration's code (0: none). ``r_*`` are per recorded node, ``node_rec`` maps each
    node to its recorded node."""

    node_rec: np.ndarray
    r_len: np.ndarray
    r_off: np.ndarray
    r_cell: np.ndarray
    r_draws: np.ndarray
    r_code: np.ndarray
    pool: np.ndarray
    present: np.ndarray
    recorded: np.ndarray
    r_source: np.ndarray


def draw_table(nodes: pl.DataFrame) -> DrawTable:
    """The recorded distribution of every node of ``nodes`` (``source_rank, node_id, iteration,
    track_id, name, ts, dur``): the same op (``_op_keys``) in every recorded iteration of its
    representative."""
    src_all = nodes["source_rank"].to_numpy().astype(np.int64)
    # The recorded nodes (first row of each (source_rank, node_id)) and each node's one.
    rows, node_rec = _first_rows(src_all, nodes["node_id"].to_numpy().astype(np.int64))
    keys = _op_keys(nodes[rows])
    none = -(2**31)
    r_src = keys["source_rank"].to_numpy().astype(np.int64)
    r_it = keys["iteration"].fill_null(none).to_numpy().astype(np.int64)
    r_dur = nodes["dur"][rows]
    # The op of each recorded node, (source_rank, track_id, name, ord) numbered; -1 with a gap.
    gap = (
        keys.select(pl.any_horizontal(pl.col("track_id", "name", "ord").is_null()))
        .to_series()
        .to_numpy()
    )
    op_cols = keys.select(
        "source_rank", "track_id", pl.col("name").rank("dense").alias("name"), "ord"
    ).fill_null(-1)
    _, op = np.unique(op_cols.to_numpy().astype(np.int64), axis=0, return_inverse=True)
    op = np.where(gap, -1, op.ravel())
    n_ops = int(op.max()) + 1 if op.size else 0
    # The recorded iterations (codes into `its`); each representative's, to draw from.
    its = np.unique(r_it[r_it != none])
    n_its = max(its.size, 1)
    sources = np.unique(r_src)
    pools = [np.searchsorted(its, np.unique(r_it[(r_src == s) & (r_it != none)])) for s in sources]
    pool_len = np.array([p.size for p in pools], dtype=np.int64)
    pool_off = np.cumsum(pool_len) - pool_len
    pool = np.concatenate([*pools, np.zeros(1, dtype=np.int64)]).astype(np.int64)
    # The recorded duration of every (op, iteration) present.
    has = (op >= 0) & (r_it != none) & r_dur.is_not_null().to_numpy()
    cell_of = op[has] * n_its + np.searchsorted(its, r_it[has])
    present = np.zeros(max(n_ops, 1) * n_its, dtype=bool)
    present[cell_of] = True
    recorded = np.zeros(present.size, dtype=np.int64)
    recorded[cell_of] = r_dur.fill_null(0).to_numpy().astype(np.int64)[has]

    # Per recorded node: its representative's pool of iterations, its op's first table cell.
    r_pool = np.searchsorted(sources, r_src)
    r_len, r_off = pool_len[r_pool], pool_off[r_pool]
    r_cell = np.maximum(op, 0) * n_its
    r_draws = (op >= 0) & (r_it != none) & (r_len > 0)

    r_code = np.searchsorted(its, r_it) + (r_it != none)
    return DrawTable(
        node_rec, r_len, r_off, r_cell, r_draws, r_code, pool, present, recorded, r_pool
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
    iteration, one recorded iteration ``X`` and takes all its ops' durations from it; ``op``
    mode draws per node. Either way a node of recorded step ``t`` takes its op's duration in
    ``X`` times ``C[t] / C[X]``, ``C`` being its representative's total computation in a step:
    the step's common mode stays, only an op's own deviation is drawn (as the replica vector's
    columns do, ``replay.vector.replica_durations``). Communication nodes keep theirs (their
    duration is waiting, which the emulator recomputes), and so do nodes without an iteration
    or without a counterpart in the drawn iteration.

    The nodes of one ``(source_rank, node_id)`` (a class's graph copied to many units) share
    their op and their distribution: those are worked out once per recorded node, and only the
    draws and the lookups run per node (numpy, no joins or sorts of the expanded graph).

    Args:
        nodes: ``unit, source_rank, node_id, kind, iteration, track_id, name, ts, dur``.
        draw: per unit, whether it draws (False: keeps the recorded durations).
        seed: the seed; the same seed gives the same durations.
        mode: see above.

    Returns:
        int64 durations per node.
    """
    dur = nodes["dur"].fill_null(0).to_numpy().astype(np.int64)
    unit = nodes["unit"].to_numpy().astype(np.int64, copy=False)
    draw = np.asarray(draw, dtype=bool)
    if not draw.any():
        return dur
    t = draw_table(nodes)
    node_rec, r_len, r_off, r_cell, r_draws = t.node_rec, t.r_len, t.r_off, t.r_cell, t.r_draws
    pool, present, recorded = t.pool, t.present, t.recorded

    rng = np.random.default_rng(seed)
    if mode == "iteration":
        # One draw per (unit, iteration), numbered in (unit, iteration) order: a uniform each.
        pair, n_pairs = _dense_pairs(unit, t.r_code[node_rec])
        u = rng.random(n_pairs)[pair]
        del pair
    else:
        u = rng.random(nodes.height)
    # The drawn iteration: pool[offset + min(floor(u * len), len - 1)] (in place: 8 M nodes).
    size = r_len[node_rec]
    u *= size
    pick = u.astype(np.int64)
    del u
    size -= 1
    np.minimum(pick, size, out=pick)
    pick += r_off[node_rec]
    drawn = pool[pick]  # the drawn recorded step (index into the steps)
    cell = drawn + r_cell[node_rec]
    ok = present[cell]
    ok &= r_draws[node_rec]
    ok &= draw[unit]
    comm = nodes["kind"].is_in(_COMM).to_numpy()
    ok &= ~comm
    at = np.flatnonzero(ok)
    ratio = _common_mode(t, comm, node_rec)
    f = ratio[node_rec[at], drawn[at]]
    dur[at] = np.rint(recorded[cell[at]] * f).astype(np.int64)
    return dur


def _common_mode(t: DrawTable, comm: np.ndarray, node_rec: np.ndarray) -> np.ndarray:
    """``(recorded nodes, steps)``: per recorded node, its representative's total computation
    in the node's own step over that in each step (1 where a total is 0 or unknown).

    A total sums the drawing computation nodes of the representative, each at its op's
    duration in the step (its own where the op is missing there).
    """
    n_rec = t.r_len.size
    n_its = int(t.pool.max()) + 1
    rec_comm = np.zeros(n_rec, dtype=bool)
    rec_comm[node_rec] = comm
    use = t.r_draws & ~rec_comm
    rows = np.flatnonzero(use)
    cells = t.r_cell[rows, None] + np.arange(n_its, dtype=np.int64)
    own_step = np.maximum(t.r_code - 1, 0)
    mine = t.recorded[t.r_cell + own_step]  # a node's own recorded duration
    table = np.where(t.present[cells], t.recorded[cells], mine[rows, None]).astype(np.float64)
    total = np.zeros((int(t.r_source.max(initial=0)) + 1, n_its), dtype=np.float64)
    np.add.at(total, t.r_source[rows], table)
    src_total = total[t.r_source]  # (recorded nodes, steps)
    own = src_total[np.arange(n_rec), own_step]
    ok = (src_total > 0) & use[:, None]
    return np.divide(own[:, None], src_total, out=np.ones((n_rec, n_its)), where=ok)


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
        edge_rows: each edge's ``src`` and ``dst`` as rows of ``nodes`` (sorted by
            ``(rank, node_id)``), so they need not be looked up again.
    """

    nodes: pl.DataFrame
    edges: pl.DataFrame
    rank_unit_rank: np.ndarray
    replicas: list[int]
    representative_replica: int | None
    notes: list[str] = field(default_factory=list)
    edge_rows: tuple[np.ndarray, np.ndarray] | None = None


def _replicate(
    rank: np.ndarray, cls: np.ndarray, *, within: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a per-class frame to gather so that every target gets its class's rows.

    Args:
        rank: class (exemplar rank) of each row of the frame.
        cls: class of each target, targets in the order wanted.
        within: order of the rows within a class (default: frame order).

    Returns:
        ``(rows, target)``: the rows to gather, target by target, and the target of each.
    """
    rank = rank.astype(np.int64)
    order = (
        np.argsort(rank, kind="stable") if within is None else np.lexsort((within, rank))
    ).astype(np.int64)
    blocks, start, count = np.unique(rank[order], return_index=True, return_counts=True)
    if blocks.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pos = np.minimum(np.searchsorted(blocks, cls), blocks.size - 1)
    t = np.flatnonzero(blocks[pos] == cls)  # targets whose class has rows (an inner join)
    n = count[pos[t]].astype(np.int64)
    first = np.repeat(start[pos[t]] - (np.cumsum(n) - n), n)
    return order[first + np.arange(first.size, dtype=np.int64)], np.repeat(t, n)


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

    The copies are one gather of the class graphs (numpy row indices, no joins or sorts of the
    expanded graph): nodes come out sorted by ``(rank, node_id)``, edges by rank.

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

    # The ranks that get a copy (ascending), with their class.
    r_all = ranks["rank"].cast(pl.Int64).to_numpy()
    c_all = ranks["class_id"].cast(pl.Int64).to_numpy()
    pick = np.isin(r_all, world[np.isin(dp, chosen)])
    t_rank, t_cls = r_all[pick], c_all[pick]
    order = np.argsort(t_rank, kind="stable")
    t_rank, t_cls = t_rank[order], t_cls[order]

    # Communicators: per axis that does not span dp, the group holding each rank.
    spans = groups.select(_spans_dp_expr().alias("s"))["s"].to_numpy()
    members = (
        groups.filter(~pl.Series(spans))
        .select(pl.col("group_id").cast(pl.Int64).alias("new_group"), "axis", "ranks")
        .explode("ranks")
        .select("new_group", "axis", pl.col("ranks").cast(pl.Int64).alias("new_rank"))
        .drop_nulls("new_rank")
    )
    dup = members.group_by("axis", "new_rank").len().filter(pl.col("len") > 1)
    if not dup.is_empty():
        r = dup.row(0, named=True)
        msg = (
            f"rank {r['new_rank']} is in {r['len']} `{r['axis']}` groups; a replica can only be"
            " expanded when each axis's groups partition the world"
        )
        raise WhatIfError(msg)
    axes = sorted(set(members["axis"].to_list()))
    # (cast: with no per-replica group at all, replace_strict keeps the input's string dtype)
    a_code = (
        members["axis"]
        .replace_strict(axes, list(range(len(axes))), return_dtype=pl.Int64)
        .cast(pl.Int64)
    )
    m_rank = members["new_rank"].to_numpy()
    span = max(
        int(m_rank.max()) + 1 if m_rank.size else 0, int(t_rank.max()) + 1 if t_rank.size else 0
    )
    holder = np.full((max(len(axes), 1), max(span, 1)), -1, dtype=np.int64)
    holder[a_code.to_numpy(), m_rank] = members["new_group"].to_numpy()
    # Per exemplar node: the axis of its group when that group is per replica (-1: keep it).
    g_id = groups["group_id"].cast(pl.Int64).to_numpy()
    g_code = np.full(g_id.size, -1, dtype=np.int64)
    own = np.flatnonzero(~spans)
    axis_of, code_of = groups["axis"].to_list(), {a: i for i, a in enumerate(axes)}
    g_code[own] = [code_of.get(axis_of[i], -1) for i in own]  # no members: keep the group
    g_sort = np.argsort(g_id, kind="stable")
    node_g = nodes["group_id"].cast(pl.Int64)
    gid = node_g.fill_null(-1).to_numpy()
    node_code = np.full(nodes.height, -1, dtype=np.int64)
    if g_id.size:
        pos = np.minimum(np.searchsorted(g_id[g_sort], gid), g_id.size - 1)
        hit = node_g.is_not_null().to_numpy() & (g_id[g_sort][pos] == gid)
        node_code[hit] = g_code[g_sort][pos[hit]]

    ex = nodes["rank"].cast(pl.Int64).to_numpy()
    rows, tgt = _replicate(ex, t_cls, within=nodes["node_id"].to_numpy())
    new_rank = t_rank[tgt]
    copies = nodes[rows]
    cols: list[pl.Series] = [pl.Series("rank", new_rank).cast(nodes.schema["rank"])]
    # Groups: the copy's own communicator of the same axis, where it has one.
    code = node_code[rows]
    remap = np.flatnonzero(code >= 0)
    group = gid[rows]
    new_g = holder[code[remap], new_rank[remap]]
    group[remap] = np.where(new_g >= 0, new_g, group[remap])
    cols.append(
        pl.Series("group_id", group, dtype=pl.Int64).scatter(
            np.flatnonzero(node_g.is_null().to_numpy()[rows]), None
        )
    )
    # p2p peers: the exemplar's peer shifted by (new rank - exemplar) coordinate-wise.
    has_peer = nodes["peer"].is_not_null().to_numpy()[rows]
    if has_peer.any():
        at = np.flatnonzero(has_peer)
        peer = nodes["peer"].fill_null(0).to_numpy().astype(np.int64)[rows[at]]
        cp, ce, cn = layout.coords(peer), layout.coords(ex[rows[at]]), layout.coords(new_rank[at])
        moved = layout.rank_of({a: (cn[a] + cp[a] - ce[a]) % layout.size(a) for a in AXES})
        out = np.zeros(rows.size, dtype=np.int64)
        out[at] = moved
        cols.append(
            pl.Series("peer", out, dtype=pl.Int64)
            .cast(nodes.schema["peer"])
            .scatter(np.flatnonzero(~has_peer), None)
        )
    copies = copies.with_columns(cols)
    e_rank = edges["rank"].cast(pl.Int64).to_numpy()
    e_rows, e_tgt = _replicate(e_rank, t_cls)
    e = edges[e_rows].with_columns(pl.Series("rank", t_rank[e_tgt]).cast(edges.schema["rank"]))
    # Edge endpoints as rows of the copies: where the target's copy starts + the node's place in
    # its class's graph (node_id order); None when an edge names a node that does not exist.
    n_of = np.bincount(tgt, minlength=t_rank.size)
    copy_start = np.cumsum(n_of) - n_of
    places = _places(ex, nodes["node_id"].to_numpy(), e_rank, edges, ("src", "dst"))
    edge_rows = None
    if all((p >= 0).all() for p in places):
        edge_rows = (copy_start[e_tgt] + places[0][e_rows], copy_start[e_tgt] + places[1][e_rows])
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
        edge_rows=edge_rows,
    )


def _places(
    rank: np.ndarray, node_id: np.ndarray, e_rank: np.ndarray, edges: pl.DataFrame, ends: tuple
) -> list[np.ndarray]:
    """Per edge of the class graphs, the place of each end (``src``, ``dst``) among its rank's
    nodes in ``node_id`` order; -1 for a node that does not exist."""
    if rank.size == 0:
        return [np.full(edges.height, -1, dtype=np.int64) for _ in ends]
    key = rank.astype(np.int64) << 32 | node_id.astype(np.int64)
    key.sort()
    r = key >> 32
    first = np.flatnonzero(np.diff(r, prepend=r[0] - 1))
    place = np.arange(key.size) - np.repeat(first, np.diff(np.append(first, key.size)))
    out = []
    for end in ends:
        want = e_rank << 32 | edges[end].to_numpy().astype(np.int64)
        pos = np.minimum(np.searchsorted(key, want), key.size - 1)
        out.append(np.where(key[pos] == want, place[pos], -1))
    return out
