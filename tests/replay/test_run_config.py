"""Each configured run stores its resolved config; `prism info --run R --config` reads it back as
TOML, and that file given to the run's command makes the same run (`replay.config_file`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from prism_trace.cli import main
from prism_trace.store.connection import open_store
from tests.replay.test_emulate import hand_store

# Every table an emulation writes rows to, ordered by all columns but the run id.
_TABLES = ("event", "iteration", "rank_step", "collective", "p2p", "rank", "comm_group", "track")


def _rows(db: Path, run: str) -> dict[str, list[tuple[Any, ...]]]:
    out = {}
    with open_store(db, read_only=True) as store:
        rid = store.require_run(run)
        for table in _TABLES:
            cols = [
                c
                for (c,) in store.con.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = ?"
                    " AND column_name <> 'run_id' ORDER BY ordinal_position",
                    [table],
                ).fetchall()
            ]
            sel = ", ".join(f'"{c}"' for c in cols)
            out[table] = store.con.execute(
                f"SELECT {sel} FROM {table} WHERE run_id = ? ORDER BY ALL", [rid]
            ).fetchall()
    return out


def test_emulate_from_file_and_flags_then_again_from_the_stored_config(tmp_path: Path) -> None:
    hand_store(tmp_path).close()
    db = tmp_path / "h.duckdb"
    cfg = tmp_path / "e.toml"
    cfg.write_text(
        'seed = 3\nwhat_if = ["slow-ranks=1@2"]\n[completion]\nrule = "common"\n'
        '[timing]\nmodel = "alpha_beta"\nchunks = 2\n[topology]\nsystem = "h100"\n'
        "inter_node_gbps = 12.5\n"
    )
    runner = CliRunner()
    first = [
        *("emulate", str(db), "--run", "h", "--out-run", "e1", "--config", str(cfg)),
        *("--topology", "a100", "--seed", "5", "--keep-events", "1"),
    ]
    assert (r := runner.invoke(main, first)).exit_code == 0, r.output
    shown = runner.invoke(main, ["info", str(db), "--run", "e1", "--config"])
    assert shown.exit_code == 0, shown.output
    text = shown.output
    # Flags won over the file; the file's other keys and the defaults are all there.
    for line in (
        "seed = 5",
        "keep_events = [1]",
        'rule = "common"',
        'model = "alpha_beta"',
        "chunks = 2",
        'system = "a100"',
        "intra_node_gbps = 230.0",  # a100's figure, not h100's: the preset changed, not its name
        "inter_node_gbps = 12.5",
        "factor = 2.0",
    ):
        assert f"\n{line}\n" in text, line
    stored = tmp_path / "stored.toml"
    stored.write_text(text)
    again = ["emulate", str(db), "--run", "h", "--out-run", "e2", "--config", str(stored)]
    assert (r := runner.invoke(main, again)).exit_code == 0, r.output
    assert runner.invoke(main, ["info", str(db), "--run", "e2", "--config"]).output == text.replace(
        "'e1'", "'e2'"
    )
    one, two = _rows(db, "e1"), _rows(db, "e2")
    assert one["event"]
    assert one["iteration"]
    assert one == two
    # Without the stored config (defaults) the run differs: the comparison can fail.
    plain = ["emulate", str(db), "--run", "h", "--out-run", "e3"]
    assert runner.invoke(main, plain).exit_code == 0
    assert _rows(db, "e3")["iteration"] != one["iteration"]
    # The JSON page of the run carries it too.
    page = runner.invoke(main, ["info", str(db), "--run", "e1", "--json"])
    assert '"rule": "common"' in page.output


def test_a_run_not_made_from_a_config_says_so_in_one_line(tmp_path: Path) -> None:
    hand_store(tmp_path).close()
    res = CliRunner().invoke(main, ["info", str(tmp_path / "h.duckdb"), "--run", "h", "--config"])
    assert res.exit_code == 1
    assert res.output.count("\n") == 1
    assert "run 'h' (recorded) was not made from a config file" in res.output


def test_replay_reads_its_config_and_flags_override_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prism replay --config`: [kernel_replay] and the virtual peers' sections reach replay_run,
    a flag given on the command line wins, a flag left at its default does not."""
    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.hybrid import replay as hybrid
    from prism_trace.replay.hybrid.options import KernelReplayOptions

    seen: dict[str, Any] = {}

    class _Report:
        def summary(self) -> str:
            return "ok"

    def fake(store: object, **kw: Any) -> _Report:
        seen.update(kw)
        return _Report()

    monkeypatch.setattr(hybrid, "replay_run", fake)
    hand_store(tmp_path).close()
    cfg = tmp_path / "r.toml"
    cfg.write_text(
        "seed = 4\n[kernel_replay]\niterations = 2\ngaps = 'none'\nbare_passes = 1\n"
        "together = false\n[timing]\nmodel = 'recorded'\n[replay]\nallow_partial = true\n"
    )
    base = ["replay", str(tmp_path / "h.duckdb"), "--run", "h", "--ranks", "0", "--out-run", "r"]
    res = CliRunner().invoke(main, [*base, "--config", str(cfg), "--iterations", "5"])
    assert res.exit_code == 0, res.output
    assert "[replay] is deprecated" in res.output
    assert seen["options"] == KernelReplayOptions(
        iterations=5, gaps="none", bare_passes=1, together=False
    )
    emu = seen["config"]
    assert (emu.seed, emu.timing.model, emu.completion.allow_partial) == (4, "recorded", True)
    # No file: the flags alone, over the defaults.
    res = CliRunner().invoke(main, [*base, "--wait", "spin"])
    assert res.exit_code == 0, res.output
    assert (seen["options"], seen["config"]) == (
        KernelReplayOptions(wait="spin"),
        EmulationConfig(),
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[kernel_replay]\nwarmup = 'one'\n")
    res = CliRunner().invoke(main, [*base, "--config", str(bad)])
    assert res.exit_code == 1
    assert res.output.strip().count("\n") == 0
    assert "bad.toml: [kernel_replay] `warmup` must be a whole number" in res.output


def test_replay_flag_defaults_are_the_option_defaults() -> None:
    """Flags override the file only when given; a flag's default must be the option's own."""
    import click
    from prism_trace.replay.hybrid.options import KernelReplayOptions

    from prism_trace.cli.time_cmds import _REPLAY_FLAGS, replay_cmd

    defaults = KernelReplayOptions()
    ctx = click.Context(replay_cmd)
    params = {p.name: p for p in replay_cmd.params}
    for name in _REPLAY_FLAGS:
        assert params[name].get_default(ctx) == getattr(defaults, name), name
    assert "override the file" in " ".join(params["config_file"].help.split())  # type: ignore[union-attr]


def test_an_emulated_run_stored_before_config_existed_is_read(tmp_path: Path) -> None:
    """Older emulated runs kept the sections at the top of config_json, with `replay`."""
    import json

    import duckdb
    from prism_trace.replay.config_file import load_emulation_config

    hand_store(tmp_path).close()
    db = tmp_path / "h.duckdb"
    runner = CliRunner()
    assert runner.invoke(main, ["emulate", str(db), "--run", "h", "--out-run", "e"]).exit_code == 0
    old = {
        "input_run": "h",
        "input_kind": "recorded",
        "replay": {"allow_partial": False, "completion": "common"},
        "timing": {"model": "recorded"},
        "seed": 9,
    }
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE run SET config_json = ? WHERE name = 'e'", [json.dumps(old)])
    shown = runner.invoke(main, ["info", str(db), "--run", "e", "--config"])
    assert shown.exit_code == 0, shown.output
    assert "input_run" not in shown.output
    toml = tmp_path / "old.toml"
    toml.write_text(shown.output)
    notes: list[str] = []
    cfg = load_emulation_config(toml, notes)
    assert (cfg.completion.rule, cfg.timing.model, cfg.seed) == ("common", "recorded", 9)
    assert len(notes) == 1
