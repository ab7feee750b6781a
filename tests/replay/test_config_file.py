"""`prism emulate --config FILE.toml`: the TOML of docs/network.md is read, flags override it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prism_trace.replay.config_file import load_emulation_config

from prism_trace.errors import PrismError

DOC = Path(__file__).resolve().parents[2] / "docs" / "network.md"


def test_the_documented_toml_loads() -> None:
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 2, "docs/network.md: the ASTRA-sim block and the Configuration one"
    astra, cfg = (load_emulation_config(_write(b, "network.md")) for b in blocks)
    assert cfg.topology.system == "h100"
    assert cfg.timing.model == "scaled"
    assert cfg.what_if.bandwidth_scale == 0.5
    assert (astra.timing.chunks, astra.timing.all_to_all) == (4, "ring")
    assert astra.timing.reduction_gbps == 1600.0
    assert astra.topology.intra_node_gbps == pytest.approx(50 * 2**30 / 1e9, rel=1e-4)


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


def test_the_bandwidth_is_scaled_in_one_place(tmp_path: Path) -> None:
    """`topology.bandwidth_scale` and `--what-if bandwidth=` are one knob: both are refused."""
    from dataclasses import replace

    from prism_trace.replay.emulate import EmulationConfig, emulate_run
    from prism_trace.replay.whatif import WhatIfError, parse_what_if

    from tests.replay.test_emulate import hand_store

    store = hand_store(tmp_path)
    base = EmulationConfig()
    both = replace(
        base,
        topology=replace(base.topology, bandwidth_scale=2.0),
        what_if=parse_what_if(("bandwidth=2",)),
    )
    with pytest.raises(WhatIfError, match="scaled twice"):
        emulate_run(store, run="h", out_run="e", config=both)
    one = replace(base, what_if=parse_what_if(("bandwidth=2",)))
    assert emulate_run(store, run="h", out_run="e", config=one).run_id > 0
