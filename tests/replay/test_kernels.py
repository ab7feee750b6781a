"""Rebuilding ops from the host ET (``replay.kernels``) on rank 0 of the bundled sample."""

from __future__ import annotations

import time
from collections import Counter

import orjson
import polars as pl
import pytest

torch = pytest.importorskip("torch")

from prism_trace.replay.kernels.codegen import check_program, compile_pass  # noqa: E402
from prism_trace.replay.kernels.rebuild import build_program, make_externals  # noqa: E402
from prism_trace.replay.kernels.schema import parse_schema  # noqa: E402
from prism_trace.replay.kernels.units import select_units  # noqa: E402


def _cpu(_: str) -> object:
    return torch.device("cpu")


@pytest.fixture(scope="module")
def rank0(sample_store: object) -> tuple[pl.DataFrame, set[int]]:
    from prism_trace.graph.build import build_graph

    con = sample_store.con  # type: ignore[attr-defined]
    if not con.execute("SELECT count(*) FROM graph_node").fetchall()[0][0]:
        build_graph(sample_store, "sample")  # type: ignore[arg-type]
    return _rank_inputs(con, 0)


def _rank_inputs(con: object, rank: int) -> tuple[pl.DataFrame, set[int]]:
    """A sample rank's ET ops (with iterations) and its communication events."""
    ops = con.sql(  # type: ignore[attr-defined]
        "SELECT o.*, e.iteration FROM et_op o LEFT JOIN event e USING (run_id, rank, event_id)"
        " WHERE o.rank = $1",
        params=[rank],
    ).pl()
    comm = {
        e
        for (e,) in con.execute(  # type: ignore[attr-defined]
            "SELECT event_id FROM graph_node WHERE rank = ? AND kind IN"
            " ('collective', 'send', 'recv')",
            [rank],
        ).fetchall()
    }
    return ops, comm


def test_parse_schema() -> None:
    name, ov, args, rets = parse_schema(
        "aten::randint.generator(SymInt high, SymInt[] size, *, Generator? generator,"
        " ScalarType? dtype=4, Layout? layout=None, Device? device=None, bool? pin_memory=None)"
        " -> Tensor"
    )
    assert (name, ov, rets) == ("aten::randint", "generator", ["Tensor"])
    assert [a.name for a in args if a.kwarg_only] == [
        "generator",
        "dtype",
        "layout",
        "device",
        "pin_memory",
    ]
    assert args[1].type == "SymInt[]"
    assert args[1].is_list
    assert args[3].base == "ScalarType"
    _, ov, args, rets = parse_schema(
        "aten::_fused_adam_(Tensor(a!)[] self, Tensor(b!)[] grads, Tensor?[] x, *, float lr) -> ()"
    )
    assert ov == "default"
    assert rets == []
    assert [a.type for a in args] == ["Tensor[]", "Tensor[]", "Tensor?[]", "float"]
    _, _, _, rets = parse_schema(
        "aten::native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight,"
        " Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)"
    )
    assert rets == ["Tensor", "Tensor", "Tensor"]
    with pytest.raises(ValueError, match="not an op schema"):
        parse_schema("ProfilerStep#1")


def test_units_are_outermost_ops_and_comm(rank0: tuple) -> None:
    ops, comm = rank0
    units, skipped = select_units(ops, comm)
    compute = [u for u in units if u.kind == "compute"]
    comms = [u for u in units if u.kind == "comm"]
    assert len(comms) == len(comm) == 50
    assert len(compute) == 1110
    assert not any(u.name.startswith("c10d::") for u in compute)
    assert [u.node_id for u in units] == sorted(u.node_id for u in units)
    assert {u.iteration for u in units} == {1, 2}
    # No unit runs inside another unit: walk each unit's ancestors.
    parent = dict(zip(ops["node_id"].to_list(), ops["parent_node_id"].to_list(), strict=True))
    schema = dict(zip(ops["node_id"].to_list(), ops["op_schema"].to_list(), strict=True))
    ids = {u.node_id for u in units}
    for u in units:
        p = parent[u.node_id]
        while p is not None:
            assert p not in ids
            assert schema[p] is None
            p = parent[p]
    # The c10d ops are all under the communication units; nested ops are counted, not lost.
    assert skipped["inside_comm"] == 50
    assert skipped["inside_op"] > 0
    assert skipped["uncovered_comm"] == 0


def test_every_compute_op_of_rank0_is_rebuilt_and_runs(rank0: tuple) -> None:
    ops, comm = rank0
    units, skipped = select_units(ops, comm)
    program = build_program(units, ops, device=_cpu, skipped=skipped)
    summary = program.support_summary()
    assert summary["supported"] == summary["compute_units"] == 1110
    assert summary["supported_fraction"] == 1.0
    externals = make_externals(program, _cpu)
    # Externals of one recorded storage share one buffer (views alias).
    by_storage: dict[tuple, set[int]] = {}
    for m, t in zip(program.externals, externals, strict=True):
        by_storage.setdefault((*m.storage, m.dtype), set()).add(t.untyped_storage().data_ptr())
    assert all(len(ptrs) == 1 for ptrs in by_storage.values())
    assert check_program(program, externals, _cpu) == {}
    # Views of results that the ET reaches through another tensor id are rebuilt as aliases.
    assert sum(len(c.aliases) for c in program.calls.values()) > 0
    fn = compile_pass(program, gaps=False, device=_cpu)
    t = [0] * (2 * len(units))
    seen: list[int] = []

    def noop(k: int) -> None:
        seen.append(k)

    def es(shape: list[int], strides: list[int], dtype: torch.dtype, dev: object) -> torch.Tensor:
        return torch.empty_strided(shape, strides, dtype=dtype, device=dev)

    with torch.no_grad():
        fn(externals, t, time.perf_counter_ns, noop, noop, noop, noop, torch.as_strided, es)
    assert all(t[2 * k + 1] >= t[2 * k] > 0 for k in range(len(units)))
    # B marks the two iteration starts and the end; W is called once per comm unit.
    assert seen.count(len(units)) == 1


def test_storages_made_inside_an_op_and_read_later_are_allocated_after_it(rank0: tuple) -> None:
    """``layer_norm`` keeps its inner ``native_layer_norm``'s mean and rstd for backward: the
    replay allocates them after the unit (not before the pass, as externals), so their memory is
    held from that op to the backward op that reads them, as in the recording."""
    ops, comm = rank0
    units, skipped = select_units(ops, comm)
    program = build_program(units, ops, device=_cpu, skipped=skipped)
    made = {slot: k for k, allocs in program.nested_outputs.items() for slot, _ in allocs}
    assert made
    names = {units[k].name for k in made.values()}
    assert "aten::layer_norm" in names
    # Each is read by a later unit (through a view of the flat buffer), then freed after it.
    freed_at = {s: k for k, slots in program.frees_after.items() for s in slots}
    for slot, k in made.items():
        assert freed_at[slot] > k
        assert program.slot_meta[slot].dtype in ("float32", "float64", "float16", "bfloat16")
    readers = {
        a_base[1]: i
        for i, call in program.calls.items()
        for _, a_base, _ in call.aliases
        if a_base[0] == "s"
    }
    assert all(slot in readers and readers[slot] > k for slot, k in made.items())
    # They are no longer externals made before the pass: none of their storages is one.
    ext = {m.storage for m in program.externals}
    assert not {program.slot_meta[s].storage for s in made} & ext


def test_a_missing_op_is_unsupported_with_its_reason(rank0: tuple) -> None:
    ops, comm = rank0
    victim = ops.filter(pl.col("name") == "aten::gelu")["node_id"][0]
    bad = ops.with_columns(
        pl.when(pl.col("node_id") == victim)
        .then(pl.lit("aten::no_such_op_here(Tensor self) -> Tensor"))
        .otherwise(pl.col("op_schema"))
        .alias("op_schema")
    )
    units, skipped = select_units(bad, comm)
    program = build_program(units, bad, device=_cpu, skipped=skipped)
    (u,) = program.unsupported_ops()
    assert u.name == "aten::gelu"
    assert u.count == 1
    assert "no op aten::no_such_op_here" in u.reason
    # Its result is still made (empty, recorded layout), so later ops still run.
    (idx,) = program.unsupported
    assert program.substituted_outputs[idx]
    externals = make_externals(program, _cpu)
    assert check_program(program, externals, _cpu) == {}


def test_check_catches_shape_mismatch(rank0: tuple) -> None:
    """An op whose rebuilt result disagrees with the recorded shape is reported by the check."""
    ops, comm = rank0
    victim = ops.filter(pl.col("name") == "aten::gelu")["node_id"][0]
    row = ops.filter(pl.col("node_id") == victim)
    shapes = row["output_shapes"][0]
    bad = ops.with_columns(
        pl.when(pl.col("node_id") == victim)
        .then(pl.lit(shapes.replace("[[", "[[7,", 1)))
        .otherwise(pl.col("output_shapes"))
        .alias("output_shapes")
    )
    units, skipped = select_units(bad, comm)
    program = build_program(units, bad, device=_cpu, skipped=skipped)
    found = check_program(program, make_externals(program, _cpu), _cpu)
    assert len(found) == 1
    assert "differs from recorded" in next(iter(found.values()))


def test_last_stage_with_recycled_storage_ids_is_rebuilt(
    sample_store: object, rank0: tuple
) -> None:
    """Rank 4 (last pipeline stage, with the loss) records a new, larger tensor under the storage
    id of a freed result: it must become a tensor of its own, not an out-of-bounds view of that
    result, and tensors sharing a storage share one buffer (an external one, or the buffer the
    replay allocates for a storage made inside an op)."""
    ops, comm = _rank_inputs(sample_store.con, 4)  # type: ignore[attr-defined]
    units, skipped = select_units(ops, comm)
    program = build_program(units, ops, device=_cpu, skipped=skipped)
    externals = make_externals(program, _cpu)
    with torch.no_grad():
        bad = check_program(program, externals, _cpu)
    assert bad == {}
    summary = program.support_summary()
    assert summary["supported"] == summary["compute_units"] == 1346
    nested = {slot for allocs in program.nested_outputs.values() for slot, _ in allocs}
    views = Counter(
        base[1]
        for call in program.calls.values()
        for _, base, _ in call.aliases
        if base[0] == "s" and base[1] in nested
    )
    # Several tensors view one storage: externals sharing a buffer, or one nested buffer viewed
    # by several later ops (cross_entropy_loss keeps its log_softmax, read by nll_loss_backward
    # and _log_softmax_backward_data).
    assert len(program.buffers) < len(program.externals) or max(views.values()) > 1
    from prism_trace.replay.kernels.rebuild import external_buffers

    assert len(external_buffers(program, externals)) == len(program.buffers)


def test_views_are_built_before_the_gap_wait(rank0: tuple) -> None:
    """With gaps, a unit's views (autograd's saved views, one Python call each) are made before
    ``S(k)`` waits its recorded gap, so their cost is spent inside that gap, not added after it;
    the op's start stamp follows ``S(k)`` directly."""
    from prism_trace.replay.kernels.codegen import render

    ops, comm = rank0
    units, skipped = select_units(ops, comm)
    program = build_program(units, ops, device=_cpu, skipped=skipped)
    source, _ = render(program, gaps=True, device=_cpu)
    lines = [ln.strip() for ln in source.splitlines()]
    checked = 0
    for k, call in program.calls.items():
        wait = lines.index(f"S({k})")
        assert lines[wait + 1] == f"T[{2 * k}] = pc()"
        for alias, _, _ in call.aliases:
            made = next(i for i, ln in enumerate(lines) if ln.startswith(f"a{alias} = AS("))
            assert made < wait
            checked += 1
    assert checked > 0


def test_the_bare_pass_runs_the_same_ops_without_clock_or_hooks(rank0: tuple) -> None:
    """``render(timed=False)``, the baseline of the instrumentation overhead, keeps every op
    call, view, allocation and free of the timed pass and drops only the clock reads and hooks:
    run, both make the same calls in the same order with tensors of the same shapes."""
    from prism_trace.replay.kernels.codegen import render

    ops, comm = rank0
    units, skipped = select_units(ops, comm)
    program = build_program(units, ops, device=_cpu, skipped=skipped)
    timed_src, _ = render(program, gaps=True, device=_cpu)
    bare_src, _ = render(program, gaps=True, device=_cpu, timed=False)
    assert "pc()" not in bare_src
    hooks = ("T[", "B(", "S(", "W(", "SUB(")
    assert not [ln for ln in bare_src.splitlines() if ln.strip().startswith(hooks)]
    work = [ln for ln in timed_src.splitlines() if not ln.strip().startswith(("T[", "B(", "S("))]
    comm_calls = [ln for ln in work if ln.strip().startswith("W(")]
    assert len(comm_calls) == 50
    assert [ln for ln in work if ln not in comm_calls] == bare_src.splitlines()

    def logged(name: str, fn: object, log: list) -> object:
        def call(*args: object, **kwargs: object) -> object:
            out = fn(*args, **kwargs)  # type: ignore[operator]
            log.append((name, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
            return out

        return call

    def es(shape: list[int], strides: list[int], dtype: torch.dtype, dev: object) -> torch.Tensor:
        return torch.empty_strided(shape, strides, dtype=dtype, device=dev)

    def hook(_: int) -> None:
        return None

    logs: list[list] = []
    for timed in (True, False):
        source, glb = render(program, gaps=False, device=_cpu, timed=timed)
        log: list = []
        glb = {k: logged(k, v, log) if k.startswith("F") else v for k, v in glb.items()}
        exec(compile(source, "<pass>", "exec"), glb)
        externals = make_externals(program, _cpu)
        t = [0] * (2 * len(units))
        with torch.no_grad():
            glb["_replay_pass"](
                externals,
                t,
                time.perf_counter_ns,
                hook,
                hook,
                hook,
                hook,
                logged("AS", torch.as_strided, log),
                logged("ES", es, log),
            )
        logs.append(log)
    assert len(logs[0]) == 1110 + sum(len(c.aliases) for c in program.calls.values()) + sum(
        len(v) for v in program.nested_outputs.values()
    )
    assert logs[0] == logs[1]


def test_an_undefined_result_is_no_tensor(rank0: tuple) -> None:
    """CUDA's attention backward returns an undefined tensor where there is no bias gradient; the
    ET writes it as ``Tensor(nullptr (uninitialized))`` with an empty reference. It is no result
    (the first replay on a GPU refused the op: 'has no torch dtype here')."""
    ops, comm = rank0
    units, skipped = select_units(ops, comm)
    program = build_program(units, ops, device=_cpu, skipped=skipped)
    call = next(c for c in program.calls.values() if len({j for j, *_ in c.outputs}) >= 2)
    victim = call.unit.node_id
    row = ops.filter(pl.col("node_id") == victim)
    types = orjson.loads(row["output_types"][0])
    vals = orjson.loads(row["outputs"][0])
    last = max(j for j, *_ in call.outputs)
    types[last] = "Tensor(nullptr (uninitialized))"
    vals[last] = [vals[last][0], 0, 0, 0, 0, ""]
    bad = ops.with_columns(
        pl.when(pl.col("node_id") == victim)
        .then(pl.lit(orjson.dumps(types).decode()))
        .otherwise(pl.col("output_types"))
        .alias("output_types"),
        pl.when(pl.col("node_id") == victim)
        .then(pl.lit(orjson.dumps(vals).decode()))
        .otherwise(pl.col("outputs"))
        .alias("outputs"),
    )
    units, skipped = select_units(bad, comm)
    program = build_program(units, bad, device=_cpu, skipped=skipped)
    assert program.unsupported_ops() == []
    rebuilt = program.calls[call.unit.index]
    assert {j for j, *_ in rebuilt.outputs} == {j for j, *_ in call.outputs} - {last}


def test_an_external_storage_is_made_big_enough_for_its_larger_views() -> None:
    """gloo on CUDA stages each bucket through a pinned host buffer whose storage id (an address)
    the recording reuses for a larger bucket later: the first view seen is smaller than a later
    one. The buffer must hold both (the first GPU run refused the later copy_: 'setStorage: ...
    out of bounds for storage of size 4200448')."""
    from prism_trace.replay.kernels.rebuild import _buffers, _Planner
    from prism_trace.replay.kernels.schema import TensorMeta

    planner = _Planner()
    aliases: list = []
    small = TensorMeta(
        key=(1, 77, 0, 1050112, 4, "cpu"), shape=(1050112,), strides=(1,), dtype="float32"
    )
    large = TensorMeta(
        key=(2, 77, 0, 1050624, 4, "cpu"), shape=(1050624,), strides=(1,), dtype="float32"
    )
    assert planner.tensor(small, 0, aliases)[0] == "x"
    assert planner.tensor(large, 1, aliases)[0] == "a"  # a view of the same buffer
    ext_buffer, buffers = _buffers(planner.externals, planner.reach)
    assert ext_buffer == [0]
    assert buffers == [("float32", 1050624, "cpu")]
    base = torch.empty(buffers[0][1])
    view = torch.as_strided(base, large.shape, large.strides, large.offset)
    assert view.numel() == 1050624


def test_an_undefined_element_of_a_list_result_leaves_the_others(rank0: tuple) -> None:
    """A list result with one undefined element keeps its other elements as results."""
    ops, comm = rank0
    units, skipped = select_units(ops, comm)
    program = build_program(units, ops, device=_cpu, skipped=skipped)
    call = next(c for c in program.calls.values() if any(i is not None for _, i, _, _ in c.outputs))
    row = ops.filter(pl.col("node_id") == call.unit.node_id)
    types = orjson.loads(row["output_types"][0])
    vals = orjson.loads(row["outputs"][0])
    j = next(j for j, i, _, _ in call.outputs if i is not None)
    elems = types[j][len("GenericList[") : -1].split(",")
    elems[-1] = "Tensor(nullptr (uninitialized))"
    types[j] = "GenericList[" + ",".join(elems) + "]"
    vals[j][-1] = [vals[j][-1][0], 0, 0, 0, 0, ""]
    bad = ops.with_columns(
        pl.when(pl.col("node_id") == call.unit.node_id)
        .then(pl.lit(orjson.dumps(types).decode()))
        .otherwise(pl.col("output_types"))
        .alias("output_types"),
        pl.when(pl.col("node_id") == call.unit.node_id)
        .then(pl.lit(orjson.dumps(vals).decode()))
        .otherwise(pl.col("outputs"))
        .alias("outputs"),
    )
    units, skipped = select_units(bad, comm)
    rebuilt = build_program(units, bad, device=_cpu, skipped=skipped).calls[call.unit.index]
    assert len(rebuilt.outputs) == len(call.outputs) - 1
    last = len(vals[j]) - 1
    assert (j, last) not in {(jj, i) for jj, i, _, _ in rebuilt.outputs}
