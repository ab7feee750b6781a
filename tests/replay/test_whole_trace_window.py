"""A recording without steps (no ProfilerStep) is compared over its whole trace, one window per
rank, as HTA takes such a trace: validate, an emulated run's iterations and diff.

Before, validate refused ("no `iteration` rows to compare with"), an emulated run had no
iteration, and a diff of two emulations said they "share no (rank, iteration)"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prism_trace.analysis.diff import run_diff
from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_run
from prism_trace.replay.validate.emulated import validate_run
from prism_trace.replay.whatif.config import parse_what_if

from prism_trace.ingestion.pipeline import ingest
from prism_trace.query.steps import WHOLE_TRACE, step_windows
from prism_trace.store.connection import Store, open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "prism_trace"))
import brought_traces as bt

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample"


@pytest.fixture(scope="module")
def stepless(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """The bundled 8-rank sample with its ProfilerStep spans removed, as run ``r``."""
    root = tmp_path_factory.mktemp("stepless")
    files = []
    for p in sorted(SAMPLE.glob("rank*.kineto.json.gz")):
        t = bt.load(p)
        t["traceEvents"] = [
            e for e in t["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep#")
        ]
        files.append(bt.save(t, root / p.name))
    store = open_store(root / "s.duckdb")
    ingest(store, files, run="r", progress=False)
    return store


def test_validate_compares_the_whole_trace(stepless: Store) -> None:
    assert not stepless.con.execute("SELECT count(*) FROM iteration").fetchone()[0]
    v = validate_run(stepless, run="r")
    assert [e.iteration for e in v.replay] == [WHOLE_TRACE]
    assert abs(v.replay[0].error_pct) < 0.5  # replay of every rank is exact up to the margins
    assert any("whole trace" in n for n in v.notes)


def test_emulations_have_one_window_and_diff_and_slow_downs_read_it(stepless: Store) -> None:
    emulate_run(stepless, run="r", out_run="base")
    slow = EmulationConfig(what_if=parse_what_if(["slow-ranks=0@1.5"]))
    emulate_run(stepless, run="r", out_run="slow", config=slow)
    base = step_windows(stepless.con, stepless.require_run("base"))
    assert base["iteration"].to_list() == [WHOLE_TRACE] * 8
    assert set(base["name"]) == {"whole trace"}
    d = run_diff(stepless, "base", "slow")
    assert d.ranks.height == 8
    assert (d.ranks["diff_ns"] >= 0).all()
    assert d.ranks["diff_ns"].max() > 0
