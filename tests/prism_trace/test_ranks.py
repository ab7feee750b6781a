"""Rank lists (`prism_trace.ranks`): one parser for every `--ranks`-like option."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import UsageError
from prism_trace.ranks import MAX_RANKS, parse_ranks


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("0,2,4", [0, 2, 4]),
        ("0..7", list(range(8))),
        ("0..7:2", [0, 2, 4, 6]),
        (" 3 , 0..1 ,3", [3, 0, 1]),
        ("5..5", [5]),
    ],
)
def test_rank_lists_parse(spec: str, want: list[int]) -> None:
    assert parse_ranks(spec) == want


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("", "is empty"),
        ("x", "'x' is not a rank"),
        ("-1", "'-1' is not a rank"),
        ("1.5", "'1.5' is not a rank"),
        ("7..0", "needs start <= end"),
        ("0..7:0", "a step >= 1"),
        ("0..1e9", "is not a rank"),
        (f"0..{MAX_RANKS}", "more than"),
    ],
)
def test_bad_rank_lists_are_one_clear_error(spec: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        parse_ranks(spec)


@pytest.mark.parametrize(
    "args",
    [
        ["slice", "db", "--run", "a", "--layout", "dp=2", "--world", "2", "--out-run", "b"],
        ["replay", "db", "--run", "a", "--out-run", "b"],
        ["validate", "db", "--run", "a"],
    ],
)
def test_every_rank_option_uses_the_one_parser(args: list[str]) -> None:
    opt = {"slice": "--from-ranks", "replay": "--ranks", "validate": "--slice-ranks"}[args[0]]
    res = CliRunner().invoke(main, [*args, opt, "0..x"])
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    assert "'0..x' is not a rank" in res.output
