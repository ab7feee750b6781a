"""`--config FILE.toml`: the TOML of docs/network.md is read; errors are one line naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prism_trace.replay.config_file import load_emulation_config, load_replay_config, to_toml
from prism_trace.replay.emulate.config import CompletionConfig, EmulationConfig, MemoryConfig
from prism_trace.replay.hybrid.options import KernelReplayOptions
from prism_trace.replay.model.timing import TimingConfig
from prism_trace.replay.model.topology import Topology
from prism_trace.replay.whatif.config import parse_what_if

from prism_trace.errors import ConfigError

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
        ("[topology]\nsytem = 'h100'\n", r"\[topology\]: unknown key\(s\) \['sytem'\]"),
        ("[topology\n", "not valid TOML"),
        ("[netwrok]\nx = 1\n", r"unknown section\(s\) \['netwrok'\]"),
        ("[network]\nx = 1\n", r"\[network\]: unknown key\(s\) \['x'\]"),
        ("[network]\nintra_gbps = -3.0\n", r"\[network\]: network `intra_gbps` must be"),
        ("[network]\nfile = 'missing.toml'\n", r"missing.toml: cannot read the config"),
        ("topology = 3\n", r"\[topology\] must be a table"),
        ("what_if = [1]\n", "what_if must be a list of strings"),
        ("what_if = ['slow-ranks=x@2']\n", "slow-ranks"),
    ],
)
def test_bad_configs_are_one_line(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        load_emulation_config(_write(text, "bad.md"))
    assert "\n" not in str(err.value)
    assert "bad.toml" in str(err.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_emulation_config(Path("/nonexistent/x.toml"))


def test_the_bandwidth_is_scaled_in_one_place(tmp_path: Path) -> None:
    """`topology.bandwidth_scale` and `--what-if bandwidth=` are one knob: both are refused."""
    from dataclasses import replace

    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_run
    from prism_trace.replay.whatif.config import WhatIfError, parse_what_if

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


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[timing]\nchunks = '4'\n", r"\[timing\] `chunks` must be a whole number, got '4'"),
        ("seed = true\n", "`seed` must be a whole number, got True"),
        ("keep_events = [1, 'x']\n", "`keep_events` must be a list of a whole number"),
        ("[completion]\nrule = 'sometimes'\n", r"`rule` must be 'per_rank' or 'common'"),
        ("[completion]\nallow_partial = 1\n", "`allow_partial` must be true or false, got 1"),
        ("[topology]\nsystem = 'h1000'\n", r"\[topology\]: unknown topology `system` 'h1000'"),
        ("[topology]\nintra_node_gbps = -1\n", "must be a positive finite number"),
        ("[what_if]\ndp = 0\n", r"\[what_if\]: dp must be >= 1"),
        ("[[what_if.slow]]\nfactor = 0\n", r"\[what_if\] `slow`\[0\]: slow-down factor"),
        ("[replay]\nx = 1\n[completion]\nrule = 'common'\n", r"\[replay\] is the old name"),
    ],
)
def test_wrong_types_and_values_are_one_line_naming_the_key(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        load_emulation_config(_write(text, "bad.md"))
    assert "\n" not in str(err.value)
    assert "bad.toml: " in str(err.value)


def test_the_old_replay_section_is_read_with_a_note() -> None:
    notes: list[str] = []
    cfg = load_emulation_config(
        _write("[replay]\nallow_partial = true\ncompletion = 'common'\n", "old.md"), notes
    )
    assert (cfg.completion.allow_partial, cfg.completion.rule) == (True, "common")
    assert len(notes) == 1
    assert "[replay] is deprecated; call it [completion]" in notes[0]


def test_what_if_as_a_table() -> None:
    cfg = load_emulation_config(
        _write(
            "[what_if]\nbandwidth_scale = 2\n[[what_if.slow]]\nfactor = 1.5\nranks = [1, 3]\n",
            "w.md",
        )
    )
    assert cfg.what_if == parse_what_if(("bandwidth=2", "slow-ranks=1,3@1.5"))


def test_a_resolved_config_round_trips_through_toml() -> None:
    """What `prism info --run R --config` prints reads back as the very same config."""
    cfg = EmulationConfig(
        completion=CompletionConfig(allow_partial=True, rule="common"),
        timing=TimingConfig(model="alpha_beta", chunks=4, reduction_gbps=1600.0),
        topology=Topology(system="h100", inter_node_gbps=12.5),
        memory=MemoryConfig(optimizer_state_bytes=1 << 40),
        what_if=parse_what_if(("slow-ops=fwd*@1.5", "slow-kind=kernel@1.1", "dp=4", "variance=op")),
        seed=7,
        keep_events=(3, 5),
    )
    assert load_emulation_config(_write(to_toml(cfg.as_dict()), "rt.md")) == cfg
    options = KernelReplayOptions(iterations=5, gaps="none", threads=2, wait="sleep")
    text = to_toml({"kernel_replay": options.as_dict(), **cfg.as_dict()})
    assert load_replay_config(_write(text, "rr.md")) == (options, cfg)


def test_the_replay_config() -> None:
    text = "seed = 2\n[kernel_replay]\niterations = 2\nthreads = 4\n[timing]\nmodel = 'recorded'\n"
    options, cfg = load_replay_config(_write(text, "r.md"))
    assert (options.iterations, options.threads, options.gaps) == (2, 4, "recorded")
    assert (cfg.timing.model, cfg.seed) == ("recorded", 2)
    for bad, why in [
        ("[kernel_replay]\nwait = 'nap'\n", r"\[kernel_replay\] `wait` must be 'auto' or 'spin'"),
        ("[kernel_replay]\nthreads = 'x'\n", "`threads` must be a whole number, got 'x'"),
        ("[kernel_replay]\niteration = 2\n", r"unknown key\(s\) \['iteration'\]"),
        ("[kernel]\n", r"unknown section\(s\) \['kernel'\]"),
    ]:
        with pytest.raises(ConfigError, match=why) as err:
            load_replay_config(_write(bad, "bad.md"))
        assert "\n" not in str(err.value)
        assert "bad.toml" in str(err.value)


def test_a_flag_changes_the_preset_not_only_its_name() -> None:
    h100 = Topology(system="h100", inter_node_gbps=12.5)
    a100 = h100.with_system("a100")
    assert a100 == Topology(system="a100", inter_node_gbps=12.5)
    assert a100.intra_node_gbps == Topology(system="a100").intra_node_gbps != h100.intra_node_gbps


def test_the_documented_replay_toml_loads() -> None:
    doc = DOC.with_name("replay.md")
    (block,) = re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S)
    options, cfg = load_replay_config(_write(block, "replay.md"))
    assert (options.iterations, options.gaps, options.bare_passes) == (5, "none", 2)
    assert (options.together, options.threads) == (False, 1)
    assert cfg.timing.model == "recorded"
