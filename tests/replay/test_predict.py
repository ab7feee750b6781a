"""`prism predict`: a small recording emulated at a larger one's scale and compared with it.

On a tiny wait-mode ladder recorded here (dp 2 and 4, pp 2): predicted from dp 2, the dp-4 job's
steps have the recording's ops, collectives, sizes and groups, and its peak memory. A prediction
leaves the store exactly as it was unless asked to keep its run; a refused one always does. And
`--replayed`: a replayed run of `prism run` against the recording of its world.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prism_trace.analysis.prediction.compare import RunComparison, compare_runs
from prism_trace.replay.predict.run import predict_run

from prism_trace.cli import main
from prism_trace.errors import DuplicateRunError, PrismError
from prism_trace.store.connection import Store, open_store
from tests.conftest import db_contents, store_contents


def _cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


# --- on the bundled sample: the refusals and --replayed (fast) -------------------------------


@pytest.fixture(scope="module")
def sample_db(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> Path:
    """The sample, its slice `s16` (tp=2,dp=4,pp=2) and `R`, a replayed run of ranks 0 and 1
    as `prism run --out-run` stores one (step times only)."""
    from prism_trace.replay.pg.launch import LaunchResult, RankResult
    from prism_trace.replay.pg.launched_run import write_launched_run

    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run

    path = tmp_path_factory.mktemp("predict") / "job.duckdb"
    shutil.copyfile(sample_template, path)
    with open_store(path) as store:
        slice_run(
            store, run="sample", layout=ParallelLayout.parse("tp=2,dp=4,pp=2"), world=16,
            out_run="s16",
        )  # fmt: skip
        steps = {1: (0, 300_000_000), 2: (310_000_000, 600_000_000)}
        result = LaunchResult(
            world_size=8,
            ranks=[RankResult(r, 0, {"step_ns": steps}) for r in (0, 1)],
            wall_s=1.0,
            run="sample",
        )
        write_launched_run(store, run="sample", out_run="R", result=result, command=["x"])
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run", "sample", "--against", "s16"], "--against 's16' is a sliced run"),
        (["--run", "sample", "--against", "sample"], "name the same run 'sample'"),
        (["--run", "s16", "--against", "sample"], "--run 's16' is a sliced run"),
        (["--run", "sample", "--against", "nope"], "no run named 'nope'"),
        (["--run", "sample", "--against", "R", "--seeds", "3"], "more only with --variance"),
        (["--run", "sample", "--against", "R", "--out-run", "sample"], "is an input run"),
        (["--against", "sample"], "give one of --run SMALL"),
        (["--run", "sample", "--replayed", "R", "--against", "sample"], "give one of --run"),
        (["--replayed", "R", "--against", "sample", "--variance", "op"], "go with --run"),
        (["--replayed", "R", "--against", "sample", "--network", "n.toml"], "go with --run"),
        (["--replayed", "s16", "--against", "sample"], "--replayed takes a replayed run"),
    ],
)
def test_a_refused_prediction_is_one_line_and_changes_nothing(
    sample_db: Path, args: list[str], message: str
) -> None:
    before = db_contents(sample_db)
    res = _cli("predict", sample_db, *args)
    assert res.exit_code != 0
    assert message in res.output, res.output
    assert res.output.count("\n") == 1, res.output
    assert db_contents(sample_db) == before


def test_a_replayed_run_is_compared_on_what_it_holds(sample_db: Path) -> None:
    res = _cli("predict", sample_db, "--replayed", "R", "--against", "sample", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["predicted"] == ["R"]
    assert d["predicted_kind"] == "replayed"
    s = d["step_time"]
    assert (s["iterations"], s["warmup"], s["ranks"]) == ([2], [1], 2)
    assert s["predicted_n"] == s["recorded_n"] == 2
    assert s["predicted_mean_ns"] == 290_000_000
    assert d["structure"]["classes"] == []
    assert "holds no ops" in " ".join(d["notes"])
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    assert all(r["comm_predicted_ns"] is None and r["peak_predicted"] is None for r in d["ranks"])
    assert all(r["peak_recorded"] for r in d["ranks"])
    text = _cli("predict", sample_db, "--replayed", "R", "--against", "sample").output
    assert "prediction 'R' (replayed) against the recording 'sample' (8 ranks)" in text


# --- on a tiny ladder recorded here (slow: ~30 s) --------------------------------------------


@pytest.fixture(scope="module")
def ladder_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dp-2 and a dp-4 recording of one wait-mode job (pp 2), as runs `dp2` and `dp4`."""
    pytest.importorskip("torch")
    return _record_ladder(tmp_path_factory.mktemp("ladder"), dp=(2, 4), pp=2)


def _record_ladder(
    root: Path, *, dp: tuple[int, ...], pp: int, extra: tuple[str, ...] = ()
) -> Path:
    """A tiny wait-mode ladder recorded into ``root`` and ingested as runs ``dp<N>``."""
    from tests.conftest import ingest_runs

    subprocess.run(
        [
            sys.executable,
            *("-m", "prism_trace.datasets.ladder", "--out", str(root / "rec")),
            *("--dp", ",".join(map(str, dp)), "--pp", str(pp), "--compute", "wait"),
            *("--steps", "2", "--wait-ms-per-layer", "1", "--no-et", *extra),
        ],
        check=True,
        capture_output=True,
    )
    runs = {f"dp{d}": [root / "rec" / f"tp1-dp{d}-pp{pp}-gpipe-wait-mb4-s2"] for d in dp}
    db = root / "ladder.duckdb"
    ingest_runs(db, runs).close()  # type: ignore[attr-defined]
    return db


@pytest.fixture
def ladder(ladder_db: Path, tmp_path: Path) -> Store:
    """A writable copy of the ladder's store, for one test."""
    copy = tmp_path / "ladder.duckdb"
    shutil.copyfile(ladder_db, copy)
    return open_store(copy)


@pytest.mark.slow
@pytest.mark.torch
def test_the_predicted_dp4_step_is_the_recorded_one(ladder: Store) -> None:
    before = store_contents(ladder)
    p = predict_run(ladder, run="dp2", against="dp4", compare=compare_runs)
    assert store_contents(ladder) == before  # nothing kept: not a graph, not a run id
    assert (p.layout, p.world_size, p.kept) == ("tp=1,cp=1,ep=1,dp=4,pp=2", 8, None)
    c: RunComparison = p.comparison
    st = c.structure
    assert st.ops_compared
    assert st.differences == {"collectives": 0, "p2p": 0, "ops": 0, "classes": 0}, st.as_dict()
    assert [k.label for k in st.classes] == ["pp=0", "pp=1"]
    assert all(k.counts[s][0] > 0 for k in st.classes for s in ("ops", "collectives", "p2p"))
    assert len(c.ranks) == 8
    assert all(r.peak_error_pct is not None for r in c.ranks)  # memory on both sides
    assert c.steps.predicted_n == c.steps.recorded_n == 8
    assert c.steps.ks_d is not None
    # The memory each predicted rank allocates in a step is the recording's, byte for byte. (Its
    # peak also depends on when gloo's worker thread frees a bucket, which a loaded host moves
    # between recordings; benchmarks/bench_predict.py measures peaks on a quiet host.)
    predict_run(ladder, run="dp2", against="dp4", compare=compare_runs, out_run="kept")
    per_step = (
        "SELECT rank, iteration, sum(bytes) FILTER (WHERE bytes > 0) FROM memory"
        " WHERE run_id = ? AND iteration IS NOT NULL GROUP BY ALL ORDER BY ALL"
    )
    kept, dp4 = (
        ladder.con.execute(per_step, [ladder.require_run(r)]).fetchall() for r in ("kept", "dp4")
    )
    # The emulated run holds its class exemplars' memory (ranks 0 and 4, one a stage); every
    # recorded rank of the stage (dp 4 x pp 2: ranks 0-3 and 4-7) allocates the same.
    assert sorted({r for r, _, _ in kept}) == [0, 4]
    for rank, it, allocated in dp4:
        assert (rank // 4 * 4, it, allocated) in kept, (rank, it, allocated)


@pytest.mark.slow
@pytest.mark.torch
def test_out_run_keeps_the_first_seed_and_nothing_else(ladder: Store) -> None:
    runs_before = ladder.con.execute("SELECT name FROM run ORDER BY ALL").fetchall()
    p = predict_run(
        ladder,
        run="dp2",
        against="dp4",
        compare=compare_runs,
        variance="op",
        seeds=2,
        out_run="p4",
    )
    assert p.runs[0] == "p4"
    assert len(p.runs) == 2
    assert len(p.comparison.steps.warmup) == 1
    assert p.comparison.steps.predicted_n == 2 * p.comparison.steps.recorded_n
    rows = ladder.con.execute(
        "SELECT r.name, r.kind, p.name, json_extract(r.config_json, '$.config.what_if.dp')::INT,"
        " json_extract(r.config_json, '$.config.what_if.variance')::BOOLEAN"
        " FROM run r LEFT JOIN run p ON p.run_id = r.parent_run_id ORDER BY r.run_id"
    ).fetchall()
    assert [r[0] for r in rows] == [n for (n,) in runs_before] + ["p4"]
    assert rows[-1][1:] == ("emulated", "dp2", 4, True)
    # The kept run is what `prism report --compare` compares: the same structure.
    again = compare_runs(ladder, "p4", "dp4")
    assert again.structure.differences == p.comparison.structure.differences
    before = store_contents(ladder)
    with pytest.raises(DuplicateRunError):
        predict_run(ladder, run="dp2", against="dp4", compare=compare_runs, out_run="p4")
    assert store_contents(ladder) == before


@pytest.mark.slow
@pytest.mark.torch
def test_a_prediction_refused_halfway_writes_nothing(ladder: Store) -> None:
    """Emulated and compared, then the comparison refuses: the emulated runs, the graphs built
    for the recordings and the run ids all go."""

    def refuse(store: Store, runs: list[str], against: str) -> RunComparison:
        assert store.run_id(runs[0]) is not None
        msg = "refused after the emulation"
        raise PrismError(msg)

    before = store_contents(ladder)
    with pytest.raises(PrismError, match="refused after the emulation"):
        predict_run(ladder, run="dp2", against="dp4", compare=refuse, out_run="kept")
    assert store_contents(ladder) == before


@pytest.mark.slow
@pytest.mark.torch
def test_the_cli_prints_the_comparison_and_its_json(ladder: Store) -> None:
    db = ladder.path
    ladder.close()
    before = db_contents(db)
    res = _cli("predict", db, "--run", "dp2", "--against", "dp4", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["comparison"]["structure"]["differences"] == {
        "collectives": 0,
        "p2p": 0,
        "ops": 0,
        "classes": 0,
    }
    assert {"step_time", "waits", "ranks", "rank_errors"} <= set(d["comparison"])
    text = _cli("predict", db, "--run", "dp2", "--against", "dp4").output
    assert "predicted 'dp4' (8 ranks, tp=1,cp=1,ep=1,dp=4,pp=2) from 'dp2'" in text
    assert "0 differences" in text
    assert db_contents(db) == before
    res = _cli("predict", db, "--run", "dp2", "--against", "dp4", "--out-run", "p4")
    assert res.exit_code == 0, res.output
    out = db.with_name("r.html")
    res = _cli("report", db, "--run", "p4", "--compare", "dp4", "-o", out)
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "<section id='prediction'>" in page
    assert "Structure of step" in page


@pytest.mark.slow
@pytest.mark.torch
def test_the_prediction_takes_the_emulations_network_and_config(
    ladder: Store, tmp_path: Path
) -> None:
    """A fitted network (`--network`) and the emulation's sections (`--config`) are the
    prediction's too: priced by the pure model on a slow network the step is longer, and the
    kept run's config says which network."""
    from prism_trace.replay.network.io import write_network_file
    from prism_trace.replay.network.model import NetworkModel

    db = ladder.path
    ladder.close()
    net = write_network_file(NetworkModel(intra_gbps=0.01, inter_gbps=0.01), tmp_path / "n.toml")
    cfg = tmp_path / "job.toml"
    cfg.write_text('[timing]\nmodel = "alpha_beta"\n')

    def mean(*extra: object) -> float:
        res = _cli("predict", db, "--run", "dp2", "--against", "dp4", "--json", *extra)
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["comparison"]["step_time"]["predicted_mean_ns"]

    assert mean("--config", cfg, "--network", net) > 1.2 * mean()
    res = _cli(
        "predict", db, "--run", "dp2", "--against", "dp4", "--network", net, "--out-run", "p"
    )
    assert res.exit_code == 0, res.output
    info = _cli("info", db, "--run", "p", "--config")
    assert "[network]\nintra_gbps = 0.01\ninter_gbps = 0.01\n" in info.output


def test_seeds_without_variance_are_refused_by_the_api(sample_db: Path) -> None:
    with open_store(sample_db) as store, pytest.raises(PrismError, match="--variance"):
        predict_run(store, run="sample", against="R", compare=compare_runs, seeds=2)
    with (
        open_store(sample_db, read_only=True) as store,
        pytest.raises(PrismError, match="open the store writable"),
    ):
        predict_run(store, run="sample", against="R", compare=compare_runs)


def test_peak_errors_count_the_ranks_within_the_bound() -> None:
    """The largest peak error alone hides whether one rank misses or all do: the summary also
    counts the ranks within issue 30's 0.5 % (ranks without memory rows not counted)."""
    from prism_trace.analysis.prediction.ranks import RankFigures, summary_errors

    def rank(r: int, predicted: float | None, recorded: float | None) -> RankFigures:
        return RankFigures(r, 1.0, 1.0, 0.0, 0.0, predicted, recorded)

    e = summary_errors(
        [rank(0, 1000, 1000), rank(1, 1004, 1000), rank(2, 1006, 1000), rank(3, None, None)]
    )
    assert (e["peak_ranks"], e["peak_ranks_within_target"]) == (3, 2)
    assert e["peak_max_abs_error_pct"] == 0.6


# --- from one replica: a dp=1 recording whose gradients go through a one-member group --------


@pytest.mark.slow
@pytest.mark.torch
def test_a_one_replica_recording_predicts_the_structure_and_memory_of_dp4(
    tmp_path: Path,
) -> None:
    """A single-GPU trace of a DP job (DDP at world size 1, Megatron's dp=1 group; here the
    generator's `--dp-sync-always`): its one-member all-reduces are every dp's gradient
    reductions, so dp 4 is built from it, op for op, and each rank's peak is the recording's.
    Step time is not claimed: the all-reduce's transfer at 4 members comes from the network
    model alone (nothing recorded to scale), and the slice says so."""
    pytest.importorskip("torch")
    db = _record_ladder(tmp_path, dp=(1, 4), pp=1, extra=("--dp-sync-always",))
    with open_store(db) as store:
        p = predict_run(store, run="dp1", against="dp4", compare=compare_runs, out_run="kept")
        st = p.comparison.structure
        assert p.layout == "tp=1,cp=1,ep=1,dp=4,pp=1"
        (note,) = p.notes  # the slice's, repeated: what the prediction cannot know
        assert note.startswith("dp=4 grows from the recording's one-member data-parallel calls")
        assert st.differences == {"collectives": 0, "p2p": 0, "ops": 0, "classes": 0}, st.as_dict()
        assert all(k.counts["collectives"][0] > 0 for k in st.classes)
        assert all(r.peak_error_pct is not None for r in p.comparison.ranks)
        # What each rank allocates in a step is the recording's, byte for byte (its peak also
        # depends on when gloo's worker thread frees a bucket, which a loaded host moves).
        per_step = (
            "SELECT iteration, sum(bytes) FILTER (WHERE bytes > 0) FROM memory"
            " WHERE run_id = ? AND rank = ? AND iteration IS NOT NULL GROUP BY ALL ORDER BY ALL"
        )
        kept = store.con.execute(per_step, [store.require_run("kept"), 0]).fetchall()
        assert kept
        for rank in range(4):
            assert store.con.execute(per_step, [store.require_run("dp4"), rank]).fetchall() == kept
    res = _cli("slice", db, "--run", "dp1", "--world", "4", "--layout", "dp=4", "--out-run", "s4")
    assert res.exit_code == 0, res.output
    assert "dp=4 grows from the recording's one-member data-parallel calls" in res.output
