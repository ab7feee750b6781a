"""Prism's Chakra export against what the newer ASTRA-sim (Chakra's ``feeder_v3``) expects.

``feeder_v3`` is not built here; ``scripts/feeder_v3_check.cpp`` drives it where its sources
are at hand (``$PRISM_FEEDER_V3_SRC``; see docs/export.md). What it and the newer ``Workload``
require of a file, read from their source, is checked here on the bundled sample:

- ``ETFeeder::graph_sanity_check``: every ``data_deps``/``ctrl_deps`` entry names a node of the
  file; ``resolve_dependancy_free_nodes``: some node has no dependency;
- its resolver follows both ``data_deps`` and ``ctrl_deps``: every node must be reachable,
  i.e. no cycle (else the run ends early, silently);
- ``Workload::issue_pytorch_pg_metadata``: the METADATA node's ``inputs.values`` is
  ``['<json>']`` (two characters cut at each end), a list of ``{pg_name: "<decimal>", ranks}``
  (``std::stoi(pg_name)``; empty ranks = every NPU); the groups it lists replace those of
  ``--comm-group-configuration`` under the same key, so they must have the same members;
- ``skip_invalid`` does not issue the nodes it frees: nothing may depend on the METADATA node;
- the groups the METADATA node lists replace the configuration's *objects* when it is issued,
  which restarts their stream numbering: it must come before any communication. So the only
  dependency-free nodes are the METADATA node (a CPU op) and prism's start node (a GPU COMP_NODE
  of duration 0, 1 ns in the newer ``Workload``) that every other root depends on: both are
  issued together at the start, on different resources, before anything else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import deque
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

from prism_trace.export.chakra.rules import START_NAME
from prism_trace.export.chakra.writer import export_chakra
from tests.conftest import sample_copy

# Slow: exports and checks every node of a run; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "datasets" / "sample"


def read_nodes(path: Path) -> list[pb.Node]:
    fh = openFileRd(str(path))
    decodeMessage(fh, pb.GlobalMetadata())
    nodes = []
    node = pb.Node()
    while decodeMessage(fh, node):
        nodes.append(node)
        node = pb.Node()
    fh.close()
    return nodes


def feeder_v3_issue_order(nodes: list[pb.Node]) -> list[int]:
    """The nodes feeder_v3 issues, finishing each at once (data and ctrl deps both resolved)."""
    ids = {n.id for n in nodes}
    parents = {n.id: set(n.data_deps) | set(n.ctrl_deps) for n in nodes}
    for nid, ps in parents.items():
        missing = ps - ids
        assert not missing, f"node {nid} depends on {sorted(missing)}, not in the file"
    children: dict[int, list[int]] = {nid: [] for nid in ids}
    for nid, ps in parents.items():
        for p in ps:
            children[p].append(nid)
    ready = deque(nid for nid, ps in parents.items() if not ps)
    assert ready, "no dependency-free node: feeder_v3 refuses the file"
    issued = []
    while ready:
        nid = ready.popleft()
        issued.append(nid)
        for c in children[nid]:
            parents[c].discard(nid)
            if not parents[c]:
                ready.append(c)
    return issued


def workload_pg_metadata(node: pb.Node, world: int) -> dict[str, list[int]]:
    """The groups ``Workload::issue_pytorch_pg_metadata`` makes of a METADATA node."""
    info = node.inputs.values
    items = json.loads(info[2 : len(info) - 2])
    groups = {}
    for item in items:
        name = item["pg_name"]
        assert isinstance(name, str), "pg_name is read with get<std::string>()"
        assert str(int(name)) == name  # std::stoi
        assert int(name) >= 1
        ranks = item["ranks"] or list(range(world))
        groups[name] = sorted(ranks)
    return groups


def test_sample_export_meets_the_feeder_v3_contract(tmp_path: Path, sample_template: Path) -> None:
    store = sample_copy(sample_template, tmp_path / "s.duckdb", run="s")
    report = export_chakra(store, run="s", out_dir=tmp_path / "et")
    config = json.loads((tmp_path / "et" / "comm_groups.json").read_text())
    files = sorted((tmp_path / "et").glob("s.*.et"))
    assert len(files) == report.files == 8
    for path in files:
        nodes = read_nodes(path)
        order = feeder_v3_issue_order(nodes)
        assert sorted(order) == sorted(n.id for n in nodes), f"{path}: nodes left on a cycle"
        (meta,) = [n for n in nodes if n.type == pb.METADATA_NODE]
        assert not meta.data_deps
        assert not meta.ctrl_deps
        assert not any(meta.id in n.data_deps or meta.id in n.ctrl_deps for n in nodes)
        is_cpu = {a.name: a.bool_val for a in meta.attr}.get("is_cpu_op")
        assert is_cpu is True  # the old ETFeeder skips it as a CPU op of 0 runtime, 0 ops
        roots = [n for n in nodes if not n.data_deps and not n.ctrl_deps]
        (start,) = [n for n in roots if n.id != meta.id]
        assert (start.name, start.type, start.duration_micros) == (START_NAME, pb.COMP_NODE, 0)
        assert {a.name: a.bool_val for a in start.attr}.get("is_cpu_op") is False
        assert order[:2] in ([meta.id, start.id], [start.id, meta.id])
        groups = workload_pg_metadata(meta, world=8)
        assert groups, path
        for name, members in groups.items():
            assert members == sorted(config[name]), (path, name)  # the same group either way
        used = {
            a.string_val
            for n in nodes
            if n.type in (pb.COMM_COLL_NODE, pb.COMM_SEND_NODE, pb.COMM_RECV_NODE)
            for a in n.attr
            if a.name == "pg_name"
        }
        assert used <= set(groups), path


def test_contract_checks_fail_on_a_cycle_and_a_dangling_dependency() -> None:
    a, b, c = pb.Node(id=1), pb.Node(id=2), pb.Node(id=3)
    b.data_deps.append(1)
    c.ctrl_deps.append(2)
    assert feeder_v3_issue_order([a, b, c]) == [1, 2, 3]
    b.ctrl_deps.append(3)  # 2 <-> 3: feeder_v3 never issues them
    assert feeder_v3_issue_order([a, b, c]) == [1]
    c.data_deps.append(99)
    with pytest.raises(AssertionError, match="not in the file"):
        feeder_v3_issue_order([a, b, c])


def test_feeder_v3_itself_issues_every_node(tmp_path: Path, sample_template: Path) -> None:
    """With feeder_v3's sources at ``$PRISM_FEEDER_V3_SRC``: build the driver and run it."""
    src = os.environ.get("PRISM_FEEDER_V3_SRC")
    if not src or not (Path(src) / "et_feeder.cpp").is_file():
        pytest.skip("feeder_v3 sources not given (set PRISM_FEEDER_V3_SRC to src/feeder_v3)")
    if not (shutil.which("g++") and shutil.which("protoc")):
        pytest.skip("g++ and protoc are needed to build the feeder_v3 driver")
    build = tmp_path / "build"
    build.mkdir()
    proto = REPO / "prism_trace" / "formats"
    subprocess.run(
        ["protoc", f"--cpp_out={build}", "-I", str(proto), str(proto / "et_def.proto")],
        check=True,
    )
    exe = build / "feeder_v3_check"
    sources = sorted(str(p) for p in Path(src).glob("*.cpp"))
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-I", str(build), "-I", src,
         str(REPO / "scripts" / "feeder_v3_check.cpp"), *sources, str(build / "et_def.pb.cc"),
         "-lprotobuf", "-o", str(exe)],
        check=True,
        timeout=600,
    )  # fmt: skip
    store = sample_copy(sample_template, tmp_path / "s.duckdb", run="s")
    export_chakra(store, run="s", out_dir=tmp_path / "et")
    files = sorted(str(p) for p in (tmp_path / "et").glob("s.*.et"))
    proc = subprocess.run([str(exe), *files], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(", ok") == 8
    assert proc.stdout.count("metadata 1,") == 8
