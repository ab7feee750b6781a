"""Readers and ingest refuse input that says two things at once or nothing at all: duplicate keys,
parent and dependency cycles, empty traces, world sizes that disagree, a peer outside the world,
names that are not UTF-8, files that cannot be read, numbers in other scripts' digits. Each is one
line naming the file, and the store is left exactly as it was."""

from __future__ import annotations

import json
import os
import pathlib
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner
from prism_trace.analysis import run_diff

from prism_trace.cli import main
from prism_trace.errors import TraceFormatError, UsageError
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.formats.host_et.reader import read_host_et
from prism_trace.formats.kineto.reader import read_kineto
from prism_trace.formats.op_timeline.reader import read_op_timeline
from prism_trace.ingestion.pipeline import ingest
from prism_trace.layout.mesh import LayoutError, ParallelLayout
from prism_trace.ranks import parse_ranks
from prism_trace.store.connection import open_store
from tests.conftest import db_contents

_EV = '{"ph":"X","cat":"cpu_op","name":"a","pid":1,"tid":1,"ts":1,"dur":5,"args":{"x":1}}'
_INFO = '"distributedInfo":{"rank":0,"world_size":1}'


def _kineto(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def _events(*events: str, info: str = _INFO) -> str:
    return "{" + info + ',"traceEvents":[' + ",".join(events) + "]}"


@pytest.fixture
def seeded(tmp_path: Path) -> Path:
    """A store holding one good run, so 'unchanged' is checked against real content."""
    db = tmp_path / "seed.duckdb"
    (tmp_path / "good").mkdir()
    src = _kineto(tmp_path / "good" / "rank0.json", _events(_EV))
    with open_store(db) as store:
        ingest(store, [src], run="good", progress=False)
    return db


def _refused(db: Path, paths: list[Path], match: str, **kw: Any) -> None:
    """Ingest of ``paths`` is one TraceFormatError matching ``match``; the store is unchanged."""
    before = db_contents(db)
    with open_store(db) as store, pytest.raises(TraceFormatError, match=match) as got:
        ingest(store, paths, run="bad", progress=False, **kw)
    assert "\n" not in str(got.value)
    assert db_contents(db) == before


# --- duplicate keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "match"),
    [
        # the first, empty, array used to win: 0 events stored
        ("{" + _INFO + ',"traceEvents":[],"traceEvents":[' + _EV + "]}", "'traceEvents'"),
        ("{" + _INFO + ',"traceEvents":[' + _EV + '],"traceEvents":[]}', "'traceEvents'"),
        (
            '{"distributedInfo":{"rank":0,"rank":0,"world_size":1},"traceEvents":[' + _EV + "]}",
            "'rank' before",
        ),
        (_events(_EV)[:-1] + ',"traceName":"a","traceName":"b"}', "'traceName' after"),
        (_events(_EV)[:-1] + ',"distributedInfo":{}}', "'distributedInfo' at the top level"),
        (_events(_EV, _EV.replace('"ts":1', '"ts":1,"ts":7')), "duplicate key 'ts'"),
        (_events(_EV, _EV.replace('{"x":1}', '{"x":1,"x":2}')), r"traceEvents\[1\].*'x' in `args`"),
        (_events(_EV.replace('{"x":1}', '{"x":{"y":[{"z":1,"z":2}]}}')), "'z' in an object inside"),
        (
            _events(
                '{"ph":"M","name":"thread_name","pid":1,"tid":1,"args":{"name":"a","name":"b"}}',
                _EV,
            ),
            "'name' in `args`",
        ),
    ],
)
def test_kineto_duplicate_keys_refused(seeded: Path, tmp_path: Path, body: str, match: str) -> None:
    path = _kineto(tmp_path / "rank0.json", body)
    _refused(seeded, [path], match)


def test_kineto_nested_args_without_duplicates_read(tmp_path: Path) -> None:
    nested = _EV.replace('{"x":1}', '{"x":{"y":1,"z":[{"y":2},{"y":3}]},"n":"{x}","m":"{"}')
    t = read_kineto(_kineto(tmp_path / "rank0.json", _events(nested, _EV)))
    assert t.events.height == 2


def _host_et(nodes: list[dict[str, Any]], **top: Any) -> str:
    doc = {"schema": "1.1.1-chakra.0.0.4", "pid": 1, "distributedInfo": {"rank": 0}, **top}
    return json.dumps({**doc, "nodes": nodes})


def _node(nid: int, parent: int, name: str = "aten::add") -> dict[str, Any]:
    io = {"values": [], "shapes": [], "types": []}
    return {"id": nid, "name": name, "ctrl_deps": parent, "inputs": io, "outputs": io, "attrs": []}


_ROOT = "[pytorch|profiler|execution_trace|process]"


def test_host_et_duplicate_key_refused(tmp_path: Path) -> None:
    text = _host_et([_node(1, 1, _ROOT), _node(2, 1)]).replace('"id": 2,', '"id": 2, "id": 3,')
    path = tmp_path / "rank0.et.json"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match="duplicate key 'id'"):
        read_host_et(path)


def test_host_et_parents(tmp_path: Path) -> None:
    path = tmp_path / "rank0.et.json"
    path.write_text(_host_et([_node(1, 1, _ROOT), _node(2, 1), _node(3, 2)]))
    assert read_host_et(path).et_ops.height == 3  # the process root is its own parent
    path.write_text(_host_et([_node(1, 1, _ROOT), _node(2, 2)]))
    with pytest.raises(TraceFormatError, match=r"node 2 \(nodes\[1\]\) is its own parent"):
        read_host_et(path)
    path.write_text(_host_et([_node(1, 1, _ROOT), _node(2, 4), _node(3, 2), _node(4, 3)]))
    with pytest.raises(TraceFormatError, match=r"of nodes 2 -> 4 -> 3 -> 2 form a cycle"):
        read_host_et(path)


# --- Chakra cycles and peers ---------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _chakra(path: Path, nodes: list[pb.Node], world: int = 8) -> Path:
    gm = pb.GlobalMetadata(version="0.0.4")
    gm.attr.add(name="world_size").int64_val = world
    recs = [gm.SerializeToString()] + [n.SerializeToString() for n in nodes]
    path.write_bytes(b"".join(_varint(len(r)) + r for r in recs))
    return path


def _cnode(nid: int, *, data: tuple[int, ...] = (), ctrl: tuple[int, ...] = ()) -> pb.Node:
    n = pb.Node(id=nid, name=f"op{nid}", type=pb.COMP_NODE, duration_micros=10)
    n.data_deps.extend(data)
    n.ctrl_deps.extend(ctrl)
    return n


@pytest.mark.parametrize(
    ("nodes", "match"),
    [
        ([_cnode(1, data=(3,)), _cnode(2, data=(1,)), _cnode(3, data=(2,))], r"\(data deps\)"),
        ([_cnode(1, ctrl=(2,)), _cnode(2, ctrl=(1,))], r"\(ctrl deps\)"),
        ([_cnode(1, ctrl=(2,)), _cnode(2, data=(1,))], r"\(ctrl and data deps\)"),
    ],
)
def test_chakra_cycle_refused_unless_allowed(
    seeded: Path, tmp_path: Path, nodes: list[pb.Node], match: str
) -> None:
    path = _chakra(tmp_path / "g.0.et", nodes)
    _refused(seeded, [path], f"a dependency cycle.*{match}|{match}.*--allow-cycles")
    with open_store(seeded) as store:
        report = ingest(store, [path], run="kept", progress=False, allow_cycles=True)
    assert report.rows["event"] == len(nodes)


def test_chakra_self_loop_is_dropped_not_refused(seeded: Path, tmp_path: Path) -> None:
    path = _chakra(tmp_path / "g.0.et", [_cnode(1, data=(1,)), _cnode(2, data=(1,))])
    with open_store(seeded) as store:
        assert ingest(store, [path], run="ok", progress=False).rows["flow"] == 1


def test_chakra_peer_outside_the_world_refused(seeded: Path, tmp_path: Path) -> None:
    send = pb.Node(id=2, name="send", type=pb.COMM_SEND_NODE, data_deps=[1])
    for k, v in (("comm_dst", 100_000), ("comm_size", 64), ("comm_tag", 1)):
        send.attr.add(name=k).int64_val = v
    path = _chakra(tmp_path / "g.0.et", [_cnode(1), send], world=8)
    _refused(seeded, [path], "names peer 100000, outside the world of 8 ranks")


# --- empty traces, world sizes -------------------------------------------------------------------


def test_empty_traces_refused_unless_allowed(seeded: Path, tmp_path: Path) -> None:
    empty = _kineto(tmp_path / "rank0.json", _events())
    _refused(seeded, [empty], r"rank 0 holds no events .*--allow-empty")
    (tmp_path / "m").mkdir()
    only_meta = _kineto(
        tmp_path / "m" / "rank0.json",
        _events('{"ph":"M","name":"process_name","pid":1,"tid":0,"args":{"name":"p"}}'),
    )
    _refused(seeded, [only_meta], "holds no events")
    et = tmp_path / "rank0.et.json"
    et.write_text(_host_et([]))
    _refused(seeded, [et], r"rank 0 holds no nodes .*--allow-empty")
    with open_store(seeded) as store:
        report = ingest(store, [empty], run="empty", progress=False, allow_empty=True)
    assert report.ranks == [0]


def test_world_sizes_that_disagree_refused(seeded: Path, tmp_path: Path) -> None:
    a = _kineto(
        tmp_path / "rank0.json", _events(_EV, info='"distributedInfo":{"rank":0,"world_size":8}')
    )
    b = _kineto(
        tmp_path / "rank1.json", _events(_EV, info='"distributedInfo":{"rank":1,"world_size":2}')
    )
    _refused(seeded, [a, b], f"rank1.json: world size 2 disagrees with 8 in {a}")


# --- names, permissions, digits, prefixes --------------------------------------------------------


def test_file_name_not_utf8_is_one_line(seeded: Path, tmp_path: Path) -> None:
    folder = tmp_path / "odd"
    folder.mkdir()
    name = os.fsdecode(b"rank0_\xff.json")
    _kineto(folder / name, _events(_EV))
    before = db_contents(seeded)
    for given in (folder, folder / name):
        got = CliRunner().invoke(main, ["ingest", str(given), "--db", str(seeded), "--run", "x"])
        assert got.exit_code == 1
        assert "rank0_\\xff.json: the file name is not valid UTF-8" in got.output
        assert "Traceback" not in got.output
        assert "unexpected" not in got.output
    assert db_contents(seeded) == before


def test_unreadable_file_in_a_folder_is_one_line(
    seeded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    _kineto(folder / "rank0.json", _events(_EV, info='"distributedInfo":{"rank":0,"world_size":2}'))
    locked = _kineto(folder / "rank1.json", _events(_EV, info='"distributedInfo":{"rank":1}'))
    real_open = pathlib.Path.open

    def no_access(self: Path, *a: Any, **k: Any) -> Any:  # root reads a mode-000 file anyway
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "open", no_access)
    for fmt in ("auto", "kineto"):
        _refused(
            seeded, [folder], r"rank1.json: cannot read the file \(Permission denied\)", format=fmt
        )


def test_ascii_digits_only() -> None:
    for spec in ("٣", "0..٣", "²", "1_0"):
        with pytest.raises(UsageError):
            parse_ranks(spec)
    with pytest.raises(LayoutError):
        ParallelLayout.parse("tp=٣")
    assert parse_ranks(" 3 , 0..2:2") == [3, 0, 2]
    got = CliRunner().invoke(
        main, ["slice", "x.db", "--run", "r", "--layout", "tp=1", "--world", "٣", "--out-run", "s"]
    )
    assert got.exit_code == 2
    assert "not a whole number in ASCII digits" in got.output


@pytest.mark.parametrize("prefix", ["a\tb", "a\nb", "x\x7f"])
def test_export_chakra_prefix_with_control_characters(
    seeded: Path, tmp_path: Path, prefix: str
) -> None:
    out = tmp_path / "out"
    got = CliRunner().invoke(
        main, ["export", "chakra", str(seeded), "--run", "good", "-o", str(out), "--prefix", prefix]
    )
    assert got.exit_code == 1
    assert "is not a plain file-name prefix" in got.output
    assert not out.exists()


# --- op-timeline sidecars ------------------------------------------------------------------------


@pytest.fixture
def op_timeline(tmp_path: Path) -> Path:
    folder = tmp_path / "ot"
    folder.mkdir()
    rows = [(0, 0, 0, 1, "forward-compute", 1.0 + i, 0.5) for i in range(3)]
    cols = ["dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration"]
    pl.DataFrame(rows, schema=cols, orient="row").write_parquet(folder / "trace-x.parquet")
    (folder / "meta-x.yaml").write_text("dp_size: 1\npp_size: 1\ntp_size: 1\nworld_size: 1\n")
    (folder / "result-x.json").write_text('{"step_t_base": {"1": 2.5}}')
    return folder


def test_op_timeline_sidecar_duplicate_keys(op_timeline: Path) -> None:
    assert read_op_timeline(op_timeline).events.height == 3
    meta = op_timeline / "meta-x.yaml"
    meta.write_text(meta.read_text() + "pp_size: 2\n")
    with pytest.raises(TraceFormatError, match=r"meta-x\.yaml: duplicate key 'pp_size'"):
        read_op_timeline(op_timeline)
    meta.write_text("dp_size: 1\nworld_size: 1\n")
    result = op_timeline / "result-x.json"
    result.write_text('{"step_t_base": {"1": 2.5}, "step_t_base": [1]}')
    with pytest.raises(TraceFormatError, match=r"result-x\.json: duplicate key 'step_t_base'"):
        read_op_timeline(op_timeline)
    result.write_text('{"step_t_base": [1]}')
    with pytest.raises(TraceFormatError, match="`step_t_base` is list"):
        read_op_timeline(op_timeline)


@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), -1.0])
def test_diff_threshold_must_be_finite(seeded: Path, threshold: float) -> None:
    with open_store(seeded, read_only=True) as store, pytest.raises(UsageError, match="finite"):
        run_diff(store, "good", "good", threshold_pct=threshold)
