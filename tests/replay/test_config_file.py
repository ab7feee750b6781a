"""`prism emulate --config FILE.toml`: the TOML of docs/network.md is read, flags override it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prism_trace.replay.config_file import load_emulation_config

from prism_trace.errors import PrismError

DOC = Path(__file__).resolve().parents[2] / "docs" / "network.md"


def test_the_documented_toml_loads() -> None:
    block = re.search(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None, "docs/network.md has no TOML example"
    cfg = load_emulation_config(_write(block.group(1), "network.md"))
    assert cfg.topology.system == "h100"
    assert cfg.timing.model == "scaled"
    assert cfg.what_if.bandwidth_scale == 0.5


def _write(text: str, name: str) -> Path:
    import tempfile

    out = Path(tempfile.mkdtemp()) / name.replace(".md", ".toml")
    out.write_text(text)
    return out


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[topology]\nsytem = 'h100'\n", "unexpected keyword argument 'sytem'"),
        ("[topology\n", "not valid TOML"),
        ("[network]\nx = 1\n", r"unknown section\(s\) \['network'\]"),
        ("topology = 3\n", r"\[topology\] must be a table"),
        ("what_if = [1]\n", "what_if must be a list of strings"),
        ("what_if = ['slow-ranks=x@2']\n", "slow-ranks"),
    ],
)
def test_bad_configs_are_one_line(text: str, why: str) -> None:
    with pytest.raises(PrismError, match=why) as err:
        load_emulation_config(_write(text, "bad.md"))
    assert "\n" not in str(err.value)
    assert "bad.toml" in str(err.value)


def test_missing_file() -> None:
    with pytest.raises(PrismError, match="cannot read the config"):
        load_emulation_config(Path("/nonexistent/x.toml"))
