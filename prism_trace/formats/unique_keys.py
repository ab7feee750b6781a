"""JSON and YAML parsed with every mapping's keys checked unique: a duplicate key is refused.

JSON and YAML leave a repeated key's meaning open, and each parser picks silently: orjson and
PyYAML keep the last value, the Kineto reader used to keep the first ``traceEvents`` array (an
empty one hid the events after it), and a ``result-*.json`` whose ``step_t_base`` came twice
failed on the wrong type. A trace that says two things at once is refused here, in one line that
names the file, the key and the mapping's other keys, so the user can find it.

The stdlib ``json`` scanner is used with a hook on every object: it is about as fast as orjson on
a host ET (both build every object), and orjson has no hook. The Kineto events array, which is
parsed by DuckDB, is checked there instead (``formats.kineto.sql``); this module parses the small
parts of a Kineto file (header, trailer) and whole host ETs and op-timeline sidecars.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from prism_trace.errors import TraceFormatError
from prism_trace.limits import load_yaml

__all__ = ["DuplicateKey", "duplicate_key_error", "loads_unique", "yaml_load_unique"]

_SHOWN_KEYS = 6


class DuplicateKey(ValueError):
    """A mapping holds ``key`` twice; ``keys`` are its keys in order (raised inside a parse)."""

    def __init__(self, key: Any, keys: list[Any]) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key
        self.keys = keys


def duplicate_key_error(path: Path | str, dup: DuplicateKey, where: str = "") -> TraceFormatError:
    """The one-line refusal of a duplicate key: the key, where, and the mapping's first keys."""
    seen: list[str] = []
    for k in dup.keys:
        text = repr(k) if len(repr(k)) <= 40 else repr(k)[:37] + "..."
        if text not in seen:
            seen.append(text)
    shown = ", ".join(seen[:_SHOWN_KEYS]) + (", ..." if len(seen) > _SHOWN_KEYS else "")
    key = repr(dup.key) if len(repr(dup.key)) <= 60 else repr(dup.key)[:57] + "..."
    at = f" {where}" if where else ""
    msg = (
        f"{path}: duplicate key {key}{at} (in an object with keys {shown}); a key may appear"
        " once in an object"
    )
    return TraceFormatError(msg)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKey(k, [p[0] for p in pairs])
            seen.add(k)
    return out


def loads_unique(text: str | bytes, path: Path | str, where: str = "") -> Any:
    """``json.loads(text)`` refusing a duplicate key in any object, at any depth.

    Args:
        text: the JSON document (bytes are decoded as strict UTF-8 by the caller's rules:
            ``json.loads`` accepts UTF-8 bytes).
        path: the file, for the message.
        where: which part of the file ``text`` is (``"at the top level"``), for the message.

    Raises:
        TraceFormatError: a duplicate key.
        json.JSONDecodeError, RecursionError: as ``json.loads`` (the caller words them).
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except DuplicateKey as dup:
        raise duplicate_key_error(path, dup, where) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that states a key twice (a ``<<`` merge may still
    override: that is what a merge is for)."""

    def construct_mapping(  # PyYAML's signature
        self,
        node: yaml.MappingNode,
        deep: bool = False,  # noqa: FBT001, FBT002
    ) -> dict[Any, Any]:
        keys: list[Any] = []
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            keys.append(key)
            try:
                if key in seen:
                    raise DuplicateKey(key, keys)
                seen.add(key)
            except TypeError:  # an unhashable key: SafeLoader refuses it below
                pass
        return super().construct_mapping(node, deep=deep)


def yaml_load_unique(text: str, path: Path | str) -> Any:
    """``yaml.safe_load(text)`` refusing a duplicate key in any mapping, and aliases that expand
    past ``limits.MAX_YAML_NODES`` (``limits.load_yaml``: a "billion laughs").

    Raises:
        TraceFormatError: a duplicate key, too many nodes, a recursive alias, invalid YAML.
    """
    try:
        return load_yaml(text, path, loader=_UniqueKeyLoader, passthrough=(DuplicateKey,))
    except DuplicateKey as dup:
        raise duplicate_key_error(path, dup) from None
