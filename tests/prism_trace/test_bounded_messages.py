"""Bounded work for every message: a value in an error is cut from a bounded repr, and a YAML of
nested aliases ("billion laughs") is refused fast and small, not expanded."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import TraceFormatError
from prism_trace.limits import load_yaml, short_repr
from tests.prism_trace.test_op_timeline import _tiny


def _laughs(levels: int = 9, width: int = 9) -> str:
    """About 0.5 KB of YAML standing for ``width ** levels`` (387 million) strings."""
    lines = ['l0: &l0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_short_repr_of_a_billion_laughs_is_small_and_fast() -> None:
    text = _laughs()
    assert len(text) < 1300
    data = yaml.safe_load(text)  # PyYAML shares aliased nodes: this is small
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = short_repr(data)
    assert time.perf_counter() - t0 < 0.5
    assert len(out) <= 60
    assert out.startswith("{'l0': 'lol', 'l1': [")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KB


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("x" * 10_000_000, "'xxxxx"),
        (10**100_000, "<int>"),  # repr() of it raises ValueError (over 4300 digits)
        ([[[[[[1]]]]]], "[[[[...]]]]"),
        (b"\x00" * 10_000_000, "b'\\x00"),
    ],
    ids=["string", "int", "nested", "bytes"],
)
def test_short_repr_of_huge_values(value: object, shown: str) -> None:
    out = short_repr(value)
    assert len(out) <= 60
    assert out.startswith(shown)


def test_load_yaml_refuses_alias_expansion_and_self_reference(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(TraceFormatError, match="more than 1000000 nodes through its aliases"):
        load_yaml(_laughs(), "meta.yaml")
    assert time.perf_counter() - t0 < 2
    with pytest.raises(TraceFormatError, match="alias refers to itself"):
        load_yaml("a: &a [1, *a]\n", "meta.yaml")
    # a few aliases are fine
    assert load_yaml("a: &a [1, 2]\nb: *a\n", "m.yaml") == {"a": [1, 2], "b": [1, 2]}
    assert load_yaml("", "m.yaml") is None


def test_ingest_of_a_meta_yaml_bomb_is_one_line(tmp_path: Path) -> None:
    folder = _tiny(tmp_path / "t")
    meta = folder / "meta-T.yaml"
    meta.write_text("dp_size: 2\npp_size: 2\ntp_size: 1\nworld_size: 4\n" + _laughs())
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["ingest", "--db", str(tmp_path / "s.db"), str(folder)])
    assert time.perf_counter() - t0 < 30
    assert r.exit_code == 1, r.output
    assert r.output.startswith(f"error: {meta}: YAML expands to more than"), r.output
    assert r.output.count("\n") == 1
    assert not (tmp_path / "s.db").exists()
