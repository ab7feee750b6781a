"""Bad values in op timelines and host execution traces: one line naming the file, the place
(row, or node id and index) and the field; nothing stored, no traceback.

Each case here once got through as a crash (``unexpected ValueError``), as a line naming no row
or node (``bad column types``, ``malformed host execution trace (TypeError ...)``, ``bad value
types in `collectives```), or was stored without a word (``cp_size: 1.7`` read as 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import polars as pl
import pytest

from prism_trace.formats.host_et.reader import read_host_et
from tests.prism_trace.test_fuzz_ingest import _fuzz, _op, _refused

# -- op timelines ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz() -> ModuleType:
    return _fuzz()


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("cp_size: abc", "`cp_size` = 'abc' is not an integer"),
        ("dsp_size: abc", "`dsp_size` = 'abc' is not an integer"),
        ("cp_size: 1.7", "`cp_size` = 1.7 is not an integer"),  # was read as 1
        ("dsp_size: -2", "`dsp_size` = -2 is not an integer"),
        ("cp_size: [2]", "`cp_size` = [2] is not an integer"),
    ],
)
def test_op_timeline_bad_context_parallel_size(
    tmp_path: Path, fuzz: ModuleType, line: str, needle: str
) -> None:
    folder = _op(tmp_path, fuzz)
    meta = folder / "meta-F.yaml"
    meta.write_text(meta.read_text() + line + "\n")
    msg = _refused(tmp_path, [folder], needle)
    assert "meta-F.yaml" in msg


def _set_row(column: str, row: int, value: int, dtype: type[pl.DataType]) -> Callable:
    """A change of the parquet frame putting ``value`` (as ``dtype``) at ``row`` of ``column``."""

    def change(df: pl.DataFrame) -> pl.DataFrame:
        at = pl.int_range(pl.len()) == row
        return df.with_columns(
            pl.when(at)
            .then(pl.lit(value, dtype))
            .otherwise(pl.col(column).cast(dtype))
            .alias(column)
        )

    return change


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (_set_row("rank", 5, 1 << 40, pl.Int64), "row 5: `rank` is 1099511627776"),
        (_set_row("dp_rank", 3, 1 << 40, pl.Int64), "row 3: `dp_rank` is 1099511627776"),
        (_set_row("stage", 9, 1 << 33, pl.Int64), "row 9: `stage` is 8589934592"),
        (_set_row("step", 2, (1 << 64) - 1, pl.UInt64), "row 2: `step` is 18446744073709551615"),
        (
            _set_row("seq_id", 4, (1 << 64) - 1, pl.UInt64),
            "row 4: `seq_id` is 18446744073709551615",
        ),
    ],
)
def test_op_timeline_value_past_its_column_type_names_the_row(
    tmp_path: Path, fuzz: ModuleType, change: Callable, needle: str
) -> None:
    folder = _op(tmp_path, fuzz)
    pq = folder / "trace-F.parquet"
    change(pl.read_parquet(pq)).write_parquet(pq)
    _refused(tmp_path, [folder], needle)


# -- host execution traces ------------------------------------------------------------------------

_TENSOR = (1, 2, 0, 4, 4, "cuda:0")  # [id, storage, offset, numel, itemsize, device]: 16 bytes
_PG_INIT = "## process_group:init ##"


def _node(
    nid: int,
    name: str,
    values: Sequence[Any] = (),
    types: Sequence[str] = (),
    attrs: dict[str, Any] | None = None,
    outs: Sequence[Any] = (),
) -> dict[str, Any]:
    """A node of the 1.0.2+ layout (``ctrl_deps``, ``inputs``/``outputs`` objects, ``attrs``)."""
    return {
        "id": nid,
        "name": name,
        "ctrl_deps": 1,
        "inputs": {"values": list(values), "shapes": [[] for _ in values], "types": list(types)},
        "outputs": {"values": list(outs), "shapes": [[] for _ in outs], "types": []},
        "attrs": [{"name": k, "type": "x", "value": v} for k, v in (attrs or {}).items()],
    }


def _group(**fields: Any) -> dict[str, Any]:
    """The world group of two ranks as ``## process_group:init ##`` lists it."""
    return {
        "pg_name": "0",
        "pg_desc": "default_pg",
        "backend_config": "cuda:nccl",
        "ranks": [0, 1],
        "group_size": 2,
        **fields,
    }


def _rpc(
    nid: int = 3,
    pg: Any = ("0", "default_pg"),
    tensor: Sequence[Any] = _TENSOR,
    name: str = "allreduce",
    attrs: dict[str, Any] | None = None,
    outs: Sequence[Any] = (),
) -> dict[str, Any]:
    """A ``record_param_comms`` node: ``[tensor, seq, pg, rank, name, in_split, out_split]``."""
    values = [list(tensor), 0, list(pg) if isinstance(pg, tuple) else pg, 0, name, [], []]
    types = [
        "Tensor(float)",
        "Int",
        "Tuple[String,String]",
        "Int",
        "String",
        *["GenericList[]"] * 2,
    ]
    return _node(nid, "record_param_comms", values, types, attrs, outs)


def _doc(*nodes: dict[str, Any], group: dict[str, Any] | None = None) -> dict[str, Any]:
    init = _node(2, _PG_INIT, [json.dumps([group or _group()])], ["String"])
    root = _node(1, "[pytorch|profiler|execution_trace|process]")
    return {"schema": "1.1.0-chakra.0.0.4", "pid": 1, "nodes": [root, init, *nodes]}


def _et(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "rank0.et.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def base_is_valid(tmp_path: Path) -> None:
    """The trace each case damages in one field reads, with its one collective: the refusal is
    the damage's doing."""
    base = tmp_path / "base"
    base.mkdir()
    t = read_host_et(_et(base, _doc(_rpc())))
    assert t.collectives.select("group_name", "in_bytes", "group_size").rows() == [("0", 16, 2)]
    assert t.comm_groups["description"].to_list() == ["default_pg"]


@pytest.mark.usefixtures("base_is_valid")
@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"pg_desc": 7}, "process group '0': `pg_desc` is int 7, expected a string"),
        ({"backend_id": [1]}, "process group '0': `backend_id` is list [1], expected an integer"),
        ({"backend_config": {"cuda": "nccl"}}, "`backend_config` is object"),
        ({"ranks": "0,1"}, "process group '0': `ranks` is string '0,1', expected a list"),
        ({"pg_name": ["0"]}, "`pg_name` is list ['0'], expected a string"),
    ],
)
def test_host_et_bad_process_group_field(
    tmp_path: Path, fields: dict[str, Any], needle: str
) -> None:
    path = _et(tmp_path, _doc(_rpc(), group=_group(**fields)))
    msg = _refused(tmp_path, [path], needle)
    assert "node 2 (nodes[1])" in msg


@pytest.mark.usefixtures("base_is_valid")
def test_host_et_bad_process_group_field_in_distributed_info(tmp_path: Path) -> None:
    doc = _doc(_rpc(pg=7))
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] != _PG_INIT]
    doc["distributedInfo"] = {"pg_config": [_group(backend_id=[7])]}
    _refused(tmp_path, [_et(tmp_path, doc)], "distributedInfo.pg_config: process group '0'")


@pytest.mark.usefixtures("base_is_valid")
def test_host_et_backend_that_is_not_text(tmp_path: Path) -> None:
    doc = _doc(_rpc())
    doc["distributedInfo"] = {"backend": 5}
    _refused(tmp_path, [_et(tmp_path, doc)], "distributedInfo.backend is int 5")


_HUGE = [1, 2, 0, 10**19, 4, "cuda:0"]  # 4e19 bytes: past BIGINT


@pytest.mark.usefixtures("base_is_valid")
@pytest.mark.parametrize(
    ("node", "needle"),
    [
        (_rpc(pg=[1, 2]), "`inputs[2] (the process group)` is list [1, 2], expected a (name, desc"),
        (_rpc(pg={"name": "0"}), "`inputs[2] (the process group)` is object"),
        (_rpc(tensor=_HUGE), "`inputs` is list [1, 2, 0, 10000000000000000000, 4, 'cuda:0']"),
        (_rpc(tensor=[1, 2, 0, -4, 4, "cuda:0"]), "`inputs` is list [1, 2, 0, -4, 4"),
        (_rpc(outs=[[list(_TENSOR), _HUGE]]), "`outputs` is list [1, 2, 0, 10000000000000000000"),
        (
            _rpc(attrs={"in_msg_nelems": 1 << 62}),
            "`attrs.in_msg_nelems` is int 4611686018427387904",
        ),
        (_rpc(attrs={"out_msg_nelems": -1}), "`attrs.out_msg_nelems` is int -1"),
        (_rpc(pg=["5", "x"], attrs={"pg_size": 10**12}), "`attrs.pg_size` is int 1000000000000"),
        (_rpc(attrs={"pg_size": "2"}), "`attrs.pg_size` is string '2', expected an integer"),
        (_rpc(attrs={"pg_name": 5}), "`attrs.pg_name` is int 5, expected a string"),
        (
            _rpc(name="send", attrs={"global_rank_start": 0, "global_rank_stride": "2"}),
            "`attrs.global_rank_stride` is string '2', expected an integer",
        ),
        (
            _rpc(name="recv", attrs={"global_rank_start": 0, "global_rank_stride": [1]}),
            "`attrs.global_rank_stride` is list [1], expected an integer",
        ),
    ],
)
def test_host_et_bad_comm_node_value(tmp_path: Path, node: dict[str, Any], needle: str) -> None:
    msg = _refused(tmp_path, [_et(tmp_path, _doc(node))], needle)
    assert "node 3 (nodes[2]) record_param_comms:" in msg


@pytest.mark.usefixtures("base_is_valid")
@pytest.mark.parametrize("rf_id", ["abc", [1], 1.5])
def test_host_et_node_level_rf_id_of_the_new_layout(tmp_path: Path, rf_id: object) -> None:
    """1.0.2+ keeps rf_id in ``attrs``, but the comm decoding falls back to a node-level one: a
    string there sorted the collectives as text; a list broke the frame."""
    bad = _rpc(nid=4)
    bad["rf_id"] = rf_id
    doc = _doc(_rpc(attrs={"rf_id": 5}), bad)
    msg = _refused(tmp_path, [_et(tmp_path, doc)], "node 4 (nodes[3]): `rf_id` is")
    assert msg.endswith("expected an integer")
