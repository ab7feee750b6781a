"""`--config FILE.toml` for `prism emulate` and `prism replay`: typed configs, one-line errors.

One TOML section per frozen dataclass, one key per field. The emulation's sections are those of
`EmulationConfig` (``[completion]``, ``[timing]``, ``[topology]``, ``[memory]``, ``[what_if]``,
``[network]``) plus the top-level ``seed`` and ``keep_events``; ``what_if`` may also be written
as the CLI writes it (``what_if = ["slow-ranks=3@1.2", "bandwidth=0.5"]``), since that syntax is the
documented one. ``[network]`` holds a fitted network model's keys, or ``file = "net.toml"``
naming the output of ``prism network fit`` (relative to the config file; keys given beside it
override the file's). A kernel replay's file adds ``[kernel_replay]`` (`KernelReplayOptions`); its
emulation sections configure the virtual peers.

Every value is checked against the field's annotation before the dataclass sees it, so a typo
(an unknown key), a wrong type (``chunks = "4"``) or a bad value (``system = "h1000"``) is one
line naming the file, the section and the key, never a traceback from deep in the emulator.

`to_toml` writes a resolved config back in this form: `prism info --run R --config` prints what
a run stored, and that text given to ``--config`` makes the same run again.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from prism_trace.replay.emulate.config import CompletionConfig, EmulationConfig, MemoryConfig
from prism_trace.replay.hybrid.options import KernelReplayOptions
from prism_trace.replay.model.timing import TimingConfig
from prism_trace.replay.model.topology import Topology
from prism_trace.replay.network.model import NetworkModel
from prism_trace.replay.whatif.config import WhatIfConfig, WhatIfError, parse_what_if

from prism_trace.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "EMULATION_SECTIONS",
    "emulation_config_from",
    "load_emulation_config",
    "load_network_table",
    "load_replay_config",
    "read_toml",
    "to_toml",
]

T = TypeVar("T")

EMULATION_SECTIONS: dict[str, type] = {
    "completion": CompletionConfig,
    "timing": TimingConfig,
    "topology": Topology,
    "memory": MemoryConfig,
    "what_if": WhatIfConfig,
    "network": NetworkModel,
}
"""The emulation's table sections and the dataclass each one builds."""

_TOP_LEVEL = {"seed", "keep_events"}
_DEPRECATED = {"replay": "completion"}
"""Old section name -> new one; still read, with a note."""
_RENAMED_KEYS = {("replay", "completion"): "rule"}
"""(old section, old key) -> the key's new name."""


def read_toml(path: Path) -> dict[str, Any]:
    """The file as a TOML mapping; a missing or malformed file is one line naming it."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        msg = f"{path}: cannot read the config: {exc.strerror or exc}"
        raise ConfigError(msg) from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        msg = f"{path}: not valid TOML: {exc}"
        raise ConfigError(msg) from exc


def load_emulation_config(path: Path, notes: list[str] | None = None) -> EmulationConfig:
    """Read ``path`` as TOML into an `EmulationConfig` (unset fields keep their defaults).

    Args:
        path: the TOML file.
        notes: gets one line per deprecated name the file uses (``[replay]``).

    Raises:
        ConfigError: the file is missing or not TOML, or names an unknown section or key, or a
            value of the wrong type, or a value the config refuses (one line).
    """
    data = read_toml(path)
    unknown = sorted(set(data) - set(EMULATION_SECTIONS) - _TOP_LEVEL - set(_DEPRECATED))
    if unknown:
        known = sorted(set(EMULATION_SECTIONS) | _TOP_LEVEL)
        msg = f"{path}: unknown section(s) {unknown}; known: {known}"
        raise ConfigError(msg)
    return emulation_config_from(data, path=path, notes=notes)


def load_replay_config(
    path: Path, notes: list[str] | None = None
) -> tuple[KernelReplayOptions, EmulationConfig]:
    """Read ``path`` as TOML: ``[kernel_replay]`` and the virtual peers' emulation sections.

    Raises:
        ConfigError: as `load_emulation_config`, one line naming the file and the key.
    """
    data = read_toml(path)
    known = set(EMULATION_SECTIONS) | _TOP_LEVEL | {"kernel_replay"}
    unknown = sorted(set(data) - known - set(_DEPRECATED))
    if unknown:
        msg = f"{path}: unknown section(s) {unknown}; known: {sorted(known)}"
        raise ConfigError(msg)
    options = build(
        KernelReplayOptions, data.pop("kernel_replay", {}), where=f"{path}: [kernel_replay]"
    )
    return options, emulation_config_from(data, path=path, notes=notes)


def emulation_config_from(
    data: dict[str, Any], *, path: Path | str, notes: list[str] | None = None
) -> EmulationConfig:
    """An `EmulationConfig` from a parsed mapping of its sections (see the module docstring)."""
    data = dict(data)
    for old, new in _DEPRECATED.items():
        if old not in data:
            continue
        if new in data:
            msg = f"{path}: [{old}] is the old name of [{new}]; give only [{new}]"
            raise ConfigError(msg)
        table = data.pop(old)
        if isinstance(table, dict):
            table = {_RENAMED_KEYS.get((old, k), k): v for k, v in table.items()}
        data[new] = table
        if notes is not None:
            notes.append(f"{path}: section [{old}] is deprecated; call it [{new}]")
    what_if = data.get("what_if")
    if isinstance(what_if, str):  # one word where a list was meant: say so, don't guess
        msg = (
            f"{path}: what_if must be a list of strings like ['slow-ranks=3@1.2'] or a"
            f" [what_if] table, got the string {what_if!r}"
        )
        raise ConfigError(msg)
    kw: dict[str, Any] = {}
    if isinstance(data.get("network"), dict) and "file" in data["network"]:
        data["network"] = load_network_table(data["network"], base=Path(path).parent, where=path)
    if isinstance(what_if, list):
        if not all(isinstance(w, str) for w in what_if):
            msg = f"{path}: what_if must be a list of strings like 'slow-ranks=3@1.2'"
            raise ConfigError(msg)
        try:
            kw["what_if"] = parse_what_if(tuple(what_if))
        except WhatIfError as exc:
            msg = f"{path}: {str(exc).splitlines()[0]}"
            raise ConfigError(msg) from exc
    for name, cls in EMULATION_SECTIONS.items():
        if name in data and name not in kw:
            kw[name] = build(cls, data[name], where=f"{path}: [{name}]")
    hints = typing.get_type_hints(EmulationConfig)
    for name in sorted(_TOP_LEVEL & set(data)):
        kw[name] = _check(data[name], hints[name], where=f"{path}: `{name}`")
    try:
        return EmulationConfig(**kw)
    except (ValueError, TypeError) as exc:
        msg = f"{path}: {str(exc).splitlines()[0]}"
        raise ConfigError(msg) from exc


def load_network_table(table: dict[str, Any], *, base: Path, where: Path | str) -> dict[str, Any]:
    """A ``[network]`` table with its ``file = "net.toml"`` replaced by that file's keys.

    Args:
        table: the section as written (``file`` plus any keys that override the file's).
        base: the folder a relative ``file`` is read from (the config file's).
        where: the config file, for errors.

    Raises:
        ConfigError: ``file`` is not a string, cannot be read or holds no ``[network]`` table.
    """
    table = dict(table)
    name = table.pop("file")
    if not isinstance(name, str):
        msg = f"{where}: [network] `file` must be a string (a net.toml path), got {name!r}"
        raise ConfigError(msg)
    target = Path(name) if Path(name).is_absolute() else base / name
    try:
        loaded = read_toml(target).get("network")
    except ConfigError as exc:
        msg = f"{where}: [network] `file`: {exc}"
        raise ConfigError(msg) from exc
    if not isinstance(loaded, dict):
        msg = (
            f"{where}: [network] `file` {str(target)!r} has no [network] table (write one"
            " with `prism network fit LOG... -o FILE`)"
        )
        raise ConfigError(msg)
    return {**loaded, **table}


def build(cls: type[T], table: Any, *, where: str) -> T:
    """``cls(**table)`` after checking every key and value against ``cls``'s fields.

    Args:
        cls: a dataclass.
        table: the TOML table of its section.
        where: ``"FILE: [section]"``, the start of every error.

    Raises:
        ConfigError: not a table, an unknown key, a value of the wrong type, or a value
            ``cls`` refuses (its ``__post_init__``), as one line.
    """
    if not isinstance(table, dict):
        msg = f"{where} must be a table of keys"
        raise ConfigError(msg)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(names))
    if unknown:
        msg = f"{where}: unknown key(s) {unknown}; known: {', '.join(names)}"
        raise ConfigError(msg)
    hints = typing.get_type_hints(cls)
    kw = {k: _check(v, hints[k], where=f"{where} `{k}`") for k, v in table.items()}
    try:
        return cls(**kw)
    except (ValueError, TypeError) as exc:
        msg = f"{where}: {str(exc).splitlines()[0]}"
        raise ConfigError(msg) from exc


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a table of {tp.__name__}"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _check(value: Any, tp: Any, *, where: str) -> Any:
    """``value`` as the annotation ``tp`` wants it (lists become tuples), or a one-line error."""
    ok, out = _coerce(value, tp)
    if not ok:
        msg = f"{where} must be {_describe(tp)}, got {value!r}"
        raise ConfigError(msg)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where=where)  # type: ignore[arg-type]
    if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        item = typing.get_args(tp)[0]
        return tuple(build(item, v, where=f"{where}[{i}]") for i, v in enumerate(value))
    return out


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp)), value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue  # TOML has no null: an unset key is None
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            return False, value
        pairs = [_coerce(v, args[0]) for v in value]
        return all(ok for ok, _ in pairs), tuple(v for _, v in pairs)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    return True, value


def to_toml(config: dict[str, Any]) -> str:
    """A resolved config (``as_dict`` of the dataclasses, keyed by section) as TOML.

    Top-level scalars first, then one ``[section]`` per mapping, lists of mappings as
    ``[[section.key]]``; None is left out (an unset key reads back as None).
    """
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in config.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables:
        lines += ["", f"[{name}]"]
        arrays: list[tuple[str, list[dict[str, Any]]]] = []
        for key, value in table.items():
            if (
                isinstance(value, list | tuple)
                and value
                and all(isinstance(v, dict) for v in value)
            ):
                arrays.append((key, list(value)))
            elif isinstance(value, dict):
                msg = f"to_toml: [{name}] `{key}` is a nested table, which no config has"
                raise TypeError(msg)
            elif value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, items in arrays:
            for item in items:
                lines += ["", f"[[{name}.{key}]]"]
                lines += [f"{k} = {_toml_value(v)}" for k, v in item.items() if v is not None]
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    msg = f"to_toml: cannot write {value!r}"
    raise TypeError(msg)
