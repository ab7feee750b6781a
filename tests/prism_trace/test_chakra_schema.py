"""The bundled Chakra schema (generated from upstream's et_def.proto) is upstream's."""

from __future__ import annotations

import pytest

from prism_trace.formats.chakra import chakra_pb2 as ours


def test_bundled_schema_is_mlc_chakras() -> None:
    theirs = pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
    assert ours.DESCRIPTOR.serialized_pb == theirs.DESCRIPTOR.serialized_pb
    node = ours.Node(id=7, name="all_reduce", type=ours.COMM_COLL_NODE, ctrl_deps=[3])
    node.attr.add(name="comm_size", int64_val=1 << 20)
    back = theirs.Node()
    back.ParseFromString(node.SerializeToString())
    assert (back.id, back.name, list(back.ctrl_deps)) == (7, "all_reduce", [3])
    assert back.attr[0].int64_val == 1 << 20


def test_core_modules_do_not_import_mlc_chakra() -> None:
    """A core install has no mlc-chakra: the readers and the export use the bundled module."""
    import prism_trace.export.chakra.members
    import prism_trace.export.chakra.rules
    import prism_trace.export.chakra.template
    import prism_trace.formats.chakra.reader

    for mod in (
        prism_trace.export.chakra.rules,
        prism_trace.export.chakra.template,
        prism_trace.export.chakra.members,
        prism_trace.formats.chakra.reader,
    ):
        assert mod.pb is ours
