"""`prism emulate --config FILE.toml`: an `EmulationConfig` from TOML, with one-line errors.

The sections are the dataclasses of `EmulationConfig` (``[timing]``, ``[topology]``, ``[replay]``,
``[memory]``) plus ``seed``; what-ifs are written as the CLI writes them
(``what_if = ["slow-ranks=3@1.2", "bandwidth=0.5"]``), since that syntax is the documented one.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from prism_trace.replay.emulate_types import EmulationConfig
from prism_trace.replay.whatif import WhatIfError, parse_what_if

from prism_trace.errors import PrismError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["load_emulation_config"]

_SECTIONS = {"replay", "timing", "topology", "memory", "what_if", "seed"}


def load_emulation_config(path: Path) -> EmulationConfig:
    """Read ``path`` as TOML into an `EmulationConfig` (unset fields keep their defaults).

    Raises:
        PrismError: the file is missing or not TOML, or names an unknown section or key, or a
            what-if that does not parse.
    """
    try:
        data: dict[str, Any] = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        msg = f"{path}: cannot read the config: {exc.strerror or exc}"
        raise PrismError(msg) from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        msg = f"{path}: not valid TOML: {exc}"
        raise PrismError(msg) from exc
    unknown = sorted(set(data) - _SECTIONS)
    if unknown:
        msg = f"{path}: unknown section(s) {unknown}; known: {sorted(_SECTIONS)}"
        raise PrismError(msg)
    what_if = data.pop("what_if", None)
    if isinstance(what_if, str):
        what_if = [what_if]
    for name in _SECTIONS - {"seed", "what_if"}:
        if name in data and not isinstance(data[name], dict):
            msg = f"{path}: [{name}] must be a table of keys"
            raise PrismError(msg)
    if what_if is not None and (
        not isinstance(what_if, list) or not all(isinstance(w, str) for w in what_if)
    ):
        msg = f"{path}: what_if must be a list of strings like 'slow-ranks=3@1.2'"
        raise PrismError(msg)
    try:
        config = EmulationConfig.from_dict(data)
        if what_if:
            config = dataclasses.replace(config, what_if=parse_what_if(tuple(what_if)))
    except TypeError as exc:  # an unknown key: "Topology.__init__() got an unexpected ..."
        msg = f"{path}: {exc}".replace(".__init__()", "")
        raise PrismError(msg) from exc
    except (ValueError, WhatIfError) as exc:
        msg = f"{path}: {str(exc).splitlines()[0]}"
        raise PrismError(msg) from exc
    return config
