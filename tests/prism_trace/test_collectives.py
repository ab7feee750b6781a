"""Cross-rank matching of collectives and p2p on the sample and real traces."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from prism_trace.errors import CollectiveMismatchError
from prism_trace.graph.matching import check_comms, match_comms
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import Store, open_store


@pytest.fixture(scope="module")
def sample(sample_store: Store) -> Store:
    """The module's own copy of the sample store (conftest: ingested once per test run)."""
    return sample_store


@contextmanager
def edited(store: Store, sql: str) -> Iterator[None]:
    """Apply an edit for the duration of the block, then roll it back."""
    store.con.execute("BEGIN TRANSACTION")
    try:
        store.con.execute(sql)
        yield
    finally:
        store.con.execute("ROLLBACK")


def test_sample_is_complete_and_paired(sample: Store) -> None:
    report = check_comms(sample, "sample")
    assert report.instances == 168
    assert report.complete == 168
    assert report.problems.is_empty()
    n_p2p = sample.con.execute("SELECT count(*) FROM p2p").fetchall()[0][0]
    assert report.pairs * 2 == n_p2p
    assert report.unpaired.is_empty()
    assert report.ok
    assert report.message() is None


def test_changed_size_names_group_seq_and_rank(sample: Store) -> None:
    gid, name, seq = sample.con.execute(
        "SELECT c.group_id, g.name, c.seq FROM collective c JOIN comm_group g USING (run_id,"
        " group_id) WHERE c.rank = 5 ORDER BY c.host_ts LIMIT 1"
    ).fetchall()[0]
    with edited(
        sample,
        f"UPDATE collective SET msg_bytes = msg_bytes + 4"
        f" WHERE rank = 5 AND group_id = {gid} AND seq = {seq}",
    ):
        report = match_comms(sample, "sample")
        assert report.mismatched.height == 1
        row = report.mismatched.row(0, named=True)
        assert row["odd_ranks"] == [5]
        assert len(row["sizes"]) == 2
        with pytest.raises(CollectiveMismatchError) as exc:
            check_comms(sample, "sample")
    text = str(exc.value)
    assert f"group {name!r} seq {seq}" in text
    assert "[5]" in text
    assert "differ" in text
    check_comms(sample, "sample")  # rolled back


def test_missing_recorded_rank_and_unpaired_send(sample: Store) -> None:
    gid, name, seq = sample.con.execute(
        "SELECT c.group_id, g.name, c.seq FROM collective c JOIN comm_group g USING (run_id,"
        " group_id) WHERE c.rank = 2 ORDER BY c.host_ts LIMIT 1"
    ).fetchall()[0]
    with edited(
        sample, f"DELETE FROM collective WHERE rank = 2 AND group_id = {gid} AND seq = {seq}"
    ):
        report = match_comms(sample, "sample")
        bad = report.mismatched
        assert bad.height == 1
        assert bad["missing_ranks"].to_list() == [[2]]
        assert report.complete == report.instances - 1
        with pytest.raises(CollectiveMismatchError) as exc:
            check_comms(sample, "sample")
        assert f"group {name!r} seq {seq}: ranks [2] missing" in str(exc.value)
    with edited(sample, "DELETE FROM p2p WHERE direction = 'recv' AND rank = 1 AND seq = 0"):
        report = match_comms(sample, "sample")
        assert report.unpaired.height >= 1
        with pytest.raises(CollectiveMismatchError, match=r"-> 1: receive missing"):
            check_comms(sample, "sample")


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory: pytest.TempPathFactory, dlrm_hta_template: Path) -> Store:
    """The module's copy of the conftest store holding param-dlrm-8rank as `dlrm` (and `hta`)."""
    from tests.conftest import copy_of_template

    return open_store(copy_of_template(dlrm_hta_template, tmp_path_factory, "dlrm_comm"))


@pytest.mark.shared_data
def test_dlrm_all_ranks_complete(dlrm: Store) -> None:
    report = check_comms(dlrm, "dlrm", partial_ok=False)
    assert report.recorded_ranks == list(range(8))
    assert report.instances == 8
    assert report.complete == 8


@pytest.mark.shared_data
def test_dlrm_without_rank3_names_it_everywhere(shared_datasets: Path, tmp_path: Path) -> None:
    s = open_store(tmp_path / "no3.duckdb")
    kdir = shared_datasets / "param-dlrm-8rank" / "kineto"
    files = [f for f in sorted(kdir.iterdir()) if not re.match(r"worker3_", f.name)]
    ingest(s, files, run="no3", progress=False)
    report = match_comms(s, "no3")
    assert report.recorded_ranks == [0, 1, 2, 4, 5, 6, 7]
    missing = report.missing
    assert missing.height == report.instances == 8
    assert set(missing["group_name"].to_list()) == {"0"}
    assert all(m == [3] for m in missing["missing_ranks"].to_list())
    assert all(m == [3] for m in missing["unrecorded_ranks"].to_list())
    # rank 3 was never recorded: a partial run, not a mismatch, unless asked to be strict
    assert report.ok
    check_comms(s, "no3")
    with pytest.raises(CollectiveMismatchError, match=r"group '0' seq 0: ranks \[3\] missing"):
        check_comms(s, "no3", partial_ok=False)
