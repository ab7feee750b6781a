"""Writers from the store to other tools' formats: Chakra ET (one protobuf file per rank).

Chakra ET (``export_chakra``): every rank of a recorded or sliced run becomes
``<prefix>.<rank>.et``, a stream of length-delimited protobuf records (the framing of
``chakra.src.third_party.utils.protolib.encodeMessage``): one ``GlobalMetadata``, one
``## process_group:init ##`` metadata node listing the rank's own communicators, a
``## prism:start ##`` node that every other root depends on (so that the newer ASTRA-sim reads
the groups before any communication), then the ``Node`` messages of its execution graph in a
topological order; and ``comm_groups.json``, the
communicators as ASTRA-sim's ``--comm-group-configuration`` (``pg_name`` is a decimal key of it).
The files are written for ASTRA-sim to run to completion: every communication node has a size
(the recorded one, else the size rule), copies and one-member collectives are compute, kinds it
does not simulate are substituted (with a warning), each rank issues its communication in the
recorded order (``order_deps``), and ``sync`` edges are an attribute, never a dependency. Every
edge is also kept exactly (``prism_deps``) for prism's own reader. The mapping is in
docs/export.md.

A sliced run stores one graph per class under its exemplar rank; the exporter encodes that
graph once as a template and writes each member rank's file by patching only what differs
(``pg_name`` of the member's own group of the same axis, ``comm_src``/``comm_dst`` of p2p nodes
shifted by the member's dp offset), so no more than one class's graph is in memory at once.

The pieces: ``export_rules`` (types, attributes, the size rule), ``export_template`` (the run and
its templates), ``export_writer`` (member files) and ``export_wire`` (records); this module is
the entry point and its report.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from prism_trace.export.chakra.members import MemberWriter
from prism_trace.export.chakra.rules import (
    ASTRA_COMM_TYPE,
    SIZE_BANDWIDTH_GBPS,
    ChakraExportError,
)
from prism_trace.export.chakra.template import ExportRun, comm_plan, encode_template, load_run
from prism_trace.export.chakra.wire import sanitize_prefix
from prism_trace.outputs import atomic_dir, output_dir

if TYPE_CHECKING:
    from prism_trace.store.connection import Store

__all__ = ["ExportReport", "export_chakra"]


@dataclass
class ExportReport:
    """What ``export_chakra`` wrote: enough for the CLI to print and for tests to assert."""

    run: str
    run_id: int
    kind: str
    out_dir: Path
    prefix: str
    world_size: int
    files: int = 0
    templates: int = 0
    """Graphs encoded (one per recorded rank, or one per class of a sliced run)."""
    nodes: int = 0
    """Graph nodes written over all files (the metadata nodes not counted)."""
    deps: dict[str, int] = field(default_factory=dict)
    """Dependencies written over all files: ``data_deps`` and ``ctrl_deps``."""
    node_types: dict[str, int] = field(default_factory=dict)
    """Nodes written by Chakra ``NodeType`` name."""
    bytes: int = 0
    built_graph: bool = False
    sized_by_rule: int = 0
    """Communication nodes without a recorded size, whose ``comm_size`` the size rule gave."""
    size_bandwidth_gbps: float = SIZE_BANDWIDTH_GBPS
    """Bus bandwidth of the size rule."""
    single_member: int = 0
    """Collectives on a one-member group, written as COMP_NODEs."""
    substituted: dict[str, int] = field(default_factory=dict)
    """Collectives ASTRA-sim does not simulate, by recorded kind, written as another kind."""
    order_deps: int = 0
    """``data_deps`` added so that every rank issues its communication in the recorded order."""
    comm_groups: int = 0
    """Groups written to ``comm_groups.json``."""
    elapsed_s: float = 0.0

    def warnings(self) -> list[str]:
        """What ASTRA-sim will not see as recorded (one line each)."""
        out = []
        for kind, n in sorted(self.substituted.items()):
            astra = ASTRA_COMM_TYPE[kind][1]
            out.append(
                f"warning: {n} {kind} collectives written as {astra} (ASTRA-sim simulates no"
                f" {kind.upper()}); the recorded kind is in attribute prism_comm_kind"
            )
        return out

    def summary(self) -> str:
        """One paragraph: what was written where, and how fast."""
        types = ", ".join(f"{k} {v}" for k, v in sorted(self.node_types.items()))
        deps = ", ".join(f"{k} {v}" for k, v in sorted(self.deps.items()))
        lines = [
            f"run {self.run!r} ({self.kind}, world {self.world_size}): {self.files} Chakra ET"
            f" files {self.out_dir}/{self.prefix}.<rank>.et, {self.bytes / 1e6:.1f} MB,"
            f" {self.elapsed_s:.2f} s",
            f"{self.templates} graphs encoded, {self.nodes} nodes written ({types}); {deps}",
            f"{self.comm_groups} communicator groups in {self.out_dir}/comm_groups.json"
            f" (pg_name = its key; run: astra-sim --workload {self.out_dir}/{self.prefix}"
            f" --npus {self.world_size} --comm-groups {self.out_dir}/comm_groups.json)",
        ]
        if self.built_graph:
            lines.append("the run had no graph: build_graph wrote it first")
        if self.sized_by_rule:
            lines.append(
                f"{self.sized_by_rule} communication nodes have no recorded size: comm_size ="
                f" {self.size_bandwidth_gbps:g} GB/s x the shortest duration among the"
                " instance's members / the ring's traffic factor (docs/export.md)"
            )
        if self.single_member:
            lines.append(f"{self.single_member} collectives on one-member groups: COMP_NODEs")
        if self.order_deps:
            lines.append(
                f"{self.order_deps} data_deps added to issue communication in the recorded order"
            )
        lines.extend(self.warnings())
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``--json``)."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "kind": self.kind,
            "out_dir": str(self.out_dir),
            "prefix": self.prefix,
            "world_size": self.world_size,
            "files": self.files,
            "templates": self.templates,
            "nodes": self.nodes,
            "deps": dict(self.deps),
            "node_types": dict(self.node_types),
            "bytes": self.bytes,
            "built_graph": self.built_graph,
            "sized_by_rule": self.sized_by_rule,
            "size_bandwidth_gbps": self.size_bandwidth_gbps,
            "single_member": self.single_member,
            "substituted": dict(self.substituted),
            "order_deps": self.order_deps,
            "comm_groups": self.comm_groups,
            "warnings": self.warnings(),
            "elapsed_s": round(self.elapsed_s, 3),
        }


def export_chakra(
    store: Store,
    *,
    run: str,
    out_dir: Path,
    prefix: str | None = None,
    progress: bool = False,
    size_bandwidth_gbps: float = SIZE_BANDWIDTH_GBPS,
    follow_symlinks: bool = False,
) -> ExportReport:
    """Write every rank of ``run`` as a Chakra ET file ``<out_dir>/<prefix>.<rank>.et``.

    A recorded run exports each rank's own graph (built first when the run has none); a sliced
    run encodes each class's graph once and writes one file per member rank, patching its group
    names and p2p peers. See docs/export.md for the mapping.

    Args:
        store: an open store (writable when the recorded run's graph must be built).
        run: the run to export (recorded or sliced).
        out_dir: the folder to write into: new (created with its parents) or empty.
        prefix: file-name prefix (default: the run name with other characters than
            ``[A-Za-z0-9_-]`` replaced by ``_``).
        progress: show a progress bar (stderr).
        size_bandwidth_gbps: bus bandwidth of the size rule for communication without a
            recorded size (docs/export.md).

    Returns:
        What was written.

    Raises:
        ChakraExportError: the run is neither recorded nor sliced, a node has no Chakra form
            (the message names it), a member's group or peer cannot be derived, or the prefix is
            not a plain name.
        OutputError: ``out_dir`` is a file, a folder that is not empty, or cannot be created.
        RunNotFoundError: no such run.
    """
    t0 = time.perf_counter()
    # A new or empty folder: stale `.et` files of another export would mix into an ingest of it.
    out_dir = output_dir(Path(out_dir), create=False, follow_symlinks=follow_symlinks)
    prefix = sanitize_prefix(run) if prefix is None else prefix
    # A control character (a tab, a newline) makes file names that break listings and scripts.
    plain = not any(ord(c) < 32 or ord(c) == 127 for c in prefix)
    if not prefix or not plain or "/" in prefix or "\\" in prefix or prefix in (".", ".."):
        msg = (
            f"{out_dir}: `prefix` {prefix!r} is not a plain file-name prefix (no slash, no"
            " control character such as a tab or a newline)"
        )
        raise ChakraExportError(msg)
    # Every argument is checked before anything is written: a graph built for the export and
    # then refused would stay in the store.
    if not (size_bandwidth_gbps > 0 and math.isfinite(size_bandwidth_gbps)):
        msg = f"{out_dir}: size bandwidth {size_bandwidth_gbps!r} GB/s is not a positive number"
        raise ChakraExportError(msg)
    # One transaction: a graph built here is committed with a complete export, or not at all.
    with store.transaction():
        rd = load_run(store, run)
        built = False
        if rd.kind == "recorded":
            rows = store.con.execute(
                "SELECT count(*) FROM graph_node WHERE run_id = ?", [rd.run_id]
            ).fetchall()
            if not rows[0][0]:
                from prism_trace.graph.build import build_graph

                build_graph(store, run)
                built = True
        report = ExportReport(
            run=run,
            run_id=rd.run_id,
            kind=rd.kind,
            out_dir=out_dir,
            prefix=prefix,
            world_size=rd.world_size,
            built_graph=built,
        )
        report.size_bandwidth_gbps = size_bandwidth_gbps
        # Filled beside `out_dir` and renamed into place: no partial export under its name.
        with atomic_dir(out_dir) as tmp:
            writer = MemberWriter(store, rd, tmp, prefix)
            types, deps, subst = _write_members(store, rd, writer, report, progress=progress)
    report.node_types = dict(types)
    report.deps = dict(deps)
    report.substituted = dict(subst)
    report.elapsed_s = time.perf_counter() - t0
    return report


def _write_members(
    store: Store, rd: ExportRun, writer: MemberWriter, report: ExportReport, *, progress: bool
) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Encode each graph rank's template once and write it for every member rank; counts go to
    ``report``. Returns the node types, dependency kinds and substitutions written."""
    members: dict[int, list[int]] = defaultdict(list)
    for r in rd.ranks:
        members[rd.graph_rank[r]].append(r)
    plan = comm_plan(store, rd, report.size_bandwidth_gbps)
    types: Counter[str] = Counter()
    deps: Counter[str] = Counter()
    subst: Counter[str] = Counter()
    with tqdm(total=len(rd.ranks), unit="rank", disable=not progress, desc="export") as bar:
        for graph_rank in sorted(members):
            tpl = encode_template(store, rd, graph_rank, plan)
            report.templates += 1
            n = len(members[graph_rank])
            for r in members[graph_rank]:
                report.bytes += writer.write(tpl, r)
                bar.update(1)
            report.files += n
            report.nodes += tpl.nodes * n
            report.sized_by_rule += tpl.sized_by_rule * n
            report.single_member += tpl.single_member * n
            report.order_deps += tpl.order_deps * n
            for k, v in tpl.substituted.items():
                subst[k] += v * n
            for k, v in tpl.node_types.items():
                types[k] += v * n
            for k, v in tpl.deps.items():
                deps[k] += v * n
            del tpl
    report.comm_groups = writer.write_comm_groups()
    return types, deps, subst
