"""Chakra ET attributes of the wrong type or out of range: refused by name, never stored.

An attribute may hold any of protobuf's types, so a ``comm_size`` can be a string, a ``tid`` a
uint64 above the BIGINT range and a ``comm_dst`` a bool. Each case here was a crash, a vague
"bad value types" line or a wrong value in the store; now it is one line naming the file, the
node and the field, and the store is left as it was.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.errors import PrismError
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.ingestion.pipeline import ingest
from prism_trace.store.connection import open_store

Attr = tuple[str, str, object]
"""(name, value field of ``AttributeProto`` such as ``int64_val``, value)."""

U64_MAX = (1 << 64) - 1
MM: dict = {"id": 1, "name": "mm", "type": pb.COMP_NODE, "duration_micros": 5}
OWN: list[Attr] = [("schema", "string_val", "prism-trace-test")]
WORLD_2: Attr = ("world_size", "int64_val", 2)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _set(msg: pb.Node | pb.GlobalMetadata, attrs: list[Attr]) -> None:
    for name, kind, value in attrs:
        a = msg.attr.add(name=name)
        if kind.endswith("_list"):
            getattr(a, kind).values.extend(value)
        else:
            setattr(a, kind, value)


def _write(path: Path, nodes: list[dict], meta: list[Attr] | None = None) -> Path:
    """A Chakra ET of ``nodes`` (``pb.Node`` fields plus ``attrs``) after a GlobalMetadata."""
    gm = pb.GlobalMetadata(version="0.0.4")
    _set(gm, meta or [])
    recs = [gm.SerializeToString()]
    for spec in nodes:
        fields = {k: v for k, v in spec.items() if k != "attrs"}
        node = pb.Node(**fields)
        _set(node, spec.get("attrs", []))
        recs.append(node.SerializeToString())
    path.write_bytes(b"".join(_varint(len(r)) + r for r in recs))
    return path


def _coll(comm_type: int, attrs: list[Attr]) -> dict:
    attrs = [("comm_type", "int64_val", comm_type), *attrs]
    return {"id": 2, "name": "coll", "type": pb.COMM_COLL_NODE, "data_deps": [1], "attrs": attrs}


def _send(attrs: list[Attr]) -> dict:
    return {"id": 2, "name": "send", "type": pb.COMM_SEND_NODE, "data_deps": [1], "attrs": attrs}


def _pg_init(groups: list[dict]) -> dict:
    text = json.dumps(groups)
    attrs = [("pg", "string_val", text)]
    return {"id": 2, "name": "## process_group:init ##", "type": pb.METADATA_NODE, "attrs": attrs}


@functools.cache
def _empty_store() -> bytes:
    """The bytes of a new, empty store, made once (the schema is most of a refusal's cost)."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "empty.duckdb"
        open_store(db).close()
        return db.read_bytes()


def _refused(tmp_path: Path, path: Path, needle: str) -> str:
    """Ingest ``path`` in-process and through the CLI: one line naming it, the store as it was."""
    db = tmp_path / "s.duckdb"
    db.write_bytes(_empty_store())
    with open_store(db) as store, pytest.raises(PrismError) as exc:
        ingest(store, [path], run="x", progress=False)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: "), msg
    assert needle in msg, msg
    res = CliRunner().invoke(main, ["ingest", str(path), "--db", str(db), "--run", "x"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 1, res.output
    assert lines == [f"error: {msg}"], res.output
    with open_store(db, read_only=True) as store:
        for table in ("run", "event", "collective", "p2p", "comm_group"):
            count = store.con.execute(f"SELECT count(*) FROM {table}").fetchall()
            assert count == [(0,)], table
    return msg


# -- node ids, thread ids, pids -------------------------------------------------------------------


def test_node_id_above_bigint(tmp_path: Path) -> None:
    path = _write(tmp_path / "j.0.et", [{**MM, "id": (1 << 63) + 5}])
    _refused(tmp_path, path, "node 'mm' (record at byte offset 8): `id` = 9223372036854775813")


def test_tid_above_bigint(tmp_path: Path) -> None:
    path = _write(tmp_path / "j.0.et", [{**MM, "attrs": [("tid", "uint64_val", U64_MAX)]}])
    _refused(tmp_path, path, f"node 1 ('mm'): `tid` = {U64_MAX} is outside")


@pytest.mark.parametrize(
    ("pid", "needle"),
    [
        (("uint64_val", U64_MAX), f"metadata `pid` = {U64_MAX} is outside"),
        (("bool_val", True), "metadata `pid` is bool True, expected a process id"),
        (("string_val", "12"), "metadata `pid` is string '12', expected a process id"),
    ],
)
def test_bad_pid(tmp_path: Path, pid: tuple[str, object], needle: str) -> None:
    path = _write(tmp_path / "j.0.et", [MM], [("pid", *pid)])
    _refused(tmp_path, path, needle)


# -- collectives ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("comm_type", "size", "needle"),
    [
        (pb.REDUCE_SCATTER, ("string_val", "abc"), "`comm_size` is string 'abc'"),
        (pb.ALL_REDUCE, ("string_val", "12"), "`comm_size` is string '12'"),
        (pb.ALL_GATHER, ("string_val", "12"), "`comm_size` is string '12'"),
        (pb.ALL_REDUCE, ("int64_val", -8), "`comm_size` = -8 is outside"),
        (pb.ALL_REDUCE, ("bool_val", True), "`comm_size` is bool True"),
        (pb.ALL_REDUCE, ("double_val", 12.0), "`comm_size` is float 12.0"),
        (pb.ALL_REDUCE, ("uint64_val", U64_MAX), f"`comm_size` = {U64_MAX} is outside"),
        (pb.ALL_GATHER, ("int64_val", 1 << 62), f"`comm_size` = {1 << 62} is outside"),
    ],
)
def test_collective_bad_comm_size(
    tmp_path: Path, comm_type: int, size: tuple[str, object], needle: str
) -> None:
    path = _write(tmp_path / "j.0.et", [MM, _coll(comm_type, [("comm_size", *size)])], [WORLD_2])
    msg = _refused(tmp_path, path, needle)
    assert "node 2 ('coll'): " in msg


def test_collective_comm_type_bool(tmp_path: Path) -> None:
    coll = _coll(0, [("comm_size", "int64_val", 8)])
    coll["attrs"][0] = ("comm_type", "bool_val", True)  # True == 1 == REDUCE
    path = _write(tmp_path / "j.0.et", [MM, coll], [WORLD_2])
    _refused(tmp_path, path, "unknown comm_type True at node 2")


def test_collective_kind_not_a_string(tmp_path: Path) -> None:
    attrs: list[Attr] = [("comm_size", "int64_val", 8), ("prism_comm_kind", "int64_val", 5)]
    path = _write(tmp_path / "j.0.et", [MM, _coll(pb.ALL_REDUCE, attrs)], [WORLD_2])
    _refused(tmp_path, path, "node 2 ('coll'): `prism_comm_kind` is int 5, expected a string")


# -- p2p ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "needle"),
    [
        ([("comm_dst", "int64_val", -5)], "`comm_dst` = -5 is outside [0, "),
        ([("comm_dst", "bool_val", True)], "`comm_dst` is bool True, expected an integer rank"),
        ([("comm_dst", "int64_val", 10**12)], f"`comm_dst` = {10**12} is outside [0, "),
        ([("comm_dst", "string_val", "1")], "`comm_dst` is string '1', expected an integer rank"),
        (
            [("comm_dst", "int32_val", 1), ("comm_size", "int64_val", -8)],
            "`comm_size` = -8 is outside",
        ),
        (
            [("comm_dst", "int32_val", 1), ("comm_size", "string_val", "8")],
            "`comm_size` is string '8'",
        ),
        (
            [("comm_dst", "int32_val", 1), ("comm_tag", "int64_val", 1 << 40)],
            f"`comm_tag` = {1 << 40} is outside",
        ),
        (
            [("comm_dst", "int32_val", 1), ("comm_tag", "string_val", "7")],
            "`comm_tag` is string '7'",
        ),
    ],
)
def test_p2p_bad_values(tmp_path: Path, attrs: list[Attr], needle: str) -> None:
    path = _write(tmp_path / "j.0.et", [MM, _send(attrs)])
    msg = _refused(tmp_path, path, needle)
    assert "node 2 ('send'): " in msg


# -- process groups -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"backend_config": 5}, "process group '0': `backend_config` is int 5, expected a string"),
        ({"pg_desc": 7}, "process group '0': `pg_desc` is int 7, expected a string"),
        ({"ranks": 5}, "process group '0': `ranks` is int 5, expected a list of ranks"),
    ],
)
def test_process_group_bad_fields(tmp_path: Path, change: dict, needle: str) -> None:
    group: dict[str, object] = {"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1]}
    group["backend_config"] = "cuda:nccl"
    path = _write(tmp_path / "j.0.et", [MM, _pg_init([{**group, **change}])])
    _refused(tmp_path, path, needle)


# -- prism's own export ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attr", "needle"),
    [
        (("order_deps", "int64_val", 5), "`order_deps` is int 5, expected a list of node ids"),
        (("sync_deps", "string_list", ["a"]), "`sync_deps` is string 'a'"),
        (("prism_kind", "int64_list", [5]), "`prism_kind` is list [5], expected a string"),
    ],
)
def test_own_export_bad_attributes(tmp_path: Path, attr: Attr, needle: str) -> None:
    path = _write(tmp_path / "j.0.et", [{**MM, "attrs": [attr]}], OWN)
    msg = _refused(tmp_path, path, needle)
    assert "node 1 ('mm'): " in msg
