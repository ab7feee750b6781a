"""A real CUDA trace (one rank on an H200, tests/data/h200-1rank) read on a machine without one.

It ingests with its device side, its ops rebuild for the CPU except the CUDA-only kernel, it
slices to any dp from its one-member dp group, and a CUDA replay would hold its two threads'
cuBLAS workspaces: each a bug or a refusal before the first GPU run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prism_trace.replay.hybrid.blas import blas_threads

from prism_trace.graph.build import build_graph
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store
from tests.conftest import ingest_runs

H200 = Path(__file__).resolve().parents[1] / "data" / "h200-1rank"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    s: Store = ingest_runs(tmp_path_factory.mktemp("h200") / "h.duckdb", {"h200": [H200]})  # type: ignore[assignment]
    build_graph(s, "h200")
    return s


def _ops(store: Store) -> object:
    return store.con.sql(
        "SELECT o.*, e.iteration FROM et_op o LEFT JOIN event e USING (run_id, rank, event_id)"
        " WHERE o.rank = 0"
    ).pl()


def test_its_device_side_and_collectives_are_read(store: Store) -> None:
    count = dict(store.con.execute("SELECT category, count(*) FROM event GROUP BY 1").fetchall())
    assert count["kernel"] > 1000
    assert count["cuda_runtime"] > 1000
    assert count["gpu_user_annotation"] > 0
    ((kinds,),) = store.con.execute(
        "SELECT list(DISTINCT kind ORDER BY kind) FROM collective"
    ).fetchall()
    assert kinds == ["all_reduce"]
    ((peak,),) = store.con.execute(
        "SELECT max(total_allocated) FROM memory WHERE device_type = 'cuda'"
    ).fetchall()
    assert peak == 519864832  # run.json's cuda_max_allocated_bytes


def test_its_ops_rebuild_for_the_cpu_but_the_cuda_only_kernel(store: Store) -> None:
    torch = pytest.importorskip("torch")
    from prism_trace.replay.kernels.codegen import check_program
    from prism_trace.replay.kernels.rebuild import build_program, make_externals
    from prism_trace.replay.kernels.units import select_units

    comm = {
        e
        for (e,) in store.con.execute(
            "SELECT event_id FROM graph_node WHERE rank = 0"
            " AND kind IN ('collective', 'send', 'recv')"
        ).fetchall()
    }
    ops = _ops(store)
    units, skipped = select_units(ops, comm)

    def cpu(_: str) -> object:
        return torch.device("cpu")

    program = build_program(units, ops, device=cpu, skipped=skipped)
    assert program.unsupported_ops() == []  # the undefined bias gradient is no result
    with torch.no_grad():
        bad = check_program(program, make_externals(program, cpu), cpu)
    reasons = {program.units[k].name for k in bad}
    assert reasons == {"aten::_scaled_dot_product_efficient_attention_backward"}


def test_a_cuda_replay_holds_both_threads_workspaces(store: Store) -> None:
    assert blas_threads(_ops(store)) == [  # type: ignore[arg-type]
        [("aten::mm", "float32")],  # the backward's thread, the busiest
        [("aten::addmm", "float32"), ("aten::mm", "float32")],  # the forward's
    ]


def test_one_rank_slices_to_any_dp(store: Store) -> None:
    report = slice_run(
        store, run="h200", layout=ParallelLayout.parse("dp=64"), world=64, out_run="dp64"
    )
    assert report.dp_from_one_member
    ((size,),) = store.con.execute(
        "SELECT max(size) FROM comm_group WHERE run_id = ? AND axis = 'dp'",
        [store.require_run("dp64")],
    ).fetchall()
    assert size == 64
    # Said again wherever the slice is emulated (its config keeps it).
    from prism_trace.replay.emulate.driver import emulate_run

    rep = emulate_run(store, run="dp64", out_run="e64")
    assert [n for n in rep.notes if n.startswith("dp=64 grows from the recording's one-member")]


def test_a_one_rank_job_without_reductions_stays_refused(tmp_path: Path) -> None:
    """Broadcasts or barriers on a one-member group are no gradient reductions: nothing to build
    a larger dp's from."""
    from prism_trace.slicing.plan import SliceError

    s: Store = ingest_runs(tmp_path / "b.duckdb", {"h200": [H200]})  # type: ignore[assignment]
    s.con.execute("UPDATE collective SET kind = 'broadcast'")
    with pytest.raises(SliceError, match="no matched data-parallel communication"):
        slice_run(s, run="h200", layout=ParallelLayout.parse("dp=4"), world=4, out_run="dp4")


@pytest.mark.parametrize(
    ("description", "sliced"),
    [
        ("default_pg", True),  # DDP at world size 1: the default group
        (None, True),  # an older trace without group descriptions
        ("mesh_dp", True),  # torchtitan
        ("DATA_PARALLEL_GROUP", True),  # Megatron
        ("dp_cp", True),
        ("tp", False),
        ("pp", False),
    ],
)
def test_other_frameworks_group_names(
    tmp_path: Path, description: str | None, sliced: bool
) -> None:
    """The reductions' group as other frameworks (or none) name it: a data-parallel or default
    group of one rank grows to dp 4; a group named for another axis does not."""
    from prism_trace.slicing.plan import SliceError

    s: Store = ingest_runs(tmp_path / "n.duckdb", {"h200": [H200]})  # type: ignore[assignment]
    s.con.execute(
        "UPDATE comm_group SET description = ?"
        " WHERE group_id IN (SELECT DISTINCT group_id FROM collective)",
        [description],
    )
    layout = ParallelLayout.parse("dp=4")
    if sliced:
        assert slice_run(s, run="h200", layout=layout, world=4, out_run="dp4").dp_from_one_member
    else:
        with pytest.raises(SliceError, match="no matched data-parallel communication"):
            slice_run(s, run="h200", layout=layout, world=4, out_run="dp4")
