"""`prism predict`: emulate a small recording at a larger one's scale and compare the two.

It drives both layers below the CLI: the replay layer predicts (``replay.predict``), the analysis
layer compares (``analysis.prediction``); the command hands the one to the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import click

from prism_trace.cli._group import _one_line_errors, main
from prism_trace.cli._options import (
    config_option,
    db_argument,
    echo_report,
    emulation_config,
    json_option,
    network_option,
    out_run_option,
    replace_option,
    run_option,
)

__all__ = ["predict_cmd"]


@main.command("predict")
@db_argument()
@run_option("The small recording to predict from.", required=False)
@click.option("--against", required=True, help="The recording at the target scale.")
@click.option(
    "--replayed",
    default=None,
    help="Instead of --run: a replayed run (`prism run --world N --out-run R`) to compare.",
)
@click.option(
    "--variance",
    type=click.Choice(["replica", "iteration", "op"]),
    default=None,
    help="Emulate with each replica drawing its durations (seeded).",
)
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --variance: emulations, one per seed; their step times pool.",
)
@click.option(
    "--global-batch",
    type=click.Choice(["per-rank", "fixed"]),
    default="per-rank",
    show_default=True,
    help="fixed: the job keeps its global batch, so each target rank runs fewer (or more)"
    " microbatches than the recording, as `prism slice --global-batch fixed`.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Steps in common left out at the start.",
)
@network_option()
@config_option(
    "TOML of the emulation's sections (docs/network.md): the network, topology and timing the"
    " prediction is emulated with; its what-ifs are the prediction's own."
)
@out_run_option("Keep the (first seed's) emulated run under this name.", required=False)
@replace_option("Overwrite an emulated run called --out-run.")
@json_option("Print every figure as JSON.")
@_one_line_errors
def predict_cmd(
    db: Path,
    run_name: str | None,
    against: str,
    replayed: str | None,
    variance: Literal["replica", "iteration", "op"] | None,  # click.Choice checks it
    seeds: int,
    global_batch: Literal["per-rank", "fixed"],  # click.Choice checks it
    warmup: int,
    network_file: Path | None,
    config_file: Path | None,
    out_run: str | None,
    replace: bool,
    as_json: bool,
) -> None:
    """Predict AGAINST's job from the smaller recording RUN and compare it with AGAINST: the
    structure of a step, step times, waits, communication and memory. Writes nothing unless
    --out-run."""
    from functools import partial

    from prism_trace.store.connection import open_store

    if (run_name is None) == (replayed is None):
        msg = "give one of --run SMALL (to predict from) and --replayed R (to compare)"
        raise click.UsageError(msg)
    if replayed is not None:
        given = [
            o
            for o, v in (
                ("--variance", variance),
                ("--out-run", out_run),
                ("--network", network_file),
                ("--config", config_file),
            )
            if v
        ]
        if global_batch != "per-rank":
            given.append("--global-batch")
        if seeds != 1:
            given.append("--seeds")
        if given:
            msg = f"{', '.join(given)} go with --run (--replayed compares a run as it is)"
            raise click.UsageError(msg)
        from prism_trace.analysis.prediction.compare import compare_replayed

        with open_store(db, read_only=True) as store:
            report = compare_replayed(store, replayed, against, warmup=warmup)
        echo_report(report, as_json)
        return
    assert run_name is not None
    from prism_trace.analysis.prediction.compare import compare_runs
    from prism_trace.replay.predict.run import predict_run

    config = emulation_config(config_file, network_file)
    with open_store(db) as store:
        prediction = predict_run(
            store,
            run=run_name,
            against=against,
            compare=partial(compare_runs, warmup=warmup),
            variance=variance,
            seeds=seeds,
            global_batch=global_batch,
            out_run=out_run,
            replace=replace,
            config=config,
        )
    echo_report(prediction, as_json)
