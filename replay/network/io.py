"""The ``net.toml`` file ``prism network fit`` writes and ``--network`` / ``[network]`` read.

One ``[network]`` table: the keys of `NetworkModel`, the same as the emulation config's
``[network]`` section, so a fit's output can be pasted into a job's config or named with
``[network] file = "net.toml"``.
"""

from __future__ import annotations

from pathlib import Path

from prism_trace.replay.config_file import build, read_toml, to_toml
from prism_trace.replay.network.model import NetworkModel

from prism_trace.errors import ConfigError, OutputError

__all__ = ["read_network_file", "write_network_file"]


def read_network_file(path: Path | str) -> NetworkModel:
    """The model in ``path``'s ``[network]`` table.

    Raises:
        ConfigError: the file is missing or not TOML, has no ``[network]`` table, or a key is
            unknown or out of range (one line naming the file).
    """
    data = read_toml(Path(path))
    table = data.get("network")
    if not isinstance(table, dict) or table.get("intra_gbps") is None:
        msg = (
            f"{path}: no fitted [network] table (write one with `prism network fit LOG... -o FILE`)"
        )
        raise ConfigError(msg)
    return build(NetworkModel, table, where=f"{path}: [network]")


def write_network_file(model: NetworkModel, path: Path | str, *, header: str = "") -> Path:
    """Write ``model`` as ``[network]`` TOML (``header`` as leading ``#`` comments).

    Raises:
        OutputError: the file cannot be written.
    """
    path = Path(path)
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    try:
        path.write_text(comments + to_toml({"network": model.as_table()}))
    except OSError as exc:
        msg = f"{path}: cannot write the network model: {exc.strerror or exc}"
        raise OutputError(msg) from exc
    return path
