"""The rules of prism's Chakra export: the schema version, node and collective types, prism's own
attributes, the size rule for communication without a recorded size, and its error."""

from __future__ import annotations

from prism_trace.errors import PrismError
from prism_trace.formats.chakra import chakra_pb2 as pb
from prism_trace.formats.chakra.reader import PRISM_START_NAME

__all__ = [
    "ASTRA_COMM_TYPE",
    "CHAKRA_COMM_TYPE",
    "CHAKRA_NODE_TYPE",
    "CHAKRA_SCHEMA",
    "CHAKRA_VERSION",
    "CTRL_EDGE_KINDS",
    "INPUT_SIZED",
    "MIN_COMM_BYTES",
    "PRISM_DEPS_ATTR",
    "PRISM_DEP_KINDS_ATTR",
    "PRISM_KIND_ATTR",
    "SIZE_BANDWIDTH_GBPS",
    "START_NAME",
    "SYNC_EDGE_KINDS",
    "VARINT_CACHE",
    "ChakraExportError",
]


CHAKRA_VERSION = "0.0.4"
"""``GlobalMetadata.version`` of the files written (the Chakra schema they follow)."""

CHAKRA_SCHEMA = "prism-trace-1-chakra.0.0.4"
"""The ``schema`` attribute of ``GlobalMetadata``: who wrote the file, and for which Chakra."""

START_NAME = PRISM_START_NAME
"""Name of the start node (a COMP_NODE of duration 0, id = the METADATA node's + 1) that every
other dependency-free node depends on: the METADATA node is then the only other node ready at
the start, so the newer ASTRA-sim parses the rank's groups before any communication
(docs/export.md, "The newer feeder"). Prism's reader drops it."""

CHAKRA_NODE_TYPE: dict[str, pb.NodeType] = {
    "host": pb.COMP_NODE,
    "kernel": pb.COMP_NODE,
    "memcpy": pb.COMP_NODE,
    "memset": pb.COMP_NODE,
    "collective": pb.COMM_COLL_NODE,
    "send": pb.COMM_SEND_NODE,
    "recv": pb.COMM_RECV_NODE,
}
"""``graph_node.kind`` → Chakra ``NodeType``. Copies are COMP_NODEs: ASTRA-sim runs a
MEM_LOAD/MEM_STORE node as a remote-memory transfer, which a recorded device copy is not (and
the graph has no copy size). A collective on a group of one member is a COMP_NODE too."""

PRISM_DEPS_ATTR = "prism_deps"
"""Node attribute (int64 list): ``src, delay, code`` of each incoming ``graph_edge``, so that
prism's reader restores every edge exactly; ``code = 2 * PRISM_EDGE_CODES.index(kind) + (anchor
== "start")``, or -1 when the kind is not in the table (then ``prism_dep_kinds`` says)."""

PRISM_DEP_KINDS_ATTR = "prism_dep_kinds"
"""Node attribute (string list), only where a kind has no code: ``kind@anchor`` of each
incoming edge, in the order of ``prism_deps``."""

PRISM_KIND_ATTR = "prism_kind"
"""Node attribute (string) naming the ``graph_node.kind`` where the Chakra type loses it."""

ASTRA_COMM_TYPE: dict[str, tuple[int, str]] = {
    "reduce": (pb.ALL_REDUCE, "ALL_REDUCE"),
    "gather": (pb.ALL_GATHER, "ALL_GATHER"),
    "scatter": (pb.ALL_GATHER, "ALL_GATHER"),
    "barrier": (pb.ALL_REDUCE, "ALL_REDUCE"),
}
"""Collective kinds ASTRA-sim (c459ab6) does not simulate (the rank hangs), → the simulated
kind of the same ring traffic written instead. The recorded kind stays in ``prism_comm_kind``."""

SIZE_BANDWIDTH_GBPS = 50.0
"""Default bus bandwidth (GB/s) of the size rule for communication without a recorded size."""

MIN_COMM_BYTES = 4096
"""Smallest ``comm_size`` written: ASTRA-sim splits a collective into chunks per step and
member, and a 0-byte chunk never completes."""

CHAKRA_COMM_TYPE: dict[str, int] = {
    "all_reduce": pb.ALL_REDUCE,
    "all_gather": pb.ALL_GATHER,
    "reduce_scatter": pb.REDUCE_SCATTER,
    "all_to_all": pb.ALL_TO_ALL,
    "broadcast": pb.BROADCAST,
    "reduce": pb.REDUCE,
    "gather": pb.GATHER,
    "scatter": pb.SCATTER,
    "barrier": pb.BARRIER,
}
"""``graph_node.comm_kind`` of a collective → Chakra ``CollectiveCommType`` (``comm_type``)."""

INPUT_SIZED = ("all_gather", "gather", "scatter")
"""Recorded kinds written as ALL_GATHER, whose ``comm_size`` is each member's input: the
nccl-tests size (the output) over the group size, as the PyTorch converter writes it and
ASTRA-sim simulates it (each ring step sends ``comm_size``)."""

CTRL_EDGE_KINDS = ("ctrl",)
"""Edge kinds written as ``ctrl_deps``; ``sync`` goes to ``sync_deps`` and every other kind
becomes a ``data_dep``."""

SYNC_EDGE_KINDS = ("sync",)
"""Edge kinds written as the ``sync_deps`` attribute (an int64 list): "the end of this node
waits for that one" has no Chakra form, and as a dependency it closes cycles."""

VARINT_CACHE = 1 << 14


class ChakraExportError(PrismError, ValueError):
    """A run cannot be written as Chakra ET: a node, group or peer has no Chakra form."""
