"""A refused command leaves every table's contents as they were (not only the row counts): the
graph a command builds for itself (emulate, export chakra, analyze slowdown) is written in the
command's transaction, and every argument is checked before anything is written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from tests.conftest import SAMPLE, db_contents


@pytest.fixture(scope="module")
def stores(sample_template: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sample without a graph, and a recording of two of its eight ranks (`part`)."""
    root = tmp_path_factory.mktemp("refused")
    partial = root / "partial.db"
    traces = sorted(p for p in SAMPLE.iterdir() if p.name.startswith(("rank0.", "rank1.")))
    r = CliRunner().invoke(
        main, ["ingest", "--db", str(partial), "--run", "part", *map(str, traces)]
    )
    assert r.exit_code == 0, r.output
    return {"sample": sample_template, "partial": partial}


def _refused(template: Path, tmp_path: Path, args: list[str], words: str) -> None:
    db = tmp_path / "w.db"
    shutil.copyfile(template, db)
    before = db_contents(db)
    r = CliRunner().invoke(main, [a.replace("DB", str(db)) for a in args])
    assert r.exit_code == 1, r.output
    assert r.output.count("\n") == 1, r.output
    assert words in r.output, r.output
    assert db_contents(db) == before
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("store", "args", "words"),
    [
        (
            "partial",
            ["emulate", "DB", "--run", "part", "--out-run", "e"],
            "which would wait forever",
        ),
        (
            "sample",
            ["emulate", "DB", "--run", "sample", "--out-run", "e", "--what-if", "remove-gpu=99"],
            "outside the world of 8 ranks",
        ),
        (
            "partial",
            ["emulate", "DB", "--run", "part", "--out-run", "e", "--what-if", "remove-gpu=0"],
            "error: ",
        ),
        (
            "partial",
            ["analyze", "DB", "slowdown", "--run", "part", "--by", "stage"],
            "which would wait forever",
        ),
        *(
            (
                "sample",
                ["export", "chakra", "DB", "--run", "sample", "-o", "OUT", "--size-bandwidth", bw],
                "is not a positive number",
            )
            for bw in ("0", "-1", "nan", "inf")
        ),
        (
            "sample",
            ["ingest", "--db", "DB", "--run", "sample", "--replace", "--layout", "tp=3", "SAMPLE"],
            "has 3 ranks",
        ),
    ],
    ids=[
        "emulate-partial",
        "emulate-remove-gpu-99",
        "emulate-partial-remove-gpu-0",
        "slowdown-by-stage-partial",
        "chakra-bw-0",
        "chakra-bw-negative",
        "chakra-bw-nan",
        "chakra-bw-inf",
        "ingest-replace-bad-layout",
    ],
)
def test_a_refused_command_changes_no_row(
    store: str, args: list[str], words: str, stores: dict[str, Path], tmp_path: Path
) -> None:
    args = [
        str(tmp_path / "out") if a == "OUT" else str(SAMPLE) if a == "SAMPLE" else a for a in args
    ]
    _refused(stores[store], tmp_path, args, words)


def test_an_export_failing_late_keeps_no_graph(
    stores: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph export chakra builds for a recorded run is committed with a whole export only:
    a failure while writing the files (here, the comm groups) rolls it back, and no folder is
    left under the export's name."""
    from prism_trace.export.chakra import members

    def fail(self: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(members.MemberWriter, "write_comm_groups", fail)
    out = tmp_path / "out"
    _refused(
        stores["sample"],
        tmp_path,
        ["export", "chakra", "DB", "--run", "sample", "-o", str(out)],
        "No space left on device",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.db"]
