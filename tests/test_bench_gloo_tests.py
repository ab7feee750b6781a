"""The gloo collectives benchmark writes logs the network fit reads as a cluster's nccl-tests."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
from prism_trace.replay.network import fit_network, network_time_us, read_nccl_log

REPO = Path(__file__).resolve().parents[1]


def _module():  # type: ignore[no-untyped-def]
    """The benchmark script, imported as its folder's scripts import each other."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module("gloo_tests")


@pytest.mark.parametrize(
    ("op", "n", "size", "expected"),
    [
        ("all_reduce", 4, 1000, (1000, 250)),
        ("all_reduce", 4, 2, (4, 1)),  # at least one element
        ("reduce_scatter", 4, 1000, (992, 62)),  # a multiple of 4n: each member's part
        ("all_gather", 16, 4, (64, 1)),
    ],
)
def test_sizes_are_nccl_tests_sizes(op: str, n: int, size: int, expected: tuple[int, int]) -> None:
    assert _module()._elements(op, size, n) == expected


def test_log_reads_as_one_node_of_n_ranks(tmp_path: Path) -> None:
    mod = _module()
    times = {4: 480.0, 65536: 640.0, 1048576: 1600.0}
    path = tmp_path / "all_reduce_perf_4r.log"
    path.write_text(mod.nccl_tests_log("all_reduce", 4, times, reps=15))
    (log,) = read_nccl_log(path)
    assert (log.op, log.ranks, log.nodes) == ("all_reduce", 4, 1)
    assert [(r.size, r.oop_us, r.ip_us) for r in log.rows] == [(s, t, t) for s, t in times.items()]
    assert log.rows[-1].oop_busbw == pytest.approx(1048576 / 1600e3 * 2 * 3 / 4, rel=1e-3)
    assert all(r.oop_wrong is None for r in log.rows)  # N/A: gloo's results are not checked


def test_logs_of_several_group_sizes_fit(tmp_path: Path) -> None:
    """A host whose all-reduce costs about a millisecond a ring hop (gloo's scheduling on a few
    cores, not NCCL's microseconds) fits, and carries the hops to a group it was not fitted on."""
    mod = _module()

    def host(n: int, size: int) -> float:
        return 1000.0 * 2 * (n - 1) + size / 2e3

    paths = []
    for n in (2, 4, 8):
        times = {s: host(n, s) for s in (4, 4096, 262144, 1048576)}
        paths.append(tmp_path / f"all_reduce_perf_{n}r.log")
        paths[-1].write_text(mod.nccl_tests_log("all_reduce", n, times, reps=15))
    model = fit_network([t for p in paths for t in read_nccl_log(p)])
    got, _ = network_time_us(model, "all_reduce", np.array([4096, 262144]), 16, 1)
    want = np.array([host(16, 4096), host(16, 262144)])
    assert np.all(np.abs(got / want - 1) < 0.25), (got, want)
