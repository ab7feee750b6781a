"""nccl-tests logs as people posted them (tests/data/nccl/README.md cites each): every layout the
reader meets, and the one-line refusals of logs it cannot read."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prism_trace.replay.network.fit import fit_network
from prism_trace.replay.network.parse import NcclLogError, read_nccl_log

DATA = Path(__file__).resolve().parents[1] / "data" / "nccl"
GJ = DATA / "nccl-tests-309"


def test_in_place_and_out_of_place_columns() -> None:
    (lg,) = read_nccl_log(GJ / "gj_all_reduce_4n.log")
    assert lg.op == "all_reduce"
    assert len(lg.rows) == 14
    first = lg.rows[0]
    assert (first.size, first.count, first.dtype, first.redop, first.root) == (
        1048576,
        262144,
        "float",
        "sum",
        -1,
    )
    assert (first.oop_us, first.oop_algbw, first.oop_busbw, first.oop_wrong) == (
        317.0,
        3.31,
        6.41,
        0.0,
    )
    assert (first.ip_us, first.ip_algbw, first.ip_busbw, first.ip_wrong) == (
        93.26,
        11.24,
        21.78,
        0.0,
    )
    assert first.time_us == 93.26  # the out-of-place stall (317 us) is not the network
    last = lg.rows[-1]
    assert (last.size, last.oop_us, last.ip_us) == (8589934592, 51285.0, 51350.0)
    assert last.time_us == 51285.0


def test_multi_node_device_blocks_give_ranks_and_nodes() -> None:
    (lg,) = read_nccl_log(GJ / "gj_all_reduce_8n.log")
    assert (lg.ranks, lg.nodes, lg.ranks_per_node) == (64, 8, 8)
    assert lg.hosts == (
        "0666a154",
        "b749a9b0",
        "9c3d25a5",
        "256b9d9c",
        "ffb1c60b",
        "05ed0c0f",
        "e7df8ecc",
        "b3a57cc9",
    )
    (two,) = read_nccl_log(DATA / "nccl-tests-309" / "qoofyk_all_reduce_2n.log")
    assert (two.ranks, two.nodes, len(two.rows)) == (16, 2, 32)
    assert two.rows[0].size == 8
    assert two.rows[-1].size == 17179869184


def test_mpi_tagged_lines() -> None:
    (lg,) = read_nccl_log(DATA / "nccl-ebpf" / "all_reduce_perf_mpi_tagged.log")
    assert lg.op == "all_reduce"  # from `# Collective test starting: all_reduce_perf_mpi`
    assert (lg.ranks, lg.nodes, lg.hosts) == (2, 1, ("lab",))
    assert [r.size for r in lg.rows] == [1 << k for k in range(20, 28)]
    assert lg.rows[0].oop_us == 4366.46
    assert lg.rows[0].oop_wrong == 0.0


def test_slurm_labelled_lines(tmp_path: Path) -> None:
    """``srun --label`` puts the task number before every line (NVIDIA/nccl-tests#290): the
    table reads as the same lines without it, and the ring run's algorithm comes from the
    poster's ``export NCCL_ALGO=RING`` block."""
    src = DATA / "nccl-tests-290" / "shahizat_all_reduce_2n.log"
    (lg,) = read_nccl_log(src)
    assert (lg.op, lg.ranks, lg.nodes, lg.hosts) == ("all_reduce", 16, 2, ("node005", "node007"))
    assert [r.size for r in lg.rows] == [1 << k for k in range(23, 34)]
    bare = tmp_path / "all_reduce_perf_bare.log"
    bare.write_text("".join(line.split(": ", 1)[1] for line in src.read_text().splitlines(True)))
    (plain,) = read_nccl_log(bare)
    assert plain.rows == lg.rows
    (ring,) = read_nccl_log(DATA / "nccl-tests-290" / "shahizat_ring_all_reduce_2n.log")
    assert (ring.op, ring.algo, ring.ranks, ring.nodes) == ("all_reduce", "ring", 16, 2)


def test_na_errors_and_the_old_layout() -> None:
    (lg,) = read_nccl_log(DATA / "nccl-tests-78" / "all_reduce_perf_256gpu.log")
    assert lg.rows[0].root is None  # no `root` column before nccl-tests 2.x
    assert all(r.oop_wrong is None and r.ip_wrong is None for r in lg.rows)  # N/A (-c 0)
    assert (lg.rows[0].oop_us, lg.rows[0].ip_busbw) == (1464.2, 45.84)
    # no device block: the mpirun line's -n 256 -npernode 16
    assert (lg.ranks, lg.nodes) == (256, 16)
    (sr,) = read_nccl_log(DATA / "nccl-tests-214" / "sendrecv_perf_2n.log")
    assert sr.op == "sendrecv"  # the post shows no command: the file's name says it
    assert [(r.oop_wrong, r.ip_wrong) for r in sr.rows] == [(0.0, None)] * 5
    assert (sr.ranks, sr.nodes) == (2, 2)


def test_forced_algorithm_is_read_from_the_command() -> None:
    (lg,) = read_nccl_log(GJ / "gj_tuned_ring_all_reduce_2n.log")
    assert lg.algo == "ring"
    (free,) = read_nccl_log(GJ / "gj_all_reduce_2n.log")
    assert free.algo is None


def _broken(tmp_path: Path, src: Path, line_no: int, new: str | None) -> Path:
    """A copy of ``src`` with line ``line_no`` (1-based) replaced (None: removed)."""
    lines = src.read_text().splitlines()
    if new is None:
        del lines[line_no - 1]
    else:
        lines[line_no - 1] = new
    out = tmp_path / src.name
    out.write_text("\n".join(lines) + "\n")
    return out


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if needle in ln)


@pytest.mark.parametrize(
    ("needle", "replacement", "why"),
    [
        (
            "   134217728      33554432",
            "   134217728      33554432     float     sum      -1   1055.3  12x.18  246.41",
            "not a result row of this table",
        ),
        (
            "   268435456      67108864",
            "   268435456      67108864     float     sum      -1   2219.3  120.96  234.35  0  1",
            r"not a result row of this table \(10 fields",
        ),
        ("#  Rank 17 Group", "#  Rank 17 Group  0 Pid  61981 on", "malformed device line"),
        (
            "#  Rank 18 Group",
            "#  Rank 17 Group  0 Pid  61982 on 9c3d25a5 device  2 [0000:45:00] NVIDIA H100",
            "rank 17 is listed twice",
        ),
    ],
)
def test_a_malformed_line_is_one_error_naming_file_and_line(
    tmp_path: Path, needle: str, replacement: str, why: str
) -> None:
    src = GJ / "gj_all_reduce_4n.log"
    no = _line_of(src, needle)
    bad = _broken(tmp_path, src, no, replacement)
    with pytest.raises(NcclLogError, match=why) as err:
        read_nccl_log(bad)
    assert str(err.value).startswith(f"{bad}:{no}: ")
    assert "\n" not in str(err.value)


def test_a_log_without_result_rows_is_refused(tmp_path: Path) -> None:
    src = GJ / "gj_all_reduce_2n.log"
    head = [ln for ln in src.read_text().splitlines() if ln.startswith("#")]
    empty = tmp_path / "all_reduce_header_only.log"
    empty.write_text("\n".join(head) + "\n")
    with pytest.raises(NcclLogError, match="no nccl-tests result rows"):
        read_nccl_log(empty)


def test_a_log_without_ranks_cannot_be_fitted(tmp_path: Path) -> None:
    src = DATA / "nccl-ebpf" / "all_reduce_perf_mpi_tagged.log"
    kept = [ln for ln in src.read_text().splitlines() if "#  Rank" not in ln]
    path = tmp_path / "no_devices.log"
    path.write_text("\n".join(kept) + "\n")
    logs = read_nccl_log(path)
    assert logs[0].ranks is None
    with pytest.raises(NcclLogError, match="ranks and nodes of the test are unknown"):
        fit_network(logs)


def test_cli_refusal_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    src = GJ / "gj_all_reduce_4n.log"
    no = _line_of(src, "    16777216       4194304")
    bad = _broken(tmp_path, src, no, "    16777216       4194304     float     sum      -1")
    (tmp_path / "ok").mkdir()
    good = tmp_path / "ok" / "gj_all_reduce_2n.log"
    shutil.copy(GJ / "gj_all_reduce_2n.log", good)
    out = tmp_path / "net.toml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prism_trace.cli",
            "network",
            "fit",
            str(good),
            str(bad),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}:{no}: not a result row of this table (5 fields, expected 13 or 9):"
        f" '16777216       4194304     float     sum      -1'"
    ]
    assert not out.exists()


def test_a_log_of_several_tests_gives_each_its_own(tmp_path: Path) -> None:
    both = tmp_path / "session.log"
    first = (DATA / "nccl-ebpf" / "all_reduce_perf_mpi_tagged.log").read_text()
    second = first.replace("all_reduce_perf_mpi", "all_gather_perf_mpi")
    both.write_text(first + "\nsome shell noise 12 34\n" + second)
    logs = read_nccl_log(both)
    assert [(lg.op, lg.ranks, len(lg.rows)) for lg in logs] == [
        ("all_reduce", 2, 8),
        ("all_gather", 2, 8),
    ]
    # the blank line and the noise line between the two: the second table starts 2 lines later
    assert logs[1].rows[0].line == len(first.splitlines()) + 2 + logs[0].rows[0].line


NCCL = DATA


def test_alps_slurm_labels_and_failed_checks() -> None:
    """Alps' srun -l logs: a ` 0: ` label on every line, no `Collective test starting` line (the
    command line names the test), 4 ranks a node, and a float `#wrong` of a failed check."""
    (log,) = read_nccl_log(NCCL / "alps-gh200" / "run_0000" / "all_reduce_16n.log")
    assert (log.op, log.ranks, log.nodes, log.ranks_per_node) == ("all_reduce", 64, 16, 4)
    assert len(log.rows) == 30
    (bad,) = [r for r in log.rows if r.failed_check]
    assert bad.size == 64 << 20
    assert bad.oop_wrong == pytest.approx(3.08036e07)
    assert bad.time_us == 0.0  # both columns failed: nothing to fit


def test_one_log_of_five_tests_on_ten_nodes() -> None:
    logs = read_nccl_log(NCCL / "xxrjun-h100" / "all_five_10n.log")
    assert [lg.op for lg in logs] == [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "sendrecv",
    ]
    assert {(lg.ranks, lg.nodes) for lg in logs} == {(80, 10)}
    assert all(len(lg.rows) == 10 and not any(r.failed_check for r in lg.rows) for lg in logs)
