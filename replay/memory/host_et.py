"""Memory timeline of a rank derived from its host execution trace (no ``[memory]`` events needed).

The emulator re-times recorded allocator events (``replay.memory.retime``); a rank recorded without
``profile_memory`` has none. Its host ET (``et_op``) still names every tensor an op reads and
writes as ``[tensor_id, storage_id, offset, numel, elem_bytes, device]`` (parsed with
``replay.kernels``' helpers), so the life of every storage can be rebuilt and written as rows with
the columns of ``memory`` (``replay.memory.retime.MEMORY_COLUMNS``), timed at the linked Kineto
events, which ``retime_memory`` and everything after it take unchanged
(``replay.emulate.frames._memory`` uses them for a rank without recorded events).

Rules, and why:

- **Order.** Each thread's nodes are walked depth first (children by ``node_id``: the ET numbers
  a node when it starts); a node has an *entry* at its Kineto event's ``ts`` and an *exit* at
  ``ts + dur`` (``et_op.event_id`` -> ``event``; an unlinked node takes the time of the instant
  before it; a rank whose ET is linked to no event at all gets no rows). Threads are merged by
  time, each keeping its own order, so a gradient made on a GPU job's backward thread is seen
  before the optimizer on the main thread reads it.
- **Storages, not tensors.** Views share their base's storage: lives are keyed by
  ``(storage_id, device)``. A storage's size is the largest extent its refs reach,
  ``(offset + span of the strides) * elem_bytes`` (``TensorMeta.extent``; strides from
  ``attrs.input_strides``/``output_strides``, contiguous when the ET has none, which is
  ``(offset + numel) * elem_bytes``). The output of a view op with more elements than its input
  on the same storage (``expand``, a broadcasting ``as_strided``) is never used for the size: an
  ET without strides would read it as a dense buffer. The ET records no storage size.
- **Allocation = new production.** An op's outputs exist as soon as it starts (``aten::addmm``'s
  first child, a ``copy_`` of the bias, already writes its output), so they are looked at on the
  op's entry; a container's (no schema: ``record_param_comms``, an autograd Node) on its exit,
  after its children made them. An output is *new* when its storage is not among the node's
  inputs and was not touched since the node's *scope* began (the outermost op around it, as
  ``replay.kernels`` picks the ops to replay, or the node itself outside any op); a new output is
  allocated at the node's start. So an op's output is counted once: ``aten::linear``'s, made by
  its ``addmm`` and viewed, is one allocation at ``linear``'s start; in-place results and views
  allocate nothing.
- **Nested ops count.** Temporaries of composite ops (``reshape`` -> ``clone`` inside
  ``embedding``, ``native_layer_norm``'s mean and rstd, the ``log_softmax`` inside
  ``cross_entropy``) are real allocations, and a peak is often inside such an op. Walking only
  outermost ops would miss them and, worse, call a tensor made inside an op and saved for
  backward *resident* when backward first reads it.
- **Free = after the last use.** A storage is freed at the exit of the last node that touches it
  (input or output; a nested node's own exit when that is the last). Inside an autograd engine
  node (``autograd::engine::evaluate_function: ...``) a storage made outside it (a saved tensor,
  an incoming gradient) lives until that node returns: the engine holds them for the whole call.
  Python can hold a tensor after its last op (micro-batch inputs and outputs kept in a list until
  the step ends); the ET cannot see that, so each life is a lower bound.
- **Recycled ids.** The ET's ids are keyed by address and the allocator reuses a freed block's
  address, so one ``storage_id`` names several storages in turn. A new production of a known id
  ends the previous life (at its last use) and starts another; later uses belong to the new one.
  Without this a recycled id lives from its first production to the last use of its last
  incarnation: the overestimate (+27 to +78 % on the sample) of the earlier last-use prototype.
- **Resident storages.** A storage read before any node outputs it (parameters, optimizer state,
  DDP buckets, data made outside ops) was allocated before the trace: it is *resident*, live from
  the start, freed only when its id is produced anew (proof it died), else alive at the end.
- **Baseline (per device).** The CPU profiler's ``total_allocated`` counts from the start of
  profiling and drops no block allocated before it; the CUDA caching allocator's is the whole
  device. So by default residents are *left out* on ``cpu`` (the level starts at 0, as recorded
  CPU events do) and *counted* on ``cuda`` (a 0-byte baseline row carries them: parameters and
  optimizer state are what fills a GPU); ``include_resident`` forces either. CUDA blocks are
  rounded up to 512 bytes like the caching allocator's (``round_to``); CPU sizes are exact.
- **Iterations.** Lives may cross iteration boundaries (state made in one step and read in the
  next); nothing is freed at a boundary. A storage made in the window and alive at its end
  (lazily created optimizer state, kept gradients) is freed after its last use: the ET cannot
  tell it from a temporary. A row's ``iteration`` is its node's event's.
- **Not seen.** Allocations no ET node outputs (kernel workspaces, communication buffers, autograd
  engine internals) are missing too.

Rows are marked as derived, with no schema change: ``total_reserved`` is NULL (the ET knows
nothing of the caching allocator's reserve) and ``addr`` is ``-storage_id - 1`` (NULL on the
baseline row), never a real block address; ``is_derived`` tests rows for it. ``device_type`` and
``device_id`` are the allocator's (``cpu``/-1, ``cuda``/index).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import polars as pl
from prism_trace.replay.kernels.schema import TensorMeta, contiguous_strides, is_tensor_ref
from prism_trace.replay.memory.retime import MEMORY_COLUMNS, MEMORY_SCHEMA

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "DEFAULT_ROUND_TO",
    "et_memory",
    "is_derived",
    "lifetime_events",
    "rank_et_ops",
    "storage_lifetimes",
]

DEFAULT_ROUND_TO: Mapping[str, int] = {"cuda": 512}
"""Allocation granularity per device type: the CUDA caching allocator's 512-byte blocks."""

_ET_COLUMNS = (
    "node_id",
    "parent_node_id",
    "name",
    "op_schema",
    "inputs",
    "input_shapes",
    "outputs",
    "output_shapes",
    "attrs",
)

_LIFETIME_SCHEMA = {
    "storage_id": pl.Int64,
    "device": pl.String,
    "bytes": pl.Int64,
    "resident": pl.Boolean,
    "alloc_node": pl.Int64,
    "free_node": pl.Int64,
    "first_ts": pl.Int64,
    "alloc_ts": pl.Int64,
    "free_ts": pl.Int64,
    "alloc_pos": pl.Int64,
    "free_pos": pl.Int64,
    "alloc_iteration": pl.Int32,
    "free_iteration": pl.Int32,
}


@dataclass
class _Life:
    """One life of a storage id (see the module docstring)."""

    storage_id: int
    device: str
    resident: bool
    alloc_node: int  # node index (-1: resident)
    alloc_pos: int = -1  # instant position (-1: resident)
    size: int = 0  # bytes
    last_pos: int = -1  # exit position of the last node touching it
    last_node: int = -1
    first_pos: int = -1  # entry position of the first node touching it
    touched: int = -1  # walk sequence number of the last touch


def _refs(values: Any, shapes: Any, strides: Any) -> Iterator[tuple[list[Any], Any, Any]]:
    """Every tensor ref in a recorded argument list, with its shape and strides (or None)."""
    if is_tensor_ref(values):
        yield values, shapes, strides
        return
    if isinstance(values, list):
        for k, v in enumerate(values):
            shp = shapes[k] if isinstance(shapes, list) and k < len(shapes) else None
            st = strides[k] if isinstance(strides, list) and k < len(strides) else None
            yield from _refs(v, shp, st)


def _tensor(ref: list[Any], shape: Any, strides: Any) -> TensorMeta:
    """The ref as a ``TensorMeta`` (its dtype unused here), contiguous unless strides are given."""
    key = tuple(ref) if len(ref) == 6 else (*ref, "cpu")
    shp: tuple[int, ...] = (int(key[3]),)  # no usable shape: a flat span of numel
    if (
        isinstance(shape, list)
        and all(isinstance(s, int) for s in shape)
        and int(np.prod(shape, dtype=np.int64)) == int(key[3])
    ):
        shp = tuple(int(s) for s in shape)
    known = (
        isinstance(strides, list)
        and len(strides) == len(shp)
        and all(isinstance(s, int) for s in strides)
    )
    st = tuple(int(s) for s in strides) if known else contiguous_strides(shp)
    return TensorMeta(key=key, shape=shp, strides=st, dtype="")


def _nbytes(meta: TensorMeta) -> int:
    return max(meta.extent, 0) * meta.elem_bytes


def _loads(text: Any, default: Any) -> Any:
    if text is None:
        return default
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return default


def _instants(
    ops: pl.DataFrame,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Entry and exit instants of every node, merged over threads in time order.

    Returns ``(node, is_exit, time, entry_pos, exit_pos)``: the sorted instants (node index,
    exit flag, ns) and, per node index, the position of its entry and of its exit.
    """
    n = ops.height
    node_ids = ops["node_id"].to_numpy()
    index = {int(v): i for i, v in enumerate(node_ids)}
    parents = ops["parent_node_id"].to_list()
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for i in np.argsort(node_ids, kind="stable"):
        p = parents[i]
        j = index.get(int(p)) if p is not None else None
        if j is None or j == i:
            roots.append(int(i))
        else:
            children[j].append(int(i))
    ts = ops["ts"].to_numpy(allow_copy=True).astype(np.float64)
    end = ts + ops["dur"].fill_null(0).to_numpy().astype(np.float64)
    # A lane per thread subtree: the roots' children when a root is the ET's process node
    # (its children are the threads), else the roots themselves.
    lanes: list[int] = []
    for r in roots:
        if children[r] and np.isnan(ts[r]):
            lanes.extend(children[r])
        else:
            lanes.append(r)
    seq_node: list[int] = []
    seq_exit: list[bool] = []
    seq_time: list[float] = []
    for lane in lanes:
        start = len(seq_node)
        stack: list[tuple[int, bool]] = [(lane, False)]
        while stack:
            i, is_exit = stack.pop()
            seq_node.append(i)
            seq_exit.append(is_exit)
            seq_time.append(end[i] if is_exit else ts[i])
            if not is_exit:
                stack.append((i, True))
                stack.extend((c, False) for c in reversed(children[i]))
        # Unlinked nodes take the time before them; times never go back within a thread.
        t = np.asarray(seq_time[start:], dtype=np.float64)
        first = np.flatnonzero(~np.isnan(t))
        fill = t[first[0]] if first.size else 0.0
        t = np.where(np.isnan(t), -np.inf, t)
        t = np.maximum.accumulate(t)
        t[np.isinf(t)] = fill
        seq_time[start:] = t.tolist()
    node = np.asarray(seq_node, dtype=np.int64)
    is_exit_a = np.asarray(seq_exit, dtype=bool)
    time = np.asarray(seq_time, dtype=np.float64)
    order = np.argsort(time, kind="stable")
    node, is_exit_a, time = node[order], is_exit_a[order], time[order]
    entry_pos = np.full(n, -1, dtype=np.int64)
    exit_pos = np.full(n, -1, dtype=np.int64)
    pos = np.arange(node.size, dtype=np.int64)
    entry_pos[node[~is_exit_a]] = pos[~is_exit_a]
    exit_pos[node[is_exit_a]] = pos[is_exit_a]
    return node, is_exit_a, time, entry_pos, exit_pos


_ENGINE = "autograd::engine::evaluate_function:"
"""Prefix of the node the autograd engine runs a backward function under."""


def _tree(ops: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node index: ``is_op``, its *scope* (its outermost op ancestor-or-self, else itself)
    and its *engine* node (nearest ``autograd::engine::evaluate_function:`` ancestor-or-self,
    -1 when none)."""
    n = ops.height
    index = {int(v): i for i, v in enumerate(ops["node_id"].to_list())}
    parent = np.full(n, -1, dtype=np.int64)
    for i, p in enumerate(ops["parent_node_id"].to_list()):
        j = index.get(int(p)) if p is not None else None
        if j is not None and j != i:
            parent[i] = j
    is_op = ops["op_schema"].is_not_null().to_numpy()
    is_engine = ops["name"].str.starts_with(_ENGINE).fill_null(value=False).to_numpy()
    scope = np.full(n, -2, dtype=np.int64)
    engine = np.full(n, -2, dtype=np.int64)
    for i in range(n):
        chain: list[int] = []
        j = i
        while j >= 0 and scope[j] == -2:
            scope[j] = -3  # on the chain: a malformed parent cycle stops here
            chain.append(j)
            j = int(parent[j])
        if j >= 0 and scope[j] == -3:
            j = -1
        above, eng = (int(scope[j]), int(engine[j])) if j >= 0 else (-1, -1)
        for k in reversed(chain):  # top down
            if above < 0 and is_op[k]:
                above = k
            if is_engine[k]:
                eng = k
            scope[k] = above
            engine[k] = eng
    # a node outside any op (-1 here) is its own scope
    outside = ~is_op & (scope < 0)
    scope = np.where(outside, np.arange(n), scope)
    return is_op, scope, engine


class _Walk:
    """The walk of ``storage_lifetimes``: lives by storage key, in instant order."""

    def __init__(self, ops: pl.DataFrame) -> None:
        self.node, self.is_exit, self.time, self.entry_pos, self.exit_pos = _instants(ops)
        self.is_op, self.scope, self.engine = _tree(ops)
        self.ins = ops["inputs"].to_list()
        self.in_shapes = ops["input_shapes"].to_list()
        self.outs = ops["outputs"].to_list()
        self.out_shapes = ops["output_shapes"].to_list()
        self.attrs = ops["attrs"].to_list()
        self.live: dict[tuple[int, str], _Life] = {}
        self.done: list[_Life] = []
        self.broadcast: set[tuple[Any, ...]] = set()
        self.entry_seq = np.zeros(ops.height, dtype=np.int64)
        self.seq = 0

    def refs(self, i: int) -> tuple[list[TensorMeta], list[TensorMeta]]:
        """Node ``i``'s input and output tensors."""
        attrs = _loads(self.attrs[i], {})
        ins = [
            _tensor(r, shp, st)
            for r, shp, st in _refs(
                _loads(self.ins[i], []), _loads(self.in_shapes[i], []), attrs.get("input_strides")
            )
        ]
        outs = [
            _tensor(r, shp, st)
            for r, shp, st in _refs(
                _loads(self.outs[i], []),
                _loads(self.out_shapes[i], []),
                attrs.get("output_strides"),
            )
        ]
        return ins, outs

    def touch(self, life: _Life, i: int, meta: TensorMeta) -> None:
        """Node ``i`` uses ``life``: it lives at least until ``i`` (or its engine node) returns."""
        life.touched = self.seq
        if life.first_pos < 0:
            life.first_pos = int(self.entry_pos[i])
        release = int(self.exit_pos[i])
        e = int(self.engine[i])
        if e >= 0 and (life.alloc_node < 0 or self.engine[life.alloc_node] != e):
            release = int(self.exit_pos[e])  # the engine holds a node's inputs until it returns
        if release > life.last_pos:
            life.last_pos = release
            life.last_node = i
        if meta.key not in self.broadcast:
            life.size = max(life.size, _nbytes(meta))

    def enter(self, i: int, ins: list[TensorMeta]) -> None:
        """Inputs of node ``i``: a storage never seen before is resident."""
        self.seq += 1
        self.entry_seq[i] = self.seq
        for meta in ins:
            life = self.live.get(meta.storage)
            if life is None:
                life = _Life(meta.storage[0], meta.storage[1], resident=True, alloc_node=-1)
                self.live[meta.storage] = life
            self.touch(life, i, meta)

    def produce(self, i: int, ins: list[TensorMeta], outs: list[TensorMeta]) -> None:
        """Outputs of node ``i``: a new life where untouched since the node's scope began."""
        self.seq += 1
        numel: dict[tuple[int, str], int] = {}
        for meta in ins:
            numel[meta.storage] = max(numel.get(meta.storage, 0), int(meta.key[3]))
        since = self.entry_seq[self.scope[i]]
        for meta in outs:
            life = self.live.get(meta.storage)
            if life is not None and (meta.storage in numel or life.touched >= since):
                if int(meta.key[3]) > numel.get(meta.storage, int(meta.key[3])):
                    self.broadcast.add(meta.key)  # expand: more elements than its base holds
                self.touch(life, i, meta)
                continue
            if life is not None:  # a recycled id: the previous life ended at its last use
                life.last_pos = min(life.last_pos, int(self.entry_pos[i]))
                self.done.append(life)
            life = _Life(
                meta.storage[0],
                meta.storage[1],
                resident=False,
                alloc_node=i,
                alloc_pos=int(self.entry_pos[i]),
            )
            self.live[meta.storage] = life
            self.touch(life, i, meta)

    def run(self) -> list[_Life]:
        """Walk every instant; the lives, ended or not."""
        pending: dict[int, tuple[list[TensorMeta], list[TensorMeta]]] = {}
        for i, leaving in zip(self.node.tolist(), self.is_exit.tolist(), strict=True):
            if leaving:
                if i in pending:  # a container: its outputs are known once its children ran
                    self.produce(i, *pending.pop(i))
                continue
            ins, outs = self.refs(i)
            self.enter(i, ins)
            if self.is_op[i]:  # an op: its outputs exist for its children (addmm -> copy_)
                self.produce(i, ins, outs)
            elif outs:
                pending[i] = (ins, outs)
        return [*self.done, *self.live.values()]


def storage_lifetimes(ops: pl.DataFrame) -> pl.DataFrame:
    """Every life of every storage of one rank's host ET (the rules of the module docstring).

    Args:
        ops: the rank's ``et_op`` rows (``node_id, parent_node_id, name, op_schema, inputs,
            input_shapes, outputs, output_shapes, attrs``) with their linked event's ``ts``,
            ``dur`` and ``iteration`` (NULL when unlinked).

    Returns:
        One row per life: ``storage_id, device, bytes, resident, alloc_node, free_node, first_ts,
        alloc_ts, free_ts, alloc_pos, free_pos, alloc_iteration, free_iteration`` (``first_ts``:
        the first node touching it starts; ``alloc_*`` NULL for a resident storage, ``free_*``
        NULL for one alive at the end; ``*_pos``: position in the merged order of entries and
        exits, which orders instants of equal ``ts``).
    """
    if ops.is_empty():
        return pl.DataFrame(schema=_LIFETIME_SCHEMA)
    walk = _Walk(ops)
    lives = walk.run()
    ending = {id(x) for x in walk.live.values() if x.resident}
    node_ids = ops["node_id"].to_list()
    iters = ops["iteration"].to_list() if "iteration" in ops.columns else [None] * ops.height
    rows = []
    for life in lives:
        a = life.alloc_node
        f = -1 if id(life) in ending else life.last_node  # resident, never recycled: no free
        rows.append(
            (
                life.storage_id,
                life.device,
                life.size,
                life.resident,
                node_ids[a] if a >= 0 else None,
                node_ids[f] if f >= 0 else None,
                int(walk.time[life.first_pos]),
                int(walk.time[life.alloc_pos]) if a >= 0 else None,
                int(walk.time[life.last_pos]) if f >= 0 else None,
                life.alloc_pos if a >= 0 else None,
                life.last_pos if f >= 0 else None,
                iters[a] if a >= 0 else None,
                iters[f] if f >= 0 else None,
            )
        )
    return pl.DataFrame(rows, schema=_LIFETIME_SCHEMA, orient="row")


def lifetime_events(
    lifetimes: pl.DataFrame,
    *,
    rank: int,
    include_resident: bool | None = None,
    round_to: Mapping[str, int] | None = None,
) -> pl.DataFrame:
    """Allocator-like rows (``MEMORY_COLUMNS``) of one rank from its storage lives.

    Args:
        lifetimes: ``storage_lifetimes`` of the rank.
        rank: the rank to write in the rows.
        include_resident: count resident storages in the level (True), leave them out (False), or
            per device as the profiler's allocators do (None: ``cuda`` yes, ``cpu`` no).
        round_to: allocation granularity per device type (``DEFAULT_ROUND_TO`` when None).

    Returns:
        Rows sorted by ``(device_type, device_id, ts)``, instants of equal ``ts`` in walk order:
        where resident storages count, first a 0-byte *baseline* row (``addr`` NULL) carrying
        their bytes when the rank first uses a tensor; then ``bytes`` > 0 at the producing node's
        start and < 0 at the exit of the last node that used the storage (``addr`` =
        ``-storage_id - 1``); ``total_allocated`` is the running level per device from the
        baseline; ``total_reserved`` is NULL.
    """
    lt = lifetimes.filter(pl.col("bytes") > 0)
    if lt.is_empty():
        return pl.DataFrame(schema=MEMORY_SCHEMA)
    steps = {**(DEFAULT_ROUND_TO if round_to is None else round_to)}
    kind = pl.col("device").str.split(":").list.first()
    index = pl.col("device").str.split(":").list.get(1, null_on_oob=True)
    lt = lt.with_columns(
        kind.alias("device_type"),
        pl.when(kind == "cpu")
        .then(pl.lit(-1, pl.Int32))
        .otherwise(index.cast(pl.Int32, strict=False).fill_null(0))
        .alias("device_id"),
    )
    step = pl.col("device_type").replace_strict(steps, default=1, return_dtype=pl.Int64)
    lt = lt.with_columns((((pl.col("bytes") + step - 1) // step) * step).alias("bytes"))
    counted = pl.col("device_type") != "cpu" if include_resident is None else include_resident
    lt = lt.filter(~pl.col("resident") | counted)
    start = lifetimes.select(pl.min_horizontal(pl.col("first_ts").min(), pl.col("alloc_ts").min()))
    addr = (-pl.col("storage_id") - 1).alias("addr")
    base = (
        lt.filter(pl.col("resident"))
        .group_by("device_type", "device_id")
        .agg(pl.col("bytes").sum().alias("_base"))
    )
    baseline = base.select(
        pl.lit(start.item(), pl.Int64).alias("ts"),
        pl.lit(-1, pl.Int64).alias("_pos"),
        "device_type",
        "device_id",
        pl.lit(None, pl.Int64).alias("addr"),
        pl.lit(0, pl.Int64).alias("bytes"),
        pl.lit(None, pl.Int32).alias("iteration"),
    )
    allocs = lt.filter(~pl.col("resident")).select(
        pl.col("alloc_ts").alias("ts"),
        pl.col("alloc_pos").alias("_pos"),
        "device_type",
        "device_id",
        addr,
        "bytes",
        pl.col("alloc_iteration").alias("iteration"),
    )
    frees = lt.filter(pl.col("free_ts").is_not_null()).select(
        pl.col("free_ts").alias("ts"),
        pl.col("free_pos").alias("_pos"),
        "device_type",
        "device_id",
        addr,
        -pl.col("bytes"),
        pl.col("free_iteration").alias("iteration"),
    )
    key = ["device_type", "device_id"]
    ev = (
        pl.concat([baseline, allocs, frees])
        .join(base, on=key, how="left")
        .sort(*key, "ts", "_pos")
        .with_columns(
            (pl.col("_base").fill_null(0) + pl.col("bytes").cum_sum().over(key)).alias(
                "total_allocated"
            )
        )
    )
    done = {"rank": pl.lit(rank), "total_reserved": pl.lit(None), "inferred": pl.lit(value=False)}
    return ev.with_columns(**done).select(MEMORY_COLUMNS).cast(pl.Schema(MEMORY_SCHEMA))


def rank_et_ops(con: duckdb.DuckDBPyConnection, run_id: int, rank: int) -> pl.DataFrame:
    """One rank's ``et_op`` rows with their linked event's ``ts``, ``dur`` and ``iteration``:
    the input of ``storage_lifetimes``."""
    cols = ", ".join(f"o.{c}" for c in _ET_COLUMNS)
    return con.sql(
        f"SELECT {cols}, e.ts, e.dur, e.iteration FROM et_op o"
        " LEFT JOIN event e ON e.run_id = o.run_id AND e.rank = o.rank"
        " AND e.event_id = o.event_id WHERE o.run_id = $1 AND o.rank = $2",
        params=[run_id, rank],
    ).pl()


def et_memory(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    ranks: Sequence[int],
    *,
    include_resident: bool | None = None,
    round_to: Mapping[str, int] | None = None,
) -> pl.DataFrame:
    """Derived memory rows (``MEMORY_COLUMNS``) of the ``ranks`` of a run that have host ET ops.

    Args:
        con: the store's connection.
        run_id: the recorded run.
        ranks: ranks to derive (those without ``et_op`` rows linked to events give nothing).
        include_resident: see ``lifetime_events``.
        round_to: see ``lifetime_events``.

    Returns:
        The rows of every rank, sorted by ``(rank, device, ts)``.
    """
    if not ranks:
        return pl.DataFrame(schema=MEMORY_SCHEMA)
    # A rank whose ET is linked to no Kineto event has no times to put the rows at: skipped.
    have = con.sql(
        "SELECT rank FROM et_op WHERE run_id = $1 AND list_contains($2, rank)"
        " GROUP BY rank HAVING count(event_id) > 0",
        params=[run_id, [int(r) for r in ranks]],
    ).fetchall()
    frames = [
        lifetime_events(
            storage_lifetimes(rank_et_ops(con, run_id, int(r))),
            rank=int(r),
            include_resident=include_resident,
            round_to=round_to,
        )
        for (r,) in sorted(have)
    ]
    return pl.concat([pl.DataFrame(schema=MEMORY_SCHEMA), *frames])


def is_derived(memory: pl.DataFrame) -> pl.Series:
    """Per row, whether it was derived from the host ET: no ``total_reserved`` and ``addr``
    negative or NULL (a recorded row has the block's address)."""
    return (memory["total_reserved"].is_null() & (memory["addr"].fill_null(-1) < 0)).alias(
        "derived"
    )
