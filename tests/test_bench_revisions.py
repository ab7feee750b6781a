"""The revisions benchmark's parser: which printed numbers are timings, what counts as a change."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "bench_revisions", REPO / "benchmarks" / "bench_revisions.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_revisions"] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


OUT = """\
slice to 8192 ranks (best of 1)           0.13 s
slice, all repetitions                    0.09, 0.08 s
classes / groups / nodes / edges written  4 / 12,293 / 3392 / 5497
| 0 | 70.194 | +0.5 % |
| 1 | 70.194 | +0.5 % |
events/s, DES core                        200,947,751
note: /tmp/x.md
"""


def test_figures_tell_timings_from_counts() -> None:
    figs = _module().figures(OUT)
    assert figs["slice to # ranks (best of #) # s"] == [
        ("8192", False),
        ("1", False),
        ("0.13", True),
    ]
    assert figs["slice, all repetitions #, # s"] == [("0.09", True), ("0.08", True)]
    assert [t for _, t in figs["classes / groups / nodes / edges written # / # / # / #"]] == [
        False
    ] * 4
    assert ("12,293", False) in figs["classes / groups / nodes / edges written # / # / # / #"]
    # Repeated table rows keep their order; a rate makes the whole line a timing; notes are skipped.
    assert figs["# # # %"][0] == ("0", False)
    assert figs["# # # % (2)"][0] == ("1", False)
    assert figs["events/s, DES core #"] == [("200,947,751", True)]
    assert not any(k.startswith("note") for k in figs)


def test_change_flags_deterministic_differences_only() -> None:
    change = _module()._change
    same = [("8192", False), ("0.13", True)]
    assert change(same, same) == ("same", "same", set())
    assert change(same, [("8192", False), ("0.26", True)]) == ("#2 +100 %", "timing", set())
    text, kind, differing = change(same, [("8191", False), ("0.13", True)])
    assert kind == "differs"
    assert "8192 → 8191" in text
    assert differing == {1}


def test_table_columns_named_in_seconds_are_timings() -> None:
    out = """\
| run | lanes / world | report MiB | report s |
|---|---|---|---|
| sample | 8 / 8 | 7.2 | 3.31 |
rank  recorded  ASTRA-sim (s)  derive s
   0    820928         70.194      0.28
"""
    figs = _module().figures(out)
    assert figs["sample # / # # #"] == [("8", False), ("8", False), ("7.2", False), ("3.31", True)]
    # A simulated time in seconds is deterministic; only a bare `s` column is a wall time.
    assert figs["# # # #"] == [("0", False), ("820928", False), ("70.194", False), ("0.28", True)]


def test_explained_only_when_the_numbers_that_differ_are_covered() -> None:
    mod = _module()
    fig = "astra_sim: all_reduce # # # # % # # %"
    assert mod._explained(fig, {5, 6}) is not None
    assert mod._explained(fig, {2, 5}) is None  # ASTRA-sim's own figure must not move
