"""The events array is cut into parts DuckDB parses in parallel; a cut never changes the frames.

``split_trace_events`` cuts the array after a ``},`` that ends a line: always between two events in
Kineto's one-event-a-line layout, possibly inside one in another layout, where a part is then not
valid JSON and the reader goes back to the whole array. Either way the frames are those of the
uncut array.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

import prism_trace.formats.kineto.events as kineto_events
import prism_trace.formats.kineto.json_array as json_array
import prism_trace.formats.kineto.reader as kineto
from prism_trace.formats.kineto.json_array import split_trace_events
from prism_trace.formats.kineto.reader import read_kineto

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "sample" / "rank1.kineto.json.gz"
_FRAMES = ("events", "tracks", "flows", "iterations", "memory", "collectives", "p2p", "ranks")


def kineto_layout(doc: dict[str, Any]) -> bytes:
    """The document as torch.profiler writes it: a pretty header, then one event per line."""
    meta = {k: v for k, v in doc.items() if k != "traceEvents"}
    head = "{\n" + "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in meta.items())
    events = ",\n".join("    " + json.dumps(e) for e in doc["traceEvents"])
    return (head + '  "traceEvents": [\n' + events + "\n  ]\n}\n").encode()


def frames(path: Path) -> dict[str, pl.DataFrame]:
    t = read_kineto(path)
    return {name: getattr(t, name) for name in _FRAMES}


@pytest.fixture
def doc() -> dict[str, Any]:
    return json.loads(gzip.decompress(SAMPLE.read_bytes()))


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Parts of ~16 KB, and a record of how many files each load read."""
    monkeypatch.setattr(json_array, "_PART_BYTES", 16 << 10)
    monkeypatch.setattr(json_array, "_CUT_SEARCH", 4 << 10)
    loads: list[int] = []
    real = kineto._Reader.load_files

    def spy(self: kineto._Reader, select: str, files: list[str]) -> None:
        loads.append(len(files))
        real(self, select, files)

    monkeypatch.setattr(kineto._Reader, "load_files", spy)
    return loads


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_parts_read_like_the_whole_array(
    doc: dict[str, Any], tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = kineto_layout(doc)
    path = tmp_path / f"rank1_trace{suffix}"
    path.write_bytes(gzip.compress(text) if suffix.endswith(".gz") else text)
    whole = frames(path)

    monkeypatch.setattr(json_array, "_PART_BYTES", 16 << 10)
    monkeypatch.setattr(json_array, "_CUT_SEARCH", 4 << 10)
    with split_trace_events(path, tmp_dir=tmp_path) as tef:
        assert len(tef.parts) > 10
        got = [e for p in tef.parts for e in json.loads(p.read_bytes())]
        assert got == doc["traceEvents"]
        assert json.loads(tef.events_path.read_bytes()) == doc["traceEvents"]
    cut = frames(path)
    assert whole["events"].height > 1000
    for name in _FRAMES:
        assert cut[name].equals(whole[name]), name


def test_cuts_inside_events_fall_back_to_the_whole_array(
    doc: dict[str, Any], tmp_path: Path, small_parts: list[int]
) -> None:
    # Pretty-printed with args first: an event spans lines, and "},\n" ends its args too.
    events = [{"args": e.get("args", {}), **e} for e in doc["traceEvents"]]
    path = tmp_path / "rank1_trace.json"
    path.write_text(json.dumps({**doc, "traceEvents": events}, indent=2))
    with split_trace_events(path, tmp_dir=tmp_path) as tef:
        assert len(tef.parts) > 10
    cut = frames(path)
    assert small_parts[:2] == [len(tef.parts), 1]  # the parts failed, then the whole array
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(json_array, "_PART_BYTES", 1 << 40)
        whole = frames(path)
    for name in _FRAMES:
        assert cut[name].equals(whole[name]), name


def test_small_or_unbroken_arrays_stay_whole(tmp_path: Path, small_parts: list[int]) -> None:
    one_line = {
        "traceEvents": [
            {"ph": "X", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1}
            for i in range(2000)
        ]
    }
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(one_line))  # no line breaks: nowhere to cut
    with split_trace_events(path, tmp_dir=tmp_path) as tef:
        assert len(tef.parts) == 1
    assert read_kineto(path).events.height == 2000
    assert small_parts == [1]


def test_nesting_long_tracks_in_slices_gives_the_same_frames(
    doc: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long track is nested in slices cut where nothing is open; ids and flows do not change."""
    path = tmp_path / "rank1_trace.json"
    path.write_bytes(kineto_layout(doc))
    whole = frames(path)
    slices: list[int] = []
    real = kineto._Reader.quiet_slices

    def spy(self: kineto._Reader, lo: int, hi: int) -> list[tuple[int, int, Any, Any]]:
        out = real(self, lo, hi)
        slices.append(len(out))
        return out

    monkeypatch.setattr(kineto_events, "_NEST_ROWS", 2)
    monkeypatch.setattr(kineto._Reader, "quiet_slices", spy)
    cut = frames(path)
    assert sum(slices) > len(slices) + 10  # the host thread (flow points on it) is cut too
    assert slices[0] > 1
    assert whole["flows"].filter(pl.col("kind") == "fwdbwd").height > 0
    for name in _FRAMES:
        assert cut[name].equals(whole[name]), name


def test_out_of_memory_is_not_blamed_on_the_trace(small_parts: list[int]) -> None:
    """DuckDB running out of memory is one line that says so and what to change; it is no
    TraceFormatError (the file is fine), and the array, cut into parts, is not read again as
    one part (which only gives a bad trace a second chance)."""
    import duckdb

    from prism_trace.errors import OutOfMemoryError, TraceFormatError

    with (
        duckdb.connect(config={"memory_limit": "8MB", "threads": 1}) as con,
        pytest.raises(OutOfMemoryError, match=r"ran out of memory.*PRISM_INGEST_MEMORY_LIMIT") as e,
    ):
        kineto.stage_kineto(SAMPLE, con=con, events_into=lambda *_: None)
    assert not isinstance(e.value, TraceFormatError)
    assert len(str(e.value).splitlines()) == 1
    assert len(small_parts) == 1
    assert small_parts[0] > 1
