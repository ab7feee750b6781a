"""Declared and inferred layouts, recordings of one rank per TP/CP group, partial recordings.

Inputs are written to tmp dirs from the shared traces and the bundled sample: the ST op timeline
with ``tp_size: 2`` or ``dsp_size: 2`` in its meta (ranks renumbered as a recording of one rank
per TP/CP group would have them), the sample without its TP peers' files, the sample's TP pair
showing only the default group, and two DLRM ranks of eight.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import yaml
from click.testing import CliRunner
from prism_trace.datasets.variants import kineto_variant
from prism_trace.replay import CompletionConfig, EmulationConfig, emulate_run
from prism_trace.replay.des.core import MissingParticipantError
from prism_trace.replay.validate.emulated import validate_run

from prism_trace.cli import main
from prism_trace.errors import PrismError
from prism_trace.graph.build import build_graph
from prism_trace.graph.matching import match_comms
from prism_trace.graph.set_up import set_up_graph
from prism_trace.ingestion.pipeline import ingest
from prism_trace.layout.choice import choose_layout
from prism_trace.layout.declare import declare_layout
from prism_trace.layout.mesh import LayoutError, ParallelLayout
from prism_trace.layout.symmetry import missing_ranks, ranges, symmetric_partners
from prism_trace.query.info import describe_run
from prism_trace.slicing.plan import SliceError
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store, open_store
from tests.conftest import store_contents

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"


def _st_variant(shared: Path, out: Path, key: str, *, global_ranks: bool = False) -> Path:
    """ST with ``key: 2`` in its meta; its ranks stay the cell indices 0..7 (the reader
    renumbers them) unless ``global_ranks``, which writes them as global ranks 0, 2, .., 14."""
    src = shared / "megatron-straggler-st-8rank"
    out.mkdir(parents=True)
    df = pl.read_parquet(src / "trace-ST.parquet")
    if global_ranks:
        df = df.with_columns(pl.col("rank") * 2)
    df.write_parquet(out / "trace-ST.parquet")
    meta = yaml.safe_load((src / "meta-ST.yaml").read_text())
    meta.update({key: 2, "world_size": 16})
    (out / "meta-ST.yaml").write_text(yaml.safe_dump(meta))
    shutil.copy(src / "result-ST.json", out / "result-ST.json")
    return out


def _store(tmp: Path, name: str, paths: list[Path]) -> Store:
    store = open_store(tmp / f"{name}.duckdb")
    ingest(store, paths, run=name, progress=False)
    return store


def test_symmetric_partners_and_ranges() -> None:
    layout = ParallelLayout.parse("tp=2,dp=2,pp=2")
    copies, partners = symmetric_partners(layout, [0, 2, 4])
    assert copies.tolist() == [1, 3, 5]
    assert partners.tolist() == [0, 2, 4]
    assert symmetric_partners(ParallelLayout.parse("dp=4"), [0])[0].size == 0
    assert ranges([1, 2, 3, 7, 9, 10]) == "1..3, 7, 9..10"
    assert missing_ranks(8, [0, 2, 4], layout) == (
        "3 of 8 ranks recorded; 3 TP/CP peers run as copies of a recorded partner;"
        " not recorded: 6..7 (2 ranks)"
    )


@pytest.mark.parametrize(
    ("key", "spec", "global_ranks"),
    [("tp_size", "tp=2", False), ("dsp_size", "cp=2", False), ("tp_size", "tp=2", True)],
)
def test_st_one_rank_per_group(
    tmp_path: Path, shared_datasets: Path, key: str, spec: str, global_ranks: bool
) -> None:
    src = _st_variant(shared_datasets, tmp_path / "in", key, global_ranks=global_ranks)
    store = _store(tmp_path, "st", [src])
    assert store.con.execute("SELECT list(rank ORDER BY rank) FROM rank").fetchall() == [
        (list(range(0, 16, 2)),)
    ]
    choice = choose_layout(store, "st")
    assert choice.layout == ParallelLayout.parse(f"{spec},dp=2,pp=4")
    assert any(r.startswith(spec) for r in choice.reasons)
    report = validate_run(store, run="st")
    assert report.replay_iteration_time_error_pct is not None
    assert report.replay_iteration_time_error_pct < 0.1
    assert report.slice is not None
    assert any("8 unrecorded ranks are TP/CP peers" in n for n in report.notes)
    # Scaling dp, which the recording has, still works; the copies come along.
    big = ParallelLayout.parse(f"{spec},dp=4,pp=4")
    sliced = slice_run(store, run="st", layout=big, world=32, out_run="big")
    assert len(sliced.classes) == 8
    assert sum(c.symmetric for c in sliced.classes) == 4
    emulated = emulate_run(store, run="big", out_run="big-e")
    assert emulated.world_size == 32
    # The recording itself emulates without flags: its TP/CP peers are copies.
    own = emulate_run(store, run="st", out_run="st-e")
    ranks = store.con.execute(
        "SELECT count(DISTINCT rank) FROM iteration WHERE run_id = ?", [own.run_id]
    ).fetchall()
    assert ranks == [(16,)]
    assert any("8 unrecorded ranks run as copies" in n for n in own.notes)


@pytest.mark.slow
def test_sample_without_tp_peers(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    for r in (0, 2, 4, 6):
        for kind in ("kineto", "et"):
            shutil.copy(SAMPLE / f"rank{r}.{kind}.json.gz", src)
    store = _store(tmp_path, "s", [src])
    build_graph(store, "s")
    copies = symmetric_partners(ParallelLayout.parse("tp=2,dp=2,pp=2"), [0, 2, 4, 6])[0]
    match = match_comms(store, "s", copies=copies.tolist())
    assert match.complete < match.instances == match.complete_with_copies
    assert match.mixed == 0
    report = validate_run(store, run="s")
    assert report.replay_iteration_time_error_pct is not None
    assert report.replay_iteration_time_error_pct < 0.1
    # A representative of another TP coordinate is allowed, and the mapping report says so.
    sliced = slice_run(
        store,
        run="s",
        layout=ParallelLayout.parse("tp=2,dp=4,pp=2"),
        world=16,
        from_ranks=[0, 4],
        out_run="x",
    )
    assert sliced.mapping == {0: "0..6 step 2; 1..7 step 2", 4: "8..14 step 2; 9..15 step 2"}
    assert any("rank 0 stands in for tp=1" in n for n in sliced.notes)
    assert "note: rank 0 stands in" in sliced.summary()


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample's TP pair (ranks 0 and 1) as a 2-rank job showing only the default group."""
    out = tmp_path_factory.mktemp("tp-pair")
    for r in (0, 1):
        kineto_variant(
            SAMPLE / f"rank{r}.kineto.json.gz",
            out / f"rank{r}.kineto.json.gz",
            drop=r"^(prism_comm:pg=(?!1;)|record_param_comms$)",  # the TP group's calls only
            only_default_group=True,
            world_size=2,
        )
    return out


def test_default_group_only_is_read_from_when_its_collectives_run(
    tp_pair: Path, tmp_path: Path
) -> None:
    store = _store(tmp_path, "pair", [tp_pair])
    choice = choose_layout(store, "pair")
    assert choice.source == "inferred"
    assert choice.layout == ParallelLayout.parse("tp=2")
    assert choice.ambiguous is not None
    assert "inside the forward compute" in choice.reasons[0]


def test_declared_layout_from_ingest_to_validate(tp_pair: Path, tmp_path: Path) -> None:
    db = tmp_path / "d.duckdb"
    res = CliRunner().invoke(
        main, ["ingest", str(tp_pair), "--db", str(db), "--run", "pair", "-q", "--layout", "dp=2"]
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["graph", str(db), "--run", "pair", "--layout", "tp=2"])
    assert res.exit_code == 0, res.output
    assert "declared" in res.output
    with open_store(db) as store:
        info = describe_run(store, "pair")
        assert info["layout"]["source"] == "declared"
        assert info["layout"]["spec"] == "tp=2,cp=1,ep=1,dp=1,pp=1"
        axes = store.con.execute("SELECT DISTINCT axis FROM comm_group").fetchall()
        assert axes == [("tp",)]  # the default group of a tp-only job is its TP group
        refused = r"^axis `dp`: the recording .* no matched data-parallel.*two data-parallel"
        with pytest.raises(SliceError, match=refused):
            slice_run(
                store, run="pair", layout=ParallelLayout.parse("tp=2,dp=4"), world=8, out_run="b"
            )
        with pytest.raises(SliceError, match="axis `tp` differs"):
            slice_run(store, run="pair", layout=ParallelLayout.parse("dp=2"), world=2, out_run="b")
        report = validate_run(store, run="pair")
        assert report.layout == "tp=2,cp=1,ep=1,dp=1,pp=1"
        assert report.replay_iteration_time_error_pct is not None
        assert report.replay_iteration_time_error_pct < 0.1
        assert report.slice_iteration_time_error_pct is not None


def test_declared_layout_is_checked(tp_pair: Path, tmp_path: Path) -> None:
    store = _store(tmp_path, "pair", [tp_pair])
    with pytest.raises(LayoutError, match="records a world of 2"):
        declare_layout(store, "pair", ParallelLayout.parse("tp=1"))
    # A larger layout: the recording holds some ranks of it; the default group widens with it.
    declare_layout(store, "pair", ParallelLayout.parse("tp=4"))
    ((world, ranks),) = store.con.execute(
        "SELECT r.world_size, g.ranks FROM run r JOIN comm_group g USING (run_id)"
    ).fetchall()
    assert (world, ranks) == (4, [0, 1, 2, 3])
    config = json.loads(store.con.execute("SELECT config_json FROM run").fetchall()[0][0])
    assert config["layout"]["source"] == "declared"
    # Corrected back: the world the trace recorded is the floor, not the widened one.
    declare_layout(store, "pair", ParallelLayout.parse("tp=2"))
    assert store.con.execute("SELECT world_size FROM run").fetchall() == [(2,)]


def _without_timelines(tmp_path: Path) -> Path:
    """A recorded dp=2 x pp=2 run `h` (rank = dp + 2 pp) with its groups but no events: its
    layout can be declared, its graph cannot be built."""
    db = tmp_path / "h.duckdb"
    with open_store(db) as s, s.transaction() as con:
        con.execute(
            "INSERT INTO run (run_id, name, kind, world_size, config_json)"
            " VALUES (1, 'h', 'recorded', 4, '{}')"
        )
        con.executemany("INSERT INTO rank (run_id, rank) VALUES (1, ?)", [[r] for r in range(4)])
        groups = [("default_pg", [0, 1, 2, 3]), ("dp", [0, 1]), ("dp", [2, 3]), ("pp", [0, 2])]
        con.executemany(
            "INSERT INTO comm_group (run_id, group_id, name, description, size, ranks)"
            " VALUES (1, ?, ?, ?, ?, ?)",
            [[g, str(g), d, len(r), r] for g, (d, r) in enumerate(groups)],
        )
    return db


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("dp=2,pp=2", r"rank 0 has no timeline"),  # declared, then the graph fails
        ("dp=4,pp=2", r"declared layout .* does not fit"),
        ("dp=2", r"records a world of 4"),
    ],
)
def test_a_refused_graph_command_leaves_every_row(tmp_path: Path, spec: str, error: str) -> None:
    """`prism graph` is one transaction: a declared layout is taken back with the graph."""
    db = _without_timelines(tmp_path)
    with open_store(db) as store:
        before = store_contents(store)
        with pytest.raises(PrismError, match=error):
            set_up_graph(store, "h", declared=ParallelLayout.parse(spec))
        assert store_contents(store) == before
    res = CliRunner().invoke(main, ["graph", str(db), "--run", "h", "--layout", spec])
    assert res.exit_code != 0
    with open_store(db) as store:
        assert store_contents(store) == before


@pytest.mark.slow
def test_two_of_eight_ranks(tmp_path: Path, shared_datasets: Path) -> None:
    src = sorted((shared_datasets / "param-dlrm-8rank" / "kineto").glob("*.json.gz"))[:2]
    for i, f in enumerate(src):
        kineto_variant(f, tmp_path / "in" / f"rank{i}.json.gz", strip_comm_args=True)
    store = _store(tmp_path, "d2", [tmp_path / "in"])
    with pytest.raises(MissingParticipantError):
        emulate_run(store, run="d2", out_run="e")
    config = EmulationConfig(completion=CompletionConfig(allow_partial=True))
    report = emulate_run(store, run="d2", out_run="e", config=config)
    assert any("not recorded: 2..7 (6 ranks)" in n for n in report.notes)
    res = CliRunner().invoke(
        main, ["emulate", str(tmp_path / "d2.duckdb"), "--run", "d2", "--out-run", "f", "--partial"]
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["graph", str(tmp_path / "d2.duckdb"), "--run", "d2"])
    assert "partial recording: 2 of 8 ranks recorded; not recorded: 2..7" in res.output
    # The emulated partial run reports like any other, next to its recording.
    store.close()
    html = tmp_path / "f.html"
    res = CliRunner().invoke(
        main, ["report", str(tmp_path / "d2.duckdb"), "--run", "f", "--compare", "d2", "-o", html]
    )
    assert res.exit_code == 0, res.output
    assert html.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("description", "axis"),
    [
        ("TENSOR_MODEL_PARALLEL_GROUP", "tp"),
        ("DATA_PARALLEL_GROUP_WITH_CP", "dp-cp"),
        ("TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "tp-dp-cp"),
        ("EXPERT_DATA_PARALLEL_GROUP", "dp"),
        ("POSITION_EMBEDDING_GROUP", None),
        ("mesh_tp", "tp"),
        ("mesh_dp_shard", "dp"),
        ("mesh_dp_shard_cp", "dp-cp"),
        ("mesh_dp_replicate", None),
        ("sequence_parallel", "cp"),
        ("sequence_data_parallel", "dp-cp"),
        ("default_pg", "world"),
        ("undefined", None),
    ],
)
def test_group_descriptions_of_other_frameworks(description: str, axis: str | None) -> None:
    from prism_trace.layout.roles import described_axis

    assert described_axis(description) == axis
