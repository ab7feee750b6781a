"""Bad options of `prism emulate` and `prism replay` are one line, exit 1, and change nothing.

Each case here was accepted (or crashed, or ran for ever) before: a what-if that took the world
past MAX_RANKS allocated until it was killed, an infinite or huge slow-down wrapped the int64
durations to -2**63, a glob that matched nothing or a bogus node kind gave the baseline as the
result, a repeated what-if silently took the last value, negative seeds and out-of-world ranks
were accepted, and `--iterations 1000000000` replayed for ever.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from tests.conftest import db_contents


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> Path:
    """The sample with its graph and `s16`, its slice to tp=2,dp=4,pp=2 (16 ranks), closed."""
    from prism_trace.graph.build import build_graph
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import open_store

    path = tmp_path_factory.mktemp("bad_options") / "job.duckdb"
    shutil.copyfile(sample_template, path)
    with open_store(path) as store:
        build_graph(store, "sample")
        layout = ParallelLayout.parse("tp=2,dp=4,pp=2")
        slice_run(store, run="sample", layout=layout, world=16, out_run="s16")
    return path


def _runs(db: Path) -> list[tuple[object, ...]]:
    """Every run of the store with its size: what a refused command must leave as it was."""
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(
            "SELECT r.run_id, r.name, r.kind, (SELECT count(*) FROM event e"
            " WHERE e.run_id = r.run_id) FROM run r ORDER BY r.run_id"
        ).fetchall()


def _refused(db: Path, args: list[str], needle: str) -> str:
    """Run the CLI on ``db``; check one `error:` line naming ``needle``, exit 1, no change."""
    before = _runs(db)
    res = CliRunner().invoke(main, [args[0], str(db), *args[1:]])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert lines[0].startswith("error: "), res.output
    assert "unexpected" not in lines[0]
    assert needle in lines[0], lines[0]
    assert _runs(db) == before
    return lines[0]


def _emulate(*extra: str) -> list[str]:
    return ["emulate", "--run", "s16", "--out-run", "x", *extra]


@pytest.mark.parametrize(
    ("what_if", "needle"),
    [
        ("dp=99999999", "dp must be >= 1 and <= 1048576"),
        ("dp=262145", "past the limit of 1048576"),  # 4 ranks per replica x 262145
        ("slow-ranks=0..3@inf", "slow-down factor"),
        ("slow-ranks=0..3@1e400", "slow-down factor"),
        ("slow-ranks=0..3@1e300", "slow-down factor"),
        ("slow-ranks=0..3@1e12", "slow-down factor"),
        ("slow-ops=*@inf", "slow-down factor"),
        ("slow-ranks=0..99999999999@2", "outside [0, 1048576)"),
        ("slow-ranks=5..3@2", "is empty"),
        ("slow-kind=bogus@2", "'bogus' is not a node kind"),
        ("slow-ops=[@2", "malformed"),
        ("slow-ops=nomatch@2", "matches no node of run 's16'"),
        ("slow-kind=memset@2", "matches no node of run 's16'"),
        ("bandwidth=inf", "bandwidth scale"),
        ("bandwidth=1e-300", "bandwidth scale"),
    ],
)
def test_a_bad_what_if_is_refused(db: Path, what_if: str, needle: str) -> None:
    _refused(db, _emulate("--what-if", what_if), needle)


def test_slow_downs_that_multiply_past_the_bound_are_refused(db: Path) -> None:
    args = _emulate("--what-if", "slow-ranks=0@1e3", "--what-if", "slow-ops=*@1e4")
    _refused(db, args, "multiply to 1e+07")


@pytest.mark.parametrize(
    "words", [("dp=2", "dp=8"), ("bandwidth=0.5", "bandwidth=2"), ("variance", "variance=op")]
)
def test_the_same_what_if_twice_with_different_values_is_refused(
    db: Path, words: tuple[str, str]
) -> None:
    args = _emulate("--what-if", words[0], "--what-if", words[1])
    _refused(db, args, f"what-if {words[1]!r} contradicts an earlier one")


@pytest.mark.parametrize(
    "extra",
    [("--seed", "-1"), ("--seed", "-1", "--what-if", "variance"), ("--seed", str(1 << 63))],
)
def test_a_seed_outside_int64_or_negative_is_refused(db: Path, extra: tuple[str, ...]) -> None:
    _refused(db, _emulate(*extra), "seed must be a whole number in [0, 2**63 - 1]")


def test_keep_events_outside_the_world_is_refused(db: Path) -> None:
    _refused(db, _emulate("--keep-events", "999"), "keep_events rank 999 is outside the world")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('what_if = "bandwidth=0.5"\n', "what_if must be a list of strings"),
        ("seed = -1\n", "seed must be a whole number"),
        ("keep_events = [-1]\n", "keep_events rank -1 is outside"),
        ("keep_events = [99]\n", "keep_events rank 99 is outside the world of 16 ranks"),
        ("[timing]\nchunks = 1000000000\n", "`chunks` must be a whole number in [1, 1024]"),
        ("[topology]\nbandwidth_scale = 1e-300\n", "`bandwidth_scale` must be in"),
        (  # 1e-300 GB/s: the modelled transfers wrapped to -2**63 and the iterations shrank
            '[timing]\nmodel = "alpha_beta"\n[topology]\nintra_node_gbps = 1e-300\n'
            "inter_node_gbps = 1e-300\n",
            "the network model gives a transfer of",
        ),
    ],
)
def test_a_bad_config_file_is_refused(db: Path, tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    _refused(db, _emulate("--config", str(cfg)), needle)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--iterations", "1000000000"), "iterations must be a whole number in [1, 1000]"),
        (("--warmup", "-1"), "warmup must be a whole number in [0, 1000]"),
        (("--threads", "0"), "threads must be a whole number in [1, 4096]"),
    ],
)
def test_a_bad_replay_option_is_refused(db: Path, extra: tuple[str, ...], needle: str) -> None:
    args = ["replay", "--run", "s16", "--ranks", "0", "--out-run", "r", *extra]
    _refused(db, args, needle)


def test_a_bad_replay_config_is_refused(db: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "r.toml"
    cfg.write_text("[kernel_replay]\niterations = 1000000000\nseed = -1\n")
    args = ["replay", "--run", "s16", "--ranks", "0", "--out-run", "r", "--config", str(cfg)]
    _refused(db, args, "[kernel_replay]: iterations must be a whole number in [1, 1000]")


def test_valid_what_ifs_still_run(db: Path) -> None:
    """A glob with stars inside (it crashed in polars' regex engine), the same what-if given
    twice with one value, and the largest allowed factor all emulate."""
    runner = CliRunner()
    for i, words in enumerate(
        [("slow-ops=*attention*@2",), ("dp=2", "dp=2"), ("slow-ranks=1@1e6",), ("variance",)]
    ):
        args = ["emulate", str(db), "--run", "s16", "--out-run", f"ok{i}"]
        args += [a for w in words for a in ("--what-if", w)]
        res = runner.invoke(main, args)
        assert res.exit_code == 0, res.output
    with duckdb.connect(str(db), read_only=True) as con:
        ((low,),) = con.execute(
            "SELECT min(e.dur) FROM event e JOIN run r USING (run_id) WHERE r.name LIKE 'ok%'"
        ).fetchall()
    assert low >= 0  # no duration wrapped to -2**63


@pytest.mark.parametrize(
    "extra", [("--keep-events", "99"), ("--what-if", "slow-ranks=99@2")], ids=["keep", "slow"]
)
def test_a_refused_emulate_builds_no_graph(
    tmp_path: Path, sample_template: Path, extra: tuple[str, ...]
) -> None:
    """A recorded run without a graph: the config's ranks are checked before the graph is
    built, so the refusal leaves the store as it was (the graph was written, then refused)."""
    path = tmp_path / "fresh.duckdb"
    shutil.copyfile(sample_template, path)
    with duckdb.connect(str(path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM graph_node").fetchall() == [(0,)]
    _refused(path, ["emulate", "--run", "sample", "--out-run", "e", *extra], "outside the world")
    with duckdb.connect(str(path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM graph_node").fetchall() == [(0,)]


def _refused_unchanged(db: Path, args: list[str], needle: str) -> None:
    """``_refused``, and every table's contents as they were."""
    before = db_contents(db)
    _refused(db, args, needle)
    after = db_contents(db)
    assert after.keys() == before.keys()
    for table, rows in before.items():
        assert after[table] == rows, f"{table} changed"


@pytest.mark.parametrize(
    ("what_ifs", "needle"),
    [
        (("slow-ops=nomatch@2",), "matches no node of run 'sample'"),
        (("dp=4", "slow-ops=nomatch@2"), "matches no node of run 'sample'"),
    ],
    ids=["after-graph", "after-graph-and-dp-reslice"],
)
def test_a_what_if_refused_after_loading_leaves_every_table_as_it_was(
    tmp_path: Path, sample_template: Path, what_ifs: tuple[str, ...], needle: str
) -> None:
    """A recorded run without a graph, and a what-if refused only once the run is loaded: the
    graph was built (and for dp=4 the run re-sliced, its layout's coordinates written) in the
    command's one transaction, which the refusal rolls back."""
    path = tmp_path / "fresh.duckdb"
    shutil.copyfile(sample_template, path)
    args = ["emulate", "--run", "sample", "--out-run", "e"]
    _refused_unchanged(path, args + [a for w in what_ifs for a in ("--what-if", w)], needle)
    assert db_contents(path)["graph_node"] == []


@pytest.mark.slow
def test_a_partial_recording_refused_leaves_every_table_as_it_was(tmp_path: Path) -> None:
    """Ranks 0 and 2 of the sample, without a graph: the graph is built, then the run stage
    finds a receive without its send; nothing of it stays."""
    from prism_trace.datasets import SAMPLE

    from tests.conftest import ingest_runs

    files = sorted(p for p in Path(SAMPLE).iterdir() if p.name.startswith(("rank0.", "rank2.")))
    path = tmp_path / "part.duckdb"
    ingest_runs(path, {"p": files}).close()  # type: ignore[attr-defined]
    args = ["emulate", "--run", "p", "--out-run", "e"]
    _refused_unchanged(path, args, "has no matching send")


def test_a_refused_emulate_of_a_slice_leaves_every_table_as_it_was(db: Path) -> None:
    """The dp what-if's re-slice of `s16`, then a what-if refused: no trace of either."""
    args = _emulate("--what-if", "dp=2", "--what-if", "slow-ops=nomatch@2")
    _refused_unchanged(db, args, "matches no node of run 's16'")


def test_the_dp_what_ifs_reslice_never_reaches_the_store(tmp_path: Path, db: Path) -> None:
    """A successful dp what-if writes its emulated run and nothing of the temporary re-slice:
    no run of that name, and no row of any table under a run id that is not a run's."""
    path = tmp_path / "dp.duckdb"
    shutil.copyfile(db, path)
    before = [name for _, name, _, _ in _runs(path)]
    res = CliRunner().invoke(
        main, ["emulate", str(path), "--run", "s16", "--out-run", "d", "--what-if", "dp=2"]
    )
    assert res.exit_code == 0, res.output
    with duckdb.connect(str(path), read_only=True) as con:
        names = [n for (n,) in con.execute("SELECT name FROM run ORDER BY run_id").fetchall()]
        assert names == [*before, "d"]
        ids = {i for (i,) in con.execute("SELECT run_id FROM run").fetchall()}
        tables = con.execute(
            "SELECT table_name FROM duckdb_columns() WHERE column_name = 'run_id'"
            " AND schema_name = 'main' AND table_name <> 'run'"
        ).fetchall()
        for (t,) in tables:
            found = {i for (i,) in con.execute(f'SELECT DISTINCT run_id FROM "{t}"').fetchall()}
            assert found <= ids, t


@pytest.mark.torch
def test_a_replay_refused_after_its_emulation_leaves_every_table_as_it_was(
    tmp_path: Path, sample_template: Path
) -> None:
    """`prism replay` of a recorded run without a graph: the virtual peers' emulation builds it,
    then the rank turns out not to be one of the run's; the command's one transaction undoes
    the graph too."""
    pytest.importorskip("torch")
    path = tmp_path / "fresh.duckdb"
    shutil.copyfile(sample_template, path)
    args = ["replay", "--run", "sample", "--ranks", "99", "--out-run", "r"]
    _refused_unchanged(path, args, "rank 99 is not a rank of run 'sample'")
