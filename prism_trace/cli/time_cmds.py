"""Commands that make time: emulate, replay with real kernels, validate, run a script."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import click

from prism_trace.cli._group import RANKS, _given_flags, _one_line_errors, main
from prism_trace.cli._options import (
    WORLD,
    config_option,
    db_argument,
    echo_report,
    emulation_config,
    existing_store,
    json_option,
    network_option,
    out_run_option,
    partial_option,
    replace_option,
    run_option,
)
from prism_trace.errors import UsageError

__all__ = ["emulate_cmd", "replay_cmd", "run_cmd", "validate_cmd"]


@main.command("emulate")
@db_argument()
@run_option("Recorded or sliced run.")
@out_run_option("Name of the emulated run.")
@replace_option()
@click.option(
    "--what-if",
    "what_ifs",
    multiple=True,
    help="Repeatable: slow-ranks=3,5..7@1.2 | slow-ops=GLOB@1.5 | slow-kind=kernel@1.1 |"
    " remove-gpu=RANK | dp=N | bandwidth=FACTOR | variance[=replica|iteration|op].",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the variance mode.")
@click.option(
    "--keep-events",
    "keep_events",
    type=RANKS,
    default=None,
    help="Ranks whose own per-op events are written (default: class exemplars only): 5,9..11.",
)
@click.option(
    "--topology",
    "system",
    type=click.Choice(["generic", "a100", "h100", "h200"]),
    default="generic",
    show_default=True,
    help="Network preset of the transfer model (docs/network.md).",
)
@click.option(
    "--timing",
    "timing_model",
    type=click.Choice(["scaled", "recorded", "alpha_beta"]),
    default="scaled",
    show_default=True,
    help="Transfer times: recorded, carried to a new scale by the model, or the pure model.",
)
@click.option("--calibrate", is_flag=True, help="Fit the network model to recorded collectives.")
@network_option()
@config_option(
    "TOML of the emulation's sections (docs/network.md); flags given on the command line"
    " override the file. `prism info DB --run E --config` prints a run's resolved config."
)
@partial_option("A recording of some ranks: complete each collective over the ranks present.")
@json_option()
@_one_line_errors
def emulate_cmd(
    db: Path,
    run_name: str,
    out_run: str,
    replace: bool,
    what_ifs: tuple[str, ...],
    seed: int,
    keep_events: list[int] | None,
    system: str,
    timing_model: Literal["recorded", "scaled", "alpha_beta"],  # click.Choice checks it
    calibrate: bool,
    network_file: Path | None,
    config_file: Path | None,
    partial: bool,
    as_json: bool,
) -> None:
    """Discrete-event emulation of RUN's graph; the result is a run of kind `emulated`."""
    from dataclasses import replace as with_

    from prism_trace.replay import emulate_run
    from prism_trace.replay.whatif.config import parse_what_if
    from prism_trace.store.connection import open_store

    config = emulation_config(config_file, network_file)
    given = _given_flags()
    if what_ifs:
        config = with_(config, what_if=parse_what_if(what_ifs))
    if "seed" in given or config_file is None:
        config = with_(config, seed=seed)
    if "system" in given or config_file is None:
        config = with_(config, topology=config.topology.with_system(system))
    if "timing_model" in given or config_file is None:
        config = with_(config, timing=with_(config.timing, model=timing_model))
    if calibrate:
        config = with_(config, timing=with_(config.timing, calibrate=True))
    if partial:
        config = with_(config, completion=with_(config.completion, allow_partial=True))
    if keep_events:
        config = with_(config, keep_events=tuple(keep_events))
    with open_store(db) as store:
        report = emulate_run(store, run=run_name, out_run=out_run, replace=replace, config=config)
    echo_report(report, as_json)


_REPLAY_FLAGS = (
    "device",
    "iterations",
    "warmup",
    "substitute_recorded",
    "gaps",
    "instrument",
    "call_overhead",
    "threads",
    "recorded_lifetimes",
    "wait",
    "together",
)
"""`prism replay`'s flags that are `KernelReplayOptions` fields of the same name."""


@main.command("replay")
@db_argument()
@run_option("Recorded or sliced run.")
@click.option("--ranks", type=RANKS, required=True, help="Ranks to replay with real kernels: 0,5.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@out_run_option("Name of the replayed run.")
@click.option("--iterations", type=int, default=3, show_default=True, help="Measured passes.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Passes not measured.")
@click.option("--substitute-recorded", is_flag=True, help="Unsupported ops: recorded duration.")
@click.option("--gaps", type=click.Choice(["recorded", "none"]), default="recorded")
@click.option("--instrument", type=click.Choice(["none", "profiler"]), default="none")
@click.option(
    "--call-overhead/--no-call-overhead",
    default=True,
    show_default=True,
    help="Under --instrument profiler, spend the recorded gaps less the replay's own cost of"
    " calling each op outside its profiled span (measured in two calibration passes).",
)
@click.option("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads).")
@click.option(
    "--recorded-lifetimes/--op-lifetimes",
    default=True,
    show_default=True,
    help="Free each result when the recording's allocator did (when it has allocator events"
    " and that is after the result's last use), or right after its last use.",
)
@click.option(
    "--wait",
    type=click.Choice(["auto", "spin", "sleep"]),
    default="auto",
    show_default=True,
    help="Waits for gaps and virtual peers: spin on the clock, or sleep through long ones"
    " (auto: spin when each replaying process has cores of its own).",
)
@click.option(
    "--together/--one-by-one",
    default=True,
    show_default=True,
    help="Several ranks: one process each, talking through torch.distributed; or one after the"
    " other in this process, each seeing the others as virtual peers.",
)
@config_option(
    "TOML: [kernel_replay] (these options and more) and the virtual peers' emulation"
    " sections (docs/replay.md); flags given on the command line override the file."
)
@replace_option("Overwrite an existing replayed run.")
@json_option()
@_one_line_errors
def replay_cmd(
    db: Path,
    run_name: str,
    ranks: list[int],
    device: str,
    out_run: str,
    iterations: int,
    warmup: int,
    substitute_recorded: bool,
    gaps: str,
    instrument: str,
    call_overhead: bool,
    threads: int | None,
    recorded_lifetimes: bool,
    wait: str,
    together: bool,
    config_file: Path | None,
    replace: bool,
    as_json: bool,
) -> None:
    """Replay RANKS of RUN with real kernels; the other ranks are virtual peers."""
    from dataclasses import replace as with_

    from prism_trace.replay.config_file import load_replay_config
    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.hybrid.options import KernelReplayOptions
    from prism_trace.replay.hybrid.replay import replay_run
    from prism_trace.store.connection import open_store

    notes: list[str] = []
    options, config = (
        (KernelReplayOptions(), EmulationConfig())
        if config_file is None
        else load_replay_config(config_file, notes)
    )
    for note in notes:
        click.echo(f"note: {note}", err=True)
    # Each flag's default is the option's default, so without a file this is the flags alone.
    flags = click.get_current_context().params
    given = _given_flags()
    options = with_(options, **{k: flags[k] for k in _REPLAY_FLAGS if k in given})
    with open_store(db) as store:
        report = replay_run(
            store,
            run=run_name,
            ranks=ranks,
            out_run=out_run,
            options=options,
            replace=replace,
            config=config,
        )
    echo_report(report, as_json)


@main.command("validate")
@db_argument()
@run_option("A run whose ranks were all recorded.", required=False)
@click.option("--replayed", default=None, help="Instead: a replayed run against its recording.")
@click.option("--slice-ranks", type=RANKS, default=None, help="Ranks to slice from, e.g. 0..6:2.")
@click.option(
    "--variance",
    type=click.Choice(["replica", "iteration", "op"]),
    default=None,
    help="Also emulate the slice with each replica drawing its durations (seeded).",
)
@click.option("--seeds", type=int, default=5, show_default=True, help="Seeds of --variance.")
@partial_option(
    "A run missing ranks: replay the recorded ones (collectives over the ranks present)."
)
@json_option()
@_one_line_errors
def validate_cmd(
    db: Path,
    run_name: str | None,
    replayed: str | None,
    slice_ranks: list[int] | None,
    variance: str | None,
    seeds: int,
    partial: bool,
    as_json: bool,
) -> None:
    """Iteration-time error of emulating RUN from all its ranks, and from a slice of them."""
    from prism_trace.replay import validate_run
    from prism_trace.store.connection import open_store

    if replayed is not None:
        from prism_trace.replay.validate.replayed import validate_replayed

        with open_store(db, read_only=True) as store:
            rv = validate_replayed(store, replayed=replayed)
        echo_report(rv, as_json)
        return
    if run_name is None:
        msg = "give --run RUN (or --replayed NAME)"
        raise click.UsageError(msg)
    with open_store(db) as store:
        if slice_ranks is not None:  # here, not as a note of the slice check under its name
            from prism_trace.query.info import require_ranks

            require_ranks(store, run_name, slice_ranks, option="--slice-ranks", recorded=True)
        report = validate_run(
            store,
            run=run_name,
            slice_ranks=slice_ranks,
            variance=variance,  # type: ignore[arg-type]
            seeds=seeds,
            allow_partial=partial,
        )
    echo_report(report, as_json)


@main.command(
    "run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option("--world", "world_size", required=True, type=WORLD, help="Ranks of the emulated job.")
@click.option(
    "--ranks", type=RANKS, default="0", show_default=True, help="Ranks to run for real, e.g. 0,1."
)
@click.option(
    "--db",
    type=click.Path(path_type=Path),
    default=None,
    callback=existing_store,
    help="Store with --run.",
)
@run_option("Run whose timing the virtual peers follow.", required=False)
@click.option("--timeout-s", type=float, default=None, help="Stop every rank after this long.")
@out_run_option("Store the step times as this replayed run.", required=False)
@replace_option("Overwrite an existing replayed run (--out-run).")
@json_option("Print the result as JSON.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_one_line_errors
def run_cmd(
    world_size: int,
    ranks: list[int],
    db: Path | None,
    run_name: str | None,
    timeout_s: float | None,
    out_run: str | None,
    replace: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Run an unmodified training COMMAND as --ranks of a --world job; the rest are virtual."""
    from prism_trace.replay.pg.launch import launch

    if out_run is not None and (db is None or run_name is None):
        msg = "--out-run needs --db and --run (the replayed run's parent)"
        raise UsageError(msg)
    res = launch(
        list(command),
        world_size=world_size,
        ranks=ranks,
        db=db,
        run=run_name,
        timeout_s=timeout_s,
    )
    echo_report(res, as_json, err=not as_json)
    if out_run is not None and db is not None and run_name is not None and res.returncode == 0:
        from prism_trace.replay.pg.launched_run import write_launched_run
        from prism_trace.store.connection import open_store

        with open_store(db) as store:
            write_launched_run(
                store, run=run_name, out_run=out_run, result=res, command=command, replace=replace
            )
        click.echo(
            f"wrote replayed run {out_run!r}; compare: prism validate {db} --replayed {out_run}",
            err=True,
        )
    sys.exit(res.returncode)
