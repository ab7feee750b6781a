"""Fuzz `prism ingest` with mutated traces of all four formats: refused cleanly, or accepted as is.

Question: does any bad input crash ingest (a traceback), hang it, blow its memory, leave a partial
write, or get accepted with values it should have refused?

Every case takes a seed job (a few real or bundled trace files), mutates one file (bytes: cuts,
flips, chunk deletes/duplicates, non-UTF-8, empty; structure: wrong types, missing keys, deep
nesting, huge strings, out-of-range ranks and times; gzip bombs; FIFOs and symlinks to devices;
a good file beside a bad one, a rank given twice), writes it gzipped or plain, and ingests it into a
copy of a store that already holds a run, either in-process or through the `prism` CLI. Each case
runs under a time limit (``--timeout``, 30 s) and an address-space limit (``--mem-limit-gb``, 4 GB),
and its peak RSS is measured.

A case passes when it is

- refused with one line that names the file, by a ``PrismError`` (CLI: exit 1, one ``error:``
  line, no traceback), with the store's row counts unchanged; or
- accepted with data identical to the unmutated seed's (a digest of every table of the run).

Mutations that leave a valid trace by construction (a UTF-8 BOM, whitespace, an unknown key) are
``valid``: they must be accepted as is (a host ET keeps a node's unknown key in its ``attrs``:
``accepted_kept_key`` when the data is the seed's but for that key). A byte-level mutation (a
flip, a chunk deleted or duplicated) may also yield a valid trace with other values: a string
changed, a float changed in a parquet page, whole JSON events removed. Accepted data that
differs from the seed's is therefore judged by an independent check of the mutated input
(``benchmarks/_fuzz_oracle.py``: the format's own decoder and schema, no prism code) and by the
store's invariants (no negative time, ranks within the world, ...): ``accepted_other`` when both
hold, ``invalid_accepted`` otherwise. A Chakra file cut exactly at a record boundary is a valid,
shorter graph byte for byte; accepted, it is ``cut_undetectable`` when it states no node count
(``invalid_accepted`` when it does), and the note lists every such case.

    python benchmarks/fuzz_ingest.py [--cases 1100] [--jobs 2] [--seed 18] [--cli-every 16]

Seeds: the bundled sample (``datasets/sample``) and, when present, ``../shared/datasets`` (DLRM
Kineto + host ET, the ST op timeline, Chakra ETs); small synthetic Chakra and op-timeline seeds are
made here so the bundled sample alone covers all four formats. Writes
``benchmarks/results/fuzz-ingest_<host>_<date>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import hashlib
import json
import os
import queue
import random
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARED = Path(os.environ.get("PRISM_SHARED_DATASETS", HERE.parents[1] / "shared" / "datasets"))

# -- seeds ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seed:
    """A job to mutate: ``folder`` holds its files; ``target`` is the one mutated."""

    name: str
    format: str  # kineto | host_et | chakra | op_timeline
    folder: Path
    target: str  # file name inside folder
    inputs: tuple[str, ...]  # what is passed to ingest, relative to the case folder ("." = it)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _synthetic_chakra(path: Path, *, world: int, nodes: int) -> None:
    """A small Chakra ET of one rank: compute nodes, a collective, forward dependencies."""
    from prism_trace.formats.chakra import chakra_pb2 as pb

    gm = pb.GlobalMetadata(version="0.0.4")
    a = gm.attr.add(name="world_size")
    a.int64_val = world
    recs = [gm.SerializeToString()]
    for i in range(nodes):
        kind = pb.COMM_COLL_NODE if i % 5 == 4 else pb.COMP_NODE
        n = pb.Node(id=i + 1, name=f"op{i}", type=kind, duration_micros=10 + i)
        if kind == pb.COMM_COLL_NODE:
            c = n.attr.add(name="comm_type")
            c.int64_val = pb.ALL_REDUCE
            s = n.attr.add(name="comm_size")
            s.int64_val = 1 << 20
        # Every third node is a side node that depends forward (as the PyTorch converter
        # writes) on a later one; the chain of data deps goes round it, so nothing waits on it
        # and no cycle forms (a cut at a record boundary still leaves it a missing dependency).
        side = i % 3 == 0 and i + 2 < nodes
        if i:
            n.data_deps.append(i - 1 if (i - 1) % 3 == 0 and i - 1 + 2 < nodes and i > 1 else i)
        if side and i:
            n.ctrl_deps.append(i + 3)
        recs.append(n.SerializeToString())
    path.write_bytes(b"".join(_varint(len(r)) + r for r in recs))


def _synthetic_op_timeline(folder: Path) -> None:
    """A dp2 x pp2 op timeline of two steps, with its meta yaml."""
    import polars as pl

    rows = []
    for step in (3, 4):
        for dp in range(2):
            for stage in range(2):
                ops = [
                    ("params-all-gather", 0.0, 0.01),
                    ("forward-compute", 0.02, 0.1),
                    ("forward-send" if stage == 0 else "forward-recv", 0.12, 0.01),
                    ("backward-recv" if stage == 0 else "backward-send", 0.3, 0.01),
                    ("backward-compute", 0.32, 0.2),
                    ("grads-reduce-scatter", 0.7, 0.05),
                    ("optimizer", 0.8, 0.05),
                ]
                rows += [
                    {
                        "dp_rank": dp,
                        "stage": stage,
                        "rank": stage * 2 + dp,
                        "step": step,
                        "optype": name,
                        "start_ts": start + 0.001 * dp,
                        "duration": dur,
                        "seq_id": 0,
                    }
                    for name, start, dur in ops
                ]
    df = pl.DataFrame(rows).with_columns(
        pl.col("dp_rank", "stage").cast(pl.Int8),
        pl.col("rank").cast(pl.Int16),
        pl.col("optype").cast(pl.Categorical),
        pl.col("start_ts", "duration").cast(pl.Float32),
        pl.col("seq_id").cast(pl.Int32),
    )
    df.write_parquet(folder / "trace-F.parquet")
    (folder / "meta-F.yaml").write_text("dp_size: 2\npp_size: 2\ntp_size: 1\nworld_size: 4\n")


def _prism_export(op_timeline: Path, out: Path) -> None:
    """Ingest an op timeline and export it with prism's Chakra export (4 files, ``opt.<r>.et``)."""
    from prism_trace.export.chakra.writer import export_chakra
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    work = out.with_name(out.name + "-store")
    work.mkdir(parents=True, exist_ok=True)
    with open_store(work / "s.duckdb") as store:
        ingest(store, [op_timeline], run="opt", progress=False)
        export_chakra(store, run="opt", out_dir=out, prefix="opt")
    for extra in out.iterdir():
        if not extra.name.endswith(".et"):
            extra.unlink()
    shutil.rmtree(work)


def _small_kineto(src: Path, dst: Path, keep: int) -> None:
    """The first ``keep`` records of a Kineto trace (the rest of the object kept): a small seed."""
    doc = json.loads(gzip.decompress(src.read_bytes()))
    doc["traceEvents"] = doc["traceEvents"][:keep]
    dst.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=6))


def _small_host_et(src: Path, dst: Path, keep: int) -> None:
    """The first ``keep`` nodes of a host ET (parents beyond them become roots): a small seed."""
    doc = json.loads(gzip.decompress(src.read_bytes()))
    doc["nodes"] = doc["nodes"][:keep]
    dst.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=6))


def make_seeds(root: Path, *, shared: bool = True) -> list[Seed]:
    """Build the seed jobs under ``root`` (copies, so mutations never touch the originals)."""
    seeds: list[Seed] = []
    sample = REPO / "datasets" / "sample"
    root.mkdir(parents=True, exist_ok=True)

    def add(name: str, fmt: str, files: dict[str, Path | None], target: str, inputs=None) -> None:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for fname, src in files.items():
            if src is not None and not (folder / fname).exists():
                shutil.copyfile(src, folder / fname)
        seeds.append(Seed(name, fmt, folder, target, tuple(inputs or files)))

    # Kineto: a cut-down sample rank (small, so that accepted cases are quick) and a real DLRM rank
    small = root / "_kineto_small.json.gz"
    _small_kineto(sample / "rank0.kineto.json.gz", small, 3000)
    add("sample-kineto", "kineto", {"rank0.kineto.json.gz": small}, "rank0.kineto.json.gz")
    small_et = root / "_host_et_small.json.gz"
    _small_host_et(sample / "rank1.et.json.gz", small_et, 2500)
    add("sample-host-et", "host_et", {"rank1.et.json.gz": small_et}, "rank1.et.json.gz")
    # multi-file rollback: a good rank beside the mutated one
    small1 = root / "_kineto_small1.json.gz"
    _small_kineto(sample / "rank1.kineto.json.gz", small1, 3000)
    add(
        "sample-pair",
        "kineto",
        {"rank0.kineto.json.gz": small, "rank1.kineto.json.gz": small1},
        "rank1.kineto.json.gz",
    )
    chakra = root / "synthetic-chakra"
    chakra.mkdir(parents=True, exist_ok=True)
    _synthetic_chakra(chakra / "job.1.et", world=4, nodes=60)
    add("synthetic-chakra", "chakra", {"job.1.et": chakra / "job.1.et"}, "job.1.et")
    opt = root / "synthetic-op-timeline"
    opt.mkdir(parents=True, exist_ok=True)
    _synthetic_op_timeline(opt)
    seeds.append(Seed("synthetic-op-timeline", "op_timeline", opt, "trace-F.parquet", (".",)))
    # prism's own Chakra export (it states each file's node count) of that op timeline, 4 ranks
    exported = root / "prism-export-chakra"
    if not exported.is_dir():
        _prism_export(opt, exported)
    ranks = {p.name: p for p in sorted(exported.glob("*.et"))}
    add("prism-export-chakra", "chakra", ranks, "opt.1.et")
    if shared and SHARED.is_dir():
        dlrm = SHARED / "param-dlrm-8rank"
        k0 = next((dlrm / "kineto").glob("worker0_*"), None)
        if k0 is not None:
            add("dlrm-kineto", "kineto", {k0.name: k0}, k0.name)
        et0 = dlrm / "et" / "dlrm_eg_0.json.gz"
        if et0.is_file():
            add("dlrm-host-et", "host_et", {et0.name: et0}, et0.name)
        st = SHARED / "megatron-straggler-st-8rank"
        if (st / "trace-ST.parquet").is_file():
            add(
                "st-op-timeline",
                "op_timeline",
                {"trace-ST.parquet": st / "trace-ST.parquet", "meta-ST.yaml": st / "meta-ST.yaml"},
                "trace-ST.parquet",
                (".",),
            )
        # The converter's 1.1.0 file: its 1.0.1 one holds dependency cycles, refused by default.
        head = SHARED / "chakra-et" / "chakra_tests" / "chakra.0.et_schema1.1.0_commit-e366cf2.gz"
        if head.is_file():
            add("chakra-head", "chakra", {"chakra.0.et": None}, "chakra.0.et")
            dst = root / "chakra-head" / "chakra.0.et"
            if not dst.exists():
                dst.write_bytes(gzip.decompress(head.read_bytes()))
        # a foreign multi-rank job without node counts: 4 of ResNet-50's 64 data-parallel ranks
        rn = SHARED / "chakra-et" / "astrasim_et_examples" / "resnet50_dp_64npus_text_converted"
        rn_files = {
            f"Resnet50_DataParallel.{r}.et": rn / f"Resnet50_DataParallel.{r}.et" for r in range(4)
        }
        if all(p.is_file() for p in rn_files.values()):
            add("resnet-chakra-4", "chakra", rn_files, "Resnet50_DataParallel.2.et")
        ar = SHARED / "chakra-et" / "astrasim_et_examples" / "microbenchmarks" / "all_reduce"
        ar0 = ar / "4npus_1MB" / "all_reduce.0.et"
        if ar0.is_file():
            add("astrasim-allreduce", "chakra", {ar0.name: ar0}, ar0.name)
    return seeds


# -- mutations -----------------------------------------------------------------------------------

# kind of outcome a mutation allows: "invalid" must be refused (or change nothing), "valid" must be
# accepted as is, "any" may also be accepted with other data if every invariant holds
BYTE_MUTATIONS = {
    "truncate": "invalid",
    "empty": "invalid",
    "byte_flip": "any",
    "chunk_delete": "any",
    "chunk_duplicate": "any",
    "non_utf8": "invalid",
    "gz_truncate": "invalid",
    "gz_flip": "invalid",
}
JSON_MUTATIONS = {
    "wrong_type": "invalid",
    "missing_key": "invalid",
    "deep_nesting": "invalid",
    "huge_string_unknown_key": "valid",
    "bad_rank": "invalid",
    "bad_world": "invalid",
    "bom": "valid",
    "whitespace": "valid",
    "duplicate_rank": "invalid",
}
KINETO_ONLY = {
    "bad_base_time": "invalid",
    "negative_dur": "invalid",
    "no_ph": "invalid",
    "empty_events": "invalid",
    "duplicate_trace_events": "invalid",
}
HOST_ET_ONLY = {
    "duplicate_id": "invalid",
    "nan_rf_id": "invalid",
    "self_parent": "invalid",
    "parent_cycle": "invalid",
    "empty_nodes": "invalid",
}
# issue 33's readers: a key twice at any depth, a world size two files disagree on, a file name
# that is not UTF-8 (JSON formats and Chakra alike)
ROUND3_MUTATIONS = {"duplicate_key": "invalid"}
JOB_MUTATIONS = {"world_disagree": "invalid", "non_utf8_name": "invalid"}
CHAKRA_MUTATIONS = {
    "record_truncate": "invalid",
    "metadata_only": "invalid",
    "duplicate_node": "invalid",
    "zero_records": "invalid",
    "huge_record_length": "invalid",
    "missing_forward_dep": "invalid",
    "huge_duration": "invalid",
    "bad_world": "invalid",
    "duplicate_rank": "invalid",
    "data_cycle": "invalid",
    "ctrl_cycle": "invalid",
    "peer_outside_world": "invalid",
}
OP_MUTATIONS = {
    "duplicate_rows": "invalid",
    "negative_duration": "invalid",
    "nonfinite": "invalid",
    "huge_time": "invalid",
    "bool_column": "invalid",
    "struct_column": "invalid",
    "string_rank": "invalid",
    "missing_column": "invalid",
    "meta_world": "invalid",
    "meta_contradiction": "invalid",
    "meta_binary": "invalid",
    "meta_deep": "invalid",
    "rank_outside_world": "invalid",
    "meta_duplicate_key": "invalid",
    "result_duplicate_key": "invalid",
}
SPECIAL = {
    "fifo": "invalid",
    "symlink_dev_zero": "invalid",
    "symlink_fifo": "invalid",
    "dangling_symlink": "invalid",
    "bomb": "invalid",
}

UNKNOWN_KEY = "x_unknown"
"""The key ``huge_string_unknown_key`` adds to one event or node (its value: 1 or 8 MB of x)."""

_KINETO_FIELDS = {
    "ph": "str",
    "ts": "num",
    "dur": "num",
    "name": "str",
    "pid": "id",
    "tid": "id",
    "cat": "optional_str",
    "args": "obj",
}
_WRONG = {
    "str": [1, True, None, [1], {"a": 1}],
    # `cat` may be absent (instant events have none), and a JSON null for an optional member
    # reads as absent (prism's reader and the independent check alike): not a wrong type
    "optional_str": [1, True, [1], {"a": 1}],
    "num": ["12", True, None, [1], {"a": 1}, "NaN", 1e300, -(2**70)],
    "id": [True, None, [1], {"a": 1}, 1.5],
    "obj": ["x", 3, True, [1]],
}
_OLD_ET_FIELDS = {
    "id": "int",
    "name": "str",
    "parent": "int",
    "rf_id": "int",
    "tid": "int",
    "inputs": "list",
    "op_schema": "str",
}
_NEW_ET_FIELDS = {
    "id": "int",
    "name": "str",
    "ctrl_deps": "int",
    "inputs": "dict",
    "outputs": "dict",
    "attrs": "list",
}
_WRONG_ET = {
    "int": ["7", True, 1.5, [1], {"a": 1}],
    "str": [1, True, [1], {"a": 1}],
    "list": ["x", 3, True, {"a": 1}],
    "dict": ["x", 3, True, [1]],
}


def mutations_for(fmt: str) -> dict[str, str]:
    """Every mutation that applies to a format, with the outcome it allows."""
    if fmt == "kineto":
        return {
            **BYTE_MUTATIONS,
            **JSON_MUTATIONS,
            **KINETO_ONLY,
            **ROUND3_MUTATIONS,
            **JOB_MUTATIONS,
            **SPECIAL,
        }
    if fmt == "host_et":
        return {
            **BYTE_MUTATIONS,
            **JSON_MUTATIONS,
            **HOST_ET_ONLY,
            **ROUND3_MUTATIONS,
            **JOB_MUTATIONS,
            **SPECIAL,
        }
    if fmt == "chakra":
        return {**BYTE_MUTATIONS, **CHAKRA_MUTATIONS, **JOB_MUTATIONS, **SPECIAL}
    skip = {"non_utf8", "gz_truncate", "gz_flip", "bomb"}
    return {
        **{k: v for k, v in BYTE_MUTATIONS.items() if k not in skip},
        **OP_MUTATIONS,
        "non_utf8_name": "invalid",
        **{k: v for k, v in SPECIAL.items() if k not in skip},
    }


def _read_payload(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _plain_name(name: str) -> str:
    return name.removesuffix(".gz")


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


def _pick_event(rng: random.Random, events: list[Any], pred) -> int:
    idx = [i for i, e in enumerate(events) if isinstance(e, dict) and pred(e)]
    return rng.choice(idx) if idx else 0


def mutate_json(fmt: str, kind: str, payload: bytes, rng: random.Random) -> bytes:
    """A structural mutation of a Kineto or host-ET document."""
    if kind == "bom":
        return b"\xef\xbb\xbf" + payload
    if kind == "whitespace":
        return b"\n \t" * rng.randint(1, 5000) + payload + b"\n" * rng.randint(1, 5000)
    doc = json.loads(payload)
    if kind == "duplicate_key":
        return _duplicate_key(doc, rng)
    if kind == "duplicate_trace_events":
        events = doc.pop("traceEvents")
        first, second = ([], events) if rng.random() < 0.5 else (events, [])
        body = _dumps({**doc, "traceEvents": first})[:-1]
        return body + b', "traceEvents": ' + _dumps(second) + b"}"
    items = doc["traceEvents"] if fmt == "kineto" else doc["nodes"]
    new_layout = fmt == "host_et" and any(isinstance(n.get("inputs"), dict) for n in items[:8])
    if fmt == "kineto":
        i = _pick_event(rng, items, lambda e: e.get("ph") == "X")
        fields = _KINETO_FIELDS
        wrong = _WRONG
    else:
        i = rng.randrange(len(items))
        fields = _NEW_ET_FIELDS if new_layout else _OLD_ET_FIELDS
        wrong = _WRONG_ET
    ev = items[i]
    if kind == "wrong_type":
        key = rng.choice(sorted(fields))
        value = rng.choice(wrong[fields[key]])
        if value == "NaN" and fields[key] == "num":
            ev[key] = float("nan")
        else:
            ev[key] = value
    elif kind == "missing_key":
        keys = ["ph", "ts", "dur", "name", "pid", "tid"] if fmt == "kineto" else ["id", "name"]
        if rng.random() < 0.15:
            doc.pop("traceEvents" if fmt == "kineto" else rng.choice(["nodes", "schema"]))
        else:
            ev.pop(rng.choice(keys), None)
    elif kind == "deep_nesting":
        depth = rng.choice([2000, 100_000])
        ev["x_deep"] = "__DEEP__"
        return _dumps(doc).replace(b'"__DEEP__"', b"[" * depth + b"]" * depth, 1)
    elif kind == "huge_string_unknown_key":
        ev[UNKNOWN_KEY] = "x" * rng.choice([1 << 20, 8 << 20])
    elif kind in ("bad_rank", "duplicate_rank"):
        info = doc.setdefault("distributedInfo", {})
        if kind == "duplicate_rank":
            raise _Unsupported  # made at the job level (see make_case)
        info["rank"] = rng.choice([-1, 2**70, "0", 10**9, True, 1.5, 1 << 20])
    elif kind == "bad_world":
        info = doc.setdefault("distributedInfo", {"rank": 0})
        info["world_size"] = rng.choice([0, -4, 10**11, "8", True, 2.5, 1 << 21])
    elif kind == "bad_base_time":
        doc["baseTimeNanoseconds"] = rng.choice([2**70, -5, "1", True, 1e300])
    elif kind == "negative_dur":
        ev["dur"] = -rng.randint(1, 10**6)
    elif kind == "no_ph":
        for e in items:
            if isinstance(e, dict):
                e.pop("ph", None)
    elif kind == "duplicate_id":
        j = rng.randrange(len(items))
        items[j]["id"] = items[(j + 1) % len(items)]["id"]
    elif kind in ("empty_events", "empty_nodes"):
        items.clear()
    elif kind == "self_parent":
        key = "ctrl_deps" if new_layout else "parent"
        j = rng.randrange(1, len(items)) if len(items) > 1 else 0
        items[j][key] = items[j]["id"]
        if items[j]["name"].endswith("|process]"):
            items[j]["name"] = "aten::add"  # only the process root may be its own parent
    elif kind == "parent_cycle":
        key = "ctrl_deps" if new_layout else "parent"
        k = rng.randint(2, 4)
        picked = rng.sample(range(1, len(items)), min(k, len(items) - 1))
        for a, b in zip(picked, [*picked[1:], picked[0]], strict=True):
            items[a][key] = items[b]["id"]
    elif kind == "nan_rf_id":
        if new_layout:
            ev.setdefault("attrs", []).append({"name": "rf_id", "type": "uint64", "value": 0})
            ev["attrs"][-1]["value"] = float("nan")
        else:
            ev["rf_id"] = float("nan")
    else:
        raise ValueError(kind)
    return _dumps(doc)


class _Unsupported(Exception):
    pass


_DUP = "__prism_fuzz_duplicate__"


def _duplicate_key(doc: Any, rng: random.Random) -> bytes:
    """``doc`` with one key of one object (at any depth: the top level, an event or node, its
    ``args`` or ``inputs``...) stated twice, with the same or another value."""
    objects: list[dict[str, Any]] = []
    at: Any = doc
    while True:
        if isinstance(at, dict) and at:
            objects.append(at)
        kids = (
            [v for v in at.values() if isinstance(v, (dict, list)) and v]
            if isinstance(at, dict)
            else [v for v in at if isinstance(v, (dict, list)) and v]
            if isinstance(at, list)
            else []
        )
        if not kids or (objects and rng.random() < 0.3):
            break
        at = rng.choice(kids)
    obj = rng.choice(objects)
    key = rng.choice(sorted(obj))
    value = obj[key] if rng.random() < 0.5 else rng.choice([0, "x", [], {}, None])
    obj[_DUP] = 0
    return _dumps(doc).replace(_dumps(_DUP) + b": 0", _dumps(key) + b": " + _dumps(value), 1)


def _records(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        size, shift = 0, 0
        while True:
            b = data[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        out.append(data[pos : pos + size])
        pos += size
    return out


def _frame(recs: list[bytes]) -> bytes:
    return b"".join(_varint(len(r)) + r for r in recs)


def mutate_chakra(kind: str, payload: bytes, rng: random.Random) -> bytes:
    """A structural mutation of a Chakra ET stream."""
    from prism_trace.formats.chakra import chakra_pb2 as pb

    recs = _records(payload)
    if kind == "record_truncate":
        if len(recs) <= 2:
            return _frame(recs[:1])
        return _frame(recs[: rng.randrange(1, len(recs))])
    if kind == "metadata_only":
        return _frame(recs[:1])
    if kind == "duplicate_node":
        k = rng.randrange(1, len(recs))
        return _frame([*recs[: k + 1], recs[k], *recs[k + 1 :]])
    if kind == "zero_records":
        return _frame(recs) + b"\x00" * rng.choice([10, 100_000])
    if kind == "huge_record_length":
        return _frame(recs) + _varint(rng.choice([1 << 31, 1 << 40, (1 << 63) - 1])) + b"\x08"
    nodes = [pb.Node.FromString(r) for r in recs[1:]]
    n = rng.randrange(len(nodes))
    if kind in ("data_cycle", "ctrl_cycle"):
        if len(nodes) < 2:
            raise _Unsupported
        # a node made to wait on one that (transitively, or by this edge too) waits on it
        a = nodes[n]
        after = [x for x in nodes if a.id in x.data_deps or a.id in x.ctrl_deps]
        b = rng.choice(after) if after else rng.choice([x for x in nodes if x is not a])
        deps = a.data_deps if kind == "data_cycle" else a.ctrl_deps
        deps.append(b.id)
        if not after:
            (b.data_deps if kind == "data_cycle" else b.ctrl_deps).append(a.id)
    elif kind == "peer_outside_world":
        gm = pb.GlobalMetadata.FromString(recs[0])
        if not any(x.name == "world_size" for x in gm.attr):
            gm.attr.add(name="world_size").int64_val = 64
            recs[0] = gm.SerializeToString()
        send = pb.Node(id=max(x.id for x in nodes) + 1, name="send", type=pb.COMM_SEND_NODE)
        for k, v in (("comm_dst", rng.choice([100, 10**5, (1 << 20) - 1])), ("comm_size", 64)):
            send.attr.add(name=k).int64_val = v
        send.attr.add(name="comm_tag").int64_val = 7
        nodes.append(send)
    elif kind == "missing_forward_dep":
        nodes[n].ctrl_deps.append(max(x.id for x in nodes) + rng.randint(1, 1000))
    elif kind == "huge_duration":
        nodes[n].duration_micros = rng.choice([1 << 63, (1 << 64) - 1])
    elif kind == "bad_world":
        gm = pb.GlobalMetadata.FromString(recs[0])
        a = gm.attr.add(name="world_size")
        a.int64_val = rng.choice([0, -3, 10**11, 1 << 21])
        recs[0] = gm.SerializeToString()
    else:
        raise ValueError(kind)
    return _frame([recs[0], *(x.SerializeToString() for x in nodes)])


def mutate_op_timeline(kind: str, folder: Path, target: str, rng: random.Random) -> None:
    """A mutation of an op-timeline parquet or its meta yaml, in place in ``folder``."""
    import polars as pl

    pq = folder / target
    meta = next(folder.glob("meta*.yaml"))
    if kind == "result_duplicate_key":
        result = folder / ("result-" + pq.stem.split("-", 1)[-1] + ".json")
        result.write_text(
            rng.choice(
                [
                    '{"step_t_base": {"1": 2.0}, "step_t_base": [1]}',
                    '{"step_t_base": {"1": 2.0, "1": 3.0}}',
                    '{"job_meta": {"dp_size": 1, "dp_size": 2}, "step_t_base": {}}',
                ]
            )
        )
        return
    if kind.startswith("meta_"):
        if kind == "meta_duplicate_key":
            lines = [ln for ln in meta.read_text().splitlines() if ":" in ln]
            line = rng.choice(lines)
            meta.write_text(meta.read_text() + line.split(":")[0] + ": 3\n")
        elif kind == "meta_world":
            meta.write_text(
                meta.read_text() + f"world_size: {rng.choice([10**11, 0, -1, 1 << 21, 'x'])}\n"
            )
        elif kind == "meta_contradiction":
            text = meta.read_text()
            meta.write_text(text.replace("dp_size: 2", f"dp_size: {rng.choice([3, 4, 1000])}"))
        elif kind == "meta_binary":
            meta.write_bytes(bytes(rng.randrange(256) for _ in range(256)))
        else:
            meta.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
        return
    df = pl.read_parquet(pq)
    i = rng.randrange(df.height)
    if kind == "duplicate_rows":
        df = pl.concat([df, df.slice(i, rng.randint(1, 5))])
    elif kind in ("negative_duration", "nonfinite", "huge_time"):
        col = rng.choice(["start_ts", "duration"])
        value = {
            "negative_duration": -rng.uniform(0.001, 1.0),
            "nonfinite": rng.choice([float("inf"), float("nan"), float("-inf")]),
            "huge_time": 1e300 if df[col].dtype == pl.Float64 else 3e38,
        }[kind]
        df = df.with_columns(
            pl.when(pl.int_range(pl.len()) == i).then(value).otherwise(pl.col(col)).alias(col)
        ).with_columns(pl.col(col).cast(df[col].dtype))
    elif kind == "bool_column":
        col = rng.choice(["rank", "stage", "dp_rank", "step", "duration"])
        df = df.with_columns(pl.col(col).cast(pl.Int64) % 2 == 1)
    elif kind == "struct_column":
        col = rng.choice(["start_ts", "rank", "optype"])
        df = df.with_columns(pl.struct(pl.col(col).alias("v")).alias(col))
    elif kind == "string_rank":
        df = df.with_columns(pl.col("rank").cast(pl.Utf8))
    elif kind == "missing_column":
        df = df.drop(rng.choice(["rank", "step", "optype", "start_ts", "duration"]))
    elif kind == "rank_outside_world":
        df = df.with_columns(
            pl.when(pl.int_range(pl.len()) == i)
            .then(pl.lit(rng.choice([100, 10**6, 2**20 + 5])))
            .otherwise(pl.col("rank").cast(pl.Int64))
            .alias("rank")
        )
    else:
        raise ValueError(kind)
    df.write_parquet(pq)


def mutate_bytes(kind: str, payload: bytes, rng: random.Random) -> bytes:
    """A byte-level mutation of a (decompressed) payload."""
    n = len(payload)
    if kind == "truncate":
        return payload[: rng.randrange(1, n)]
    if kind == "empty":
        return b""
    if kind == "byte_flip":
        data = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(n)] ^= rng.choice([0x80, 0xFF, 1 << rng.randrange(7)])
        return bytes(data)
    if kind == "chunk_delete":
        a = rng.randrange(n)
        return payload[:a] + payload[a + rng.randint(1, max(1, min(n - a, 4096))) :]
    if kind == "chunk_duplicate":
        a = rng.randrange(n)
        chunk = payload[a : a + rng.randint(1, 4096)]
        return payload[: a + len(chunk)] + chunk + payload[a + len(chunk) :]
    if kind == "non_utf8":
        a = rng.randrange(n)
        return (
            payload[:a] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"]) + payload[a:]
        )
    raise ValueError(kind)


# -- cases ---------------------------------------------------------------------------------------


@dataclass
class Case:
    """One mutated input: which seed, which mutation, gzipped or plain, in-process or CLI."""

    id: int
    seed: str
    format: str
    mutation: str
    expect: str
    gz: bool
    via: str  # inproc | cli
    rng_seed: int


def plan(seeds: list[Seed], n: int, rng: random.Random, cli_every: int) -> list[Case]:
    """``n`` cases spread evenly over formats, seeds and mutations (round robin, then random)."""
    by_format: dict[str, list[Seed]] = {}
    for s in seeds:
        by_format.setdefault(s.format, []).append(s)
    combos = []
    for fmt, group in sorted(by_format.items()):
        for kind, expect in sorted(mutations_for(fmt).items()):
            for s in group:
                combos.append((s, kind, expect))
    rng.shuffle(combos)
    cases = []
    for i in range(n):
        s, kind, expect = combos[i % len(combos)]
        gz = (
            False
            if s.format == "op_timeline" or kind in ("gz_truncate", "gz_flip", "bomb")
            else rng.random() < 0.5
        )
        if kind in ("gz_truncate", "gz_flip", "bomb"):
            gz = True
        if kind == "duplicate_rank" and s.name == "sample-pair":
            kind = "bad_rank"
        via = "cli" if (kind == "bomb" or i % cli_every == 0) else "inproc"
        cases.append(Case(i, s.name, s.format, kind, expect, gz, via, rng.randrange(1 << 30)))
    return cases


def make_case(case: Case, seed: Seed, work: Path) -> tuple[list[Path], Path]:
    """Write the case's files under ``work``; return the ingest inputs and the mutated file."""
    rng = random.Random(case.rng_seed)
    shutil.copytree(seed.folder, work, symlinks=True)
    target = work / seed.target
    kind = case.mutation
    inputs = [work / p if p != "." else work for p in seed.inputs]
    if kind in SPECIAL and kind != "bomb":
        target.unlink()
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "symlink_dev_zero":
            target.symlink_to("/dev/zero")
        elif kind == "symlink_fifo":
            fifo = work / "_fifo"
            os.mkfifo(fifo)
            target.symlink_to(fifo)
        else:
            target.symlink_to(work / "nowhere")
        return inputs, target
    if kind == "non_utf8_name":
        odd = target.with_name(os.fsdecode(b"\xff" + os.fsencode(target.name)))
        target.rename(odd)
        return [p if p != target else odd for p in inputs], odd
    if kind == "world_disagree":
        ext = ".et" if case.format == "chakra" else ".json"
        others = [
            f for f in sorted(work.iterdir()) if f != target and ext in f.name and f.is_file()
        ]
        if not others:
            raise _Unsupported  # one file: nothing to disagree with
        a, b = rng.sample([64, 1000, 4096], 2)
        _restate_world(case.format, rng.choice(others), b)
        return inputs, _restate_world(case.format, target, a)
    if case.format == "op_timeline":
        if kind in BYTE_MUTATIONS:
            target.write_bytes(mutate_bytes(kind, target.read_bytes(), rng))
        else:
            mutate_op_timeline(kind, work, seed.target, rng)
        return inputs, target
    if kind == "bomb":  # written as <target>.gz: the inputs name it, not the removed target
        out = _bomb(case, seed, target, rng)
        return [p if p != target else out for p in inputs], out
    if kind == "duplicate_rank":
        # the same rank twice: a recompressed copy under another name in the job
        data = _read_payload(target)
        twin = work / ("again_" + _twin_name(seed.target))
        twin.write_bytes(gzip.compress(data, compresslevel=1))
        return [*inputs, twin], twin
    payload = _read_payload(target)
    if kind in ("gz_truncate", "gz_flip"):
        raw = bytearray(gzip.compress(payload, compresslevel=6))
        if kind == "gz_truncate":
            raw = raw[: rng.randrange(10, len(raw))]
        else:
            at = rng.randrange(10, len(raw))
            raw[at] ^= 1 << rng.randrange(8)
        out = target if target.name.endswith(".gz") else target.with_name(target.name + ".gz")
        target.unlink()
        out.write_bytes(bytes(raw))
        return [p if p != target else out for p in inputs], out
    if kind in BYTE_MUTATIONS:
        mutated = mutate_bytes(kind, payload, rng)
    elif case.format == "chakra":
        mutated = mutate_chakra(kind, payload, rng)
    else:
        mutated = mutate_json(case.format, kind, payload, rng)
    target.unlink()
    out = work / (_plain_name(seed.target) + (".gz" if case.gz else ""))
    out.write_bytes(gzip.compress(mutated, compresslevel=1) if case.gz else mutated)
    return [p if p != target else out for p in inputs], out


def _restate_world(fmt: str, target: Path, world: int) -> Path:
    """``target`` rewritten to state the world size ``world`` (larger than any rank of the
    seeds, so that it is fine on its own)."""
    from prism_trace.formats.chakra import chakra_pb2 as pb

    payload = _read_payload(target)
    if fmt == "chakra":
        recs = _records(payload)
        gm = pb.GlobalMetadata.FromString(recs[0])
        kept = [a for a in gm.attr if a.name != "world_size"]
        del gm.attr[:]
        gm.attr.extend(kept)
        gm.attr.add(name="world_size").int64_val = world
        out = _frame([gm.SerializeToString(), *recs[1:]])
    else:
        doc = json.loads(payload)
        doc.setdefault("distributedInfo", {})["world_size"] = world
        out = _dumps(doc)
    target.write_bytes(gzip.compress(out, compresslevel=1) if target.name.endswith(".gz") else out)
    return target


def _twin_name(name: str) -> str:
    return name.replace("worker0", "workerX").replace("rank", "r")


_BOMB_BYTES = 2_300 << 20  # 2.3 GiB expanded, as in the issue


def _bomb(case: Case, seed: Seed, target: Path, rng: random.Random) -> Path:
    """A gzip bomb of the format: 2.3 GiB of whitespace (JSON) or of zero bytes (Chakra)."""
    out = target.with_name(_plain_name(target.name) + ".gz")
    target.unlink()
    if case.format == "chakra":
        style = rng.choice(["zeros", "one_record"])
        head = (
            b""
            if style == "zeros"
            else _frame(_records(_read_payload(seed.folder / seed.target))[:1])
        )
        if style == "one_record":
            head += _varint(_BOMB_BYTES)
        fill, tail = b"\x00", b""
    else:
        payload = _read_payload(seed.folder / seed.target)
        key = b'"traceEvents"' if case.format == "kineto" else b'"nodes"'
        at = payload.index(key)
        close = payload.index(b"[", at) + 1
        head, fill, tail = payload[:close], b" ", payload[close:]
    _write_gzip_fill(out, head, fill, _BOMB_BYTES, tail)
    return out


@functools.cache
def _gzip_member(fill: bytes, count: int) -> bytes:
    """gzip(fill * count) at the default level, made once per process: most of a bomb's cost,
    and the same for every bomb of a format."""
    return gzip.compress(fill * count, compresslevel=6)


def _write_gzip_fill(out: Path, head: bytes, fill: bytes, count: int, tail: bytes) -> None:
    """gzip(head + fill * count + tail) as concatenated gzip members (valid gzip, as ``gzip -c a
    b`` writes): one 64 MB block of ``fill`` is compressed once and repeated, at gzip's default
    level, so a 2.3 GiB bomb is ~2.3 MB and takes a second to make."""
    block = 64 << 20
    member = _gzip_member(fill, block)
    rest = gzip.compress(fill * (count % block) + tail, compresslevel=6)
    with out.open("wb") as fh:
        fh.write(gzip.compress(head, compresslevel=6))
        for _ in range(count // block):
            fh.write(member)
        fh.write(rest)


# -- running -------------------------------------------------------------------------------------

_RUN_TABLES_SKIP = {"meta", "run", "source_file"}


def store_snapshot(db: Path) -> dict[str, Any]:
    """Row counts of every table and the runs: what a refused ingest must leave as it was."""
    from prism_trace.store.connection import open_store
    from prism_trace.store.tables import TABLES

    with open_store(db, read_only=True) as store:
        out: dict[str, Any] = {
            t.name: store.con.execute(f"SELECT count(*) FROM {t.name}").fetchone()[0]  # type: ignore[index]
            for t in TABLES
        }
        out["runs"] = store.con.execute("SELECT run_id, name FROM run ORDER BY run_id").fetchall()
    return out


def run_digest(db: Path, run: str, *, strip_key: str | None = None) -> tuple[str, list[str]]:
    """A digest of every table of ``run`` (ids, values; not paths or times), and the invariants
    the run breaks. ``strip_key``: hash ``et_op.attrs`` as if that key (a string of x) were not
    there (a host ET keeps the keys of a node it does not map in ``attrs``)."""
    from prism_trace.store.connection import open_store
    from prism_trace.store.tables import TABLES

    with open_store(db, read_only=True) as store:
        rid = store.run_id(run)
        h = hashlib.sha256()
        for t in TABLES:
            if t.name in _RUN_TABLES_SKIP:
                continue
            cols = "* EXCLUDE (run_id)"
            if strip_key and t.name == "et_op":
                key = f'"{strip_key}":"x*"'
                attrs = f"regexp_replace(regexp_replace(attrs, ',{key}', ''), '{key},?', '')"
                cols += f" REPLACE ({attrs} AS attrs)"
            # order-independent: the sorted hashes of every row, as text
            (n, digest) = store.con.execute(
                f"SELECT count(*), md5(coalesce(string_agg(h, ',' ORDER BY h), ''))"
                f" FROM (SELECT md5(t::VARCHAR) AS h FROM (SELECT {cols}"
                f" FROM {t.name} WHERE run_id = ?) t)",
                [rid],
            ).fetchall()[0]
            h.update(f"{t.name}:{n}:{digest}".encode())
        world = store.con.execute(
            "SELECT world_size, source_format FROM run WHERE run_id = ?", [rid]
        ).fetchall()[0]
        h.update(repr(world).encode())
        broken = [
            name
            for name, sql in _INVARIANTS.items()
            if store.con.execute(sql, [rid]).fetchall()[0][0]
        ]
    return h.hexdigest(), broken


_INVARIANTS = {
    "negative event time": "SELECT count(*) FROM event WHERE run_id = ? AND (dur < 0 OR ts < 0)",
    "rank outside world": (
        "SELECT count(*) FROM rank k JOIN run r USING (run_id)"
        " WHERE run_id = ? AND (k.rank < 0 OR k.rank >= r.world_size)"
    ),
    "world size out of range": (
        "SELECT count(*) FROM run WHERE run_id = ? AND (world_size < 1 OR world_size > 1048576)"
    ),
    "negative collective values": (
        "SELECT count(*) FROM collective WHERE run_id = ?"
        " AND (host_dur < 0 OR msg_bytes < 0 OR in_bytes < 0 OR out_bytes < 0)"
    ),
    "group size out of range": (
        "SELECT count(*) FROM comm_group WHERE run_id = ? AND (size < 1 OR size > 1048576)"
    ),
    "negative et_op ids": "SELECT count(*) FROM et_op WHERE run_id = ? AND node_id IS NULL",
}


@dataclass
class Result:
    """What one case did."""

    id: int
    outcome: str  # refused | accepted_same | accepted_other | crash | hang | ...
    ok: bool
    detail: str = ""
    wall_s: float = 0.0
    peak_mb: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _names_file(msg: str, files: list[Path], work: Path) -> bool:
    return str(work) in msg or any(f.name in msg for f in files)


def _same_file(db: Path, base: Path | None) -> bool:
    """``db`` is byte for byte ``base`` and has no write-ahead log: the same store, unopened.

    A refused ingest rolls back, and DuckDB then leaves the file as it was; comparing bytes
    (milliseconds) spares opening the store to count its rows (a connection is ~30 ms). When the
    bytes differ the rows are still counted, so the verdict is the same either way."""
    if base is None or Path(f"{db}.wal").exists():
        return False
    if db.stat().st_size != base.stat().st_size:
        return False
    with db.open("rb") as a, base.open("rb") as b:
        while True:
            x, y = a.read(1 << 20), b.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def judge(
    case: Case,
    *,
    refused: str | None,
    crash: str | None,
    db: Path,
    before: dict[str, Any],
    baseline: str | None,
    files: list[Path],
    work: Path,
    inputs: list[Path] | None = None,
    mutated: Path | None = None,
    base: Path | None = None,
) -> tuple[str, bool, str]:
    """The outcome of a finished case and whether it passes.

    Accepted data that differs from the seed's is judged by an independent check of the mutated
    input (``_fuzz_oracle.verdict``: the format's own decoder and schema, no prism code): a
    valid trace with other values passes (``accepted_other``), anything else is
    ``invalid_accepted``. A refusal must leave the store as ``before`` says; a file byte for byte
    the ``base`` it was copied from (and no WAL beside it) is that without opening it. Two
    differences are named apart: a host-ET node's unknown key kept in
    its ``attrs`` (``accepted_kept_key``), and a Chakra file cut exactly at a record boundary
    that states no node count (``cut_undetectable``: byte for byte a valid, shorter graph)."""
    if crash is not None:
        return "crash", False, crash
    if refused is not None:
        if "\n" in refused.strip() or not _names_file(refused, files, work):
            return "bad_message", False, refused
        if not _same_file(db, base) and store_snapshot(db) != before:
            return "partial_write", False, refused
        return ("refused" if case.expect != "valid" else "valid_refused"), True, refused
    digest, broken = run_digest(db, "fuzz")
    if broken:
        return "invalid_accepted", False, ", ".join(broken)
    if digest == baseline:
        return "accepted_same", True, ""
    if (
        case.mutation == "huge_string_unknown_key"
        and run_digest(db, "fuzz", strip_key=UNKNOWN_KEY)[0] == baseline
    ):
        return "accepted_kept_key", True, f"identical but for `{UNKNOWN_KEY}` in the node's attrs"
    if case.expect == "valid":
        return "valid_changed", False, "a valid mutation changed the data"
    why = _oracle().verdict(case.format, inputs if inputs is not None else files)
    if why is not None:
        return "invalid_accepted", False, f"accepted with other data; independent check: {why}"
    if case.expect == "any":
        return "accepted_other", True, "other values; a valid trace by the independent check"
    if (
        case.mutation == "record_truncate"
        and mutated is not None
        and not _oracle().chakra_states_count(mutated)
    ):
        return (
            "cut_undetectable",
            True,
            "cut at a record boundary: a valid shorter graph, no node count states otherwise",
        )
    return "invalid_accepted", False, "accepted with other data (valid to the independent check)"


def _oracle() -> Any:
    sys.path.insert(0, str(HERE))
    import _fuzz_oracle

    return _fuzz_oracle


def _limit_memory(gb: float) -> None:
    lim = int(gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_inproc(files: list[Path], db: Path) -> tuple[str | None, str | None]:
    """Ingest in this process: (refusal message, crash text)."""
    from prism_trace.errors import PrismError
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.store.connection import open_store

    try:
        with open_store(db) as store:
            ingest(store, files, run="fuzz", progress=False)
    except PrismError as exc:
        return str(exc), None
    except BaseException as exc:  # any other exception is what we hunt
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, "".join(traceback.format_exception(exc))[-2000:]
    return None, None


_LAUNCH = """
import resource, sys, atexit
lim = int(float(sys.argv[1]) * (1 << 30))
resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
atexit.register(lambda: sys.stderr.write(
    "\\n@@peak_kb %d\\n" % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
from prism_trace.cli import main
main(sys.argv[2:], prog_name="prism")
"""


def run_cli(
    files: list[Path], db: Path, timeout: float, mem_gb: float
) -> tuple[str | None, str | None, float, bool]:
    """Ingest through the CLI in a fresh process: (refusal, crash, peak MB, timed out)."""
    args = [str(f) for f in files]
    cmd = [sys.executable, "-c", _LAUNCH, str(mem_gb), "ingest", *args, "--db", str(db)]
    cmd += ["--run", "fuzz", "--quiet"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, None, 0.0, True
    err_lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    peak = 0.0
    if err_lines and err_lines[-1].startswith("@@peak_kb"):
        peak = int(err_lines.pop().split()[1]) / 1024
    text = "\n".join(err_lines)
    if p.returncode == 0:
        return None, None, peak, False
    if p.returncode == 1 and len(err_lines) == 1 and err_lines[0].startswith("error: "):
        return err_lines[0].removeprefix("error: "), None, peak, False
    return None, f"exit {p.returncode}: {text[-2000:]}", peak, False


class Harness:
    """Holds the seeds, the base store and the baselines; runs cases in-process or by CLI."""

    def __init__(self, root: Path, *, shared: bool, timeout: float, mem_gb: float) -> None:
        self.root = root
        self.timeout = timeout
        self.mem_gb = mem_gb
        listing = root / "seeds.json"
        if listing.exists():  # made by the parent before its workers start
            self.seeds = {
                d["name"]: Seed(**{**d, "folder": Path(d["folder"]), "inputs": tuple(d["inputs"])})
                for d in json.loads(listing.read_text())
            }
        else:
            self.seeds = {s.name: s for s in make_seeds(root / "seeds", shared=shared)}
            listing.write_text(
                json.dumps([{**asdict(s), "folder": str(s.folder)} for s in self.seeds.values()])
            )
        self.base_db = root / "base.duckdb"
        if not self.base_db.exists():
            self._make_base()
        self.before = store_snapshot(self.base_db)
        self.baselines: dict[tuple[str, bool], str] = {}
        saved = root / "baselines.json"
        if saved.exists():
            self.baselines = {
                (k.rsplit("|", 1)[0], k.endswith("|1")): v
                for k, v in json.loads(saved.read_text()).items()
            }

    def save_baselines(self) -> None:
        """Write the baselines for the workers (so each does not ingest every seed again)."""
        data = {f"{name}|{int(gz)}": v for (name, gz), v in self.baselines.items()}
        (self.root / "baselines.json").write_text(json.dumps(data))

    def _make_base(self) -> None:
        """A store already holding a run (another synthetic Chakra job), so that 'unchanged' is
        checked against content."""
        from prism_trace.ingestion.pipeline import ingest
        from prism_trace.store.connection import open_store

        src = self.root / "base-run"
        src.mkdir(exist_ok=True)
        for r in range(2):
            _synthetic_chakra(src / f"base.{r}.et", world=2, nodes=10 + r)
        with open_store(self.base_db) as store:
            ingest(store, [src], run="base", progress=False)

    def baseline(self, seed: Seed, *, gz: bool) -> str:
        """The digest of the unmutated seed, written gzipped or plain like the case."""
        key = (seed.name, gz)
        if key not in self.baselines:
            work = self.root / f"baseline-{seed.name}-{int(gz)}"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(seed.folder, work)
            files = [work / p if p != "." else work for p in seed.inputs]
            if seed.format != "op_timeline":
                t = work / seed.target
                payload = _read_payload(t)
                t.unlink()
                out = work / (_plain_name(seed.target) + (".gz" if gz else ""))
                out.write_bytes(gzip.compress(payload, compresslevel=1) if gz else payload)
                files = [p if p != t else out for p in files]
            db = work / "db.duckdb"
            shutil.copyfile(self.base_db, db)
            refused, crash = run_inproc(files, db)
            if refused or crash:
                raise SystemExit(f"seed {seed.name} does not ingest: {refused or crash}")
            self.baselines[key] = run_digest(db, "fuzz")[0]
            shutil.rmtree(work, ignore_errors=True)
        return self.baselines[key]

    def run(self, case: Case, *, inproc_ok: bool = True) -> Result:
        """Run one case (in this process if ``case.via`` says so and ``inproc_ok``)."""
        seed = self.seeds[case.seed]
        baseline = self.baseline(seed, gz=case.gz)
        work = self.root / f"case-{case.id}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            try:
                files, mutated = make_case(case, seed, work / "in")
            except _Unsupported:
                return Result(case.id, "skipped", ok=True, detail="mutation does not apply")
            db = work / "db.duckdb"
            shutil.copyfile(self.base_db, db)
            t0 = time.perf_counter()
            if case.via == "cli" or not inproc_ok:
                refused, crash, peak, hung = run_cli(files, db, self.timeout, self.mem_gb)
                if hung:
                    return Result(case.id, "hang", ok=False, detail="timeout", wall_s=self.timeout)
            else:
                refused, crash = run_inproc(files, db)
                peak = _peak_mb()
            wall = time.perf_counter() - t0
            outcome, ok, detail = judge(
                case,
                refused=refused,
                crash=crash,
                db=db,
                before=self.before,
                baseline=baseline,
                files=[*files, mutated],
                work=work,
                inputs=files,
                mutated=mutated,
                base=self.base_db,
            )
            if ok and peak > 2048:
                outcome, ok, detail = "memory", False, f"peak {peak:.0f} MB"
            if ok and wall > self.timeout:
                outcome, ok = "hang", False
            return Result(case.id, outcome, ok, detail[:300], round(wall, 3), round(peak, 1))
        finally:
            shutil.rmtree(work, ignore_errors=True)


# -- workers -------------------------------------------------------------------------------------


def worker_main(root: Path, *, shared: bool, timeout: float, mem_gb: float) -> None:
    """Read cases (JSON lines) on stdin, run each in this process, write results on stdout."""
    _limit_memory(mem_gb)
    h = Harness(root, shared=shared, timeout=timeout, mem_gb=mem_gb)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        case = Case(**json.loads(line))
        res = h.run(case)
        print(json.dumps(asdict(res)), flush=True)


class Worker:
    """A long-lived worker process, killed and restarted when a case overruns its time."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        line = self._read(600)
        if line is None or "ready" not in line:
            raise SystemExit("fuzz worker did not start")

    def _read(self, timeout: float) -> str | None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else None

    def run(self, case: Case, timeout: float) -> Result:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(asdict(case)) + "\n")
        self.proc.stdin.flush()
        # the time limit of the case, plus the seed's one-off baseline ingest
        line = self._read(timeout + 5)
        if line is None:
            self.stop()
            return Result(
                case.id, "hang", ok=False, detail=f"no answer in {timeout} s", wall_s=timeout
            )
        if not line:  # the worker died: a crash of the interpreter (segfault, abort, OOM kill)
            rc = self.proc.wait()
            self.stop()
            return Result(case.id, "crash", ok=False, detail=f"worker process died (exit {rc})")
        return Result(**json.loads(line))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            self.proc = None


def campaign(
    n: int, jobs: int, seed: int, cli_every: int, timeout: float, mem_gb: float, *, shared: bool
) -> tuple[list[Case], list[Result], Path]:
    """Plan and run ``n`` cases on ``jobs`` workers; return the cases and their results."""
    root = Path(tempfile.mkdtemp(prefix="prism-fuzz-"))
    h = Harness(root, shared=shared, timeout=timeout, mem_gb=mem_gb)
    cases = plan(list(h.seeds.values()), n, random.Random(seed), cli_every)
    for name, gz in sorted({(c.seed, c.gz) for c in cases}):  # the ones the cases use
        h.baseline(h.seeds[name], gz=gz)
    h.save_baselines()
    todo: queue.Queue[Case] = queue.Queue()
    for c in cases:
        todo.put(c)
    results: list[Result] = []
    lock = threading.Lock()
    argv = [sys.executable, __file__, "--worker", str(root), "--timeout", str(timeout)]
    argv += ["--mem-limit-gb", str(mem_gb)] + ([] if shared else ["--no-shared"])

    def loop() -> None:
        w = Worker(argv)
        try:
            while True:
                try:
                    c = todo.get_nowait()
                except queue.Empty:
                    return
                res = h.run(c) if c.via == "cli" else w.run(c, timeout)
                with lock:
                    results.append(res)
                    done = len(results)
                if done % 50 == 0:
                    print(f"  {done}/{len(cases)} cases", file=sys.stderr, flush=True)
        finally:
            w.stop()

    threads = [threading.Thread(target=loop) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: r.id)
    return cases, results, root


def summarize(cases: list[Case], results: list[Result]) -> str:
    """The markdown table: outcomes per format, and the failures."""
    by_id = {c.id: c for c in cases}
    formats = sorted({c.format for c in cases})
    outcomes = [
        "refused",
        "accepted_same",
        "accepted_kept_key",
        "accepted_other",
        "cut_undetectable",
        "valid_refused",
        "crash",
        "hang",
        "memory",
        "partial_write",
        "bad_message",
        "invalid_accepted",
        "valid_changed",
        "skipped",
    ]
    count = Counter((by_id[r.id].format, r.outcome) for r in results)
    lines = [
        "| format | cases | gz | cli | " + " | ".join(outcomes) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(outcomes),
    ]
    for fmt in [*formats, "all"]:
        sel = [r for r in results if fmt == "all" or by_id[r.id].format == fmt]
        gz = sum(by_id[r.id].gz for r in sel)
        cli = sum(by_id[r.id].via == "cli" for r in sel)
        cells = [
            str(sum(count[(f, o)] for f in formats) if fmt == "all" else count[(fmt, o)])
            for o in outcomes
        ]
        lines.append(f"| {fmt} | {len(sel)} | {gz} | {cli} | " + " | ".join(cells) + " |")
    bombs = [r for r in results if by_id[r.id].mutation == "bomb"]
    fails = [r for r in results if not r.ok]
    tracebacks = sum(r.outcome == "crash" for r in results)
    hangs = sum(r.outcome == "hang" for r in results)
    worst = max((r.wall_s for r in results), default=0.0)
    body = [
        "\n".join(lines),
        "",
        f"- cases: {len(results)}; failing: {len(fails)}; tracebacks: {tracebacks};"
        f" hangs: {hangs}; partial writes: {sum(r.outcome == 'partial_write' for r in results)};"
        f" invalid accepted: {sum(r.outcome == 'invalid_accepted' for r in results)};"
        f" undetectable cuts: {sum(r.outcome == 'cut_undetectable' for r in results)}",
        f"- slowest case: {worst:.1f} s; bombs: {len(bombs)}, peak RSS of the worst"
        f" {max((r.peak_mb for r in bombs), default=0):.0f} MB (limit 2048 MB)",
    ]
    per_mut = Counter((by_id[r.id].format, by_id[r.id].mutation) for r in results)
    body.append(
        "- mutations: " + ", ".join(f"{f}/{m} {k}" for (f, m), k in sorted(per_mut.items()))
    )
    other = Counter(
        f"{by_id[r.id].format}/{by_id[r.id].mutation}"
        for r in results
        if r.outcome == "accepted_other"
    )
    if other:
        body.append(
            "- accepted_other (valid traces with other values, by the independent check of"
            " benchmarks/_fuzz_oracle.py): "
            + ", ".join(f"{k} {v}" for k, v in sorted(other.items()))
        )
    kept = [r for r in results if r.outcome == "accepted_kept_key"]
    if kept:
        seeds = ", ".join(sorted({by_id[r.id].seed for r in kept}))
        body.append(
            f"- accepted_kept_key: {len(kept)} ({seeds}): identical to the seed but for the"
            f" unknown key `{UNKNOWN_KEY}`, which a host ET keeps verbatim in that node's `attrs`"
            " (the reader keeps every key it does not map)"
        )
    cuts = [r for r in results if r.outcome == "cut_undetectable"]
    if cuts:
        body.append(
            f"- cut_undetectable: {len(cuts)} Chakra files cut exactly at a record boundary,"
            " accepted as a shorter graph. Nothing in the input tells them from a whole file:"
            " byte for byte a valid trace (the independent check decodes it), no node count in"
            " the metadata (foreign files), no dependency on a missing node, and the other ranks"
            " given beside it (if any) issue as many collectives: "
            + ", ".join(f"#{r.id} {by_id[r.id].seed} gz={by_id[r.id].gz}" for r in cuts)
        )
    if fails:
        body += ["", "Failures:", ""]
        for r in fails[:40]:
            c = by_id[r.id]
            body.append(
                f"- #{r.id} {c.seed} {c.mutation} gz={c.gz} {c.via}: {r.outcome}:"
                f" {r.detail[:200]!r}"
            )
    return "\n".join(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", type=int, default=1100)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cli-every", type=int, default=16, help="every Nth case goes through the CLI")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds a case may take")
    ap.add_argument("--mem-limit-gb", type=float, default=4.0, help="address-space limit")
    ap.add_argument("--no-shared", action="store_true", help="bundled and synthetic seeds only")
    ap.add_argument("--host", default=None)
    ap.add_argument("--no-note", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker_main(
            Path(a.worker), shared=not a.no_shared, timeout=a.timeout, mem_gb=a.mem_limit_gb
        )
        return
    t0 = time.perf_counter()
    cases, results, root = campaign(
        a.cases, a.jobs, a.seed, a.cli_every, a.timeout, a.mem_limit_gb, shared=not a.no_shared
    )
    wall = time.perf_counter() - t0
    body = summarize(cases, results) + f"\n- campaign wall time: {wall:.0f} s on {a.jobs} workers"
    print(body)
    with contextlib.suppress(OSError):
        shutil.rmtree(root)
    if not a.no_note:
        sys.path.insert(0, str(HERE))
        from _common import host_kind, write_note

        cmd = f"python benchmarks/fuzz_ingest.py --cases {a.cases} --jobs {a.jobs} --seed {a.seed}"
        note = write_note(
            "fuzz-ingest",
            host_kind(a.host),
            title="Fuzzing `prism ingest`: mutated inputs of the four formats",
            command=cmd,
            body=body,
        )
        print(f"wrote {note}")
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
