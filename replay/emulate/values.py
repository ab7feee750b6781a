"""The immutable values the emulation's stages pass: load → ``LoadedRun`` → prepare →
``PreparedRun`` → run → ``EmulationResult`` → write → ``WrittenRun``.

In one module so that the contract between the stages reads in one place. Every value is a frozen
dataclass: a stage that only amends its input returns ``dataclasses.replace`` of it, so no stage
sees another's changes. Frames and arrays are shared between the copies, never written in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import polars as pl
from prism_trace.replay.des.core import Timeline
from prism_trace.replay.des.replicas import Replicas
from prism_trace.replay.des.vector import ReplicaTimeline
from prism_trace.replay.whatif.variance_fit import VarianceFit

__all__ = ["EmulationResult", "LoadedRun", "PreparedRun", "WrittenRun"]


@dataclass(frozen=True, kw_only=True)
class LoadedRun:
    """A recorded or sliced run's graph and everything the core needs, as frames and arrays: what
    the load stage (``load.load_run``) returns and the prepare stage takes."""

    run: str  # the name in messages and the report: the run the user named
    run_id: int  # the run whose graph this is (a dp what-if's temporary re-slice)
    kind: str
    source_run_id: int
    world_size: int
    source_format: str | None
    unit_rank: np.ndarray  # rank (exemplar) of each unit
    unit_source: np.ndarray  # recorded rank whose events/iterations each unit replays
    rank_unit: pl.DataFrame  # rank, unit (every rank of the world that maps to a unit)
    nodes: pl.DataFrame  # sorted by (rank, node_id); + unit, idx, category
    edges: pl.DataFrame  # + s, d (node indices)
    origin: int
    # (recorded, emulated) data-parallel size: equal unless a sliced run changed it (the memory
    # replay re-sizes the optimizer shard between them), read with the run
    dp_sizes: tuple[int, int] = (1, 1)
    notes: tuple[str, ...] = ()
    # a sliced run's representatives as recorded: ``rank, kind, event_id, ts, rec_end`` of their
    # graph nodes (the memory at the target scale follows repeated and dropped microbatches by
    # them); None for a recorded run
    recorded_graph: pl.DataFrame | None = None


@dataclass(frozen=True, kw_only=True)
class PreparedRun(LoadedRun):
    """A loaded run with the what-ifs applied: what the prepare stage returns and the run stage
    takes. Its graph fields are the loaded ones, amended where a what-if changes the units
    (expanded replicas) or the durations (``emu_dur``, ``factor``, ``scale`` node columns)."""

    # ranks left out of the results, with why (remove-gpu: the failed GPU and its tp slot)
    left_out: Mapping[int, str] = field(default_factory=dict)
    # group sizes that differ from the communicator's, for the transfer model (remove-gpu)
    size_override: Mapping[int, int] = field(default_factory=dict)
    parent_run_id: int | None = None  # the dp what-if: the run the user named, not the re-slice
    # no-stragglers: nodes that keep their recorded time (a slowdown group, ``emulate.slowdown``)
    keep_recorded: np.ndarray | None = None
    # replicas distinct on the class graph (replay.vector): the data-parallel replicas as
    # columns; None: one unit per class, or expanded units
    grid: Replicas | None = None
    # remove-gpu on the replica vector: the failed replica's column, its tp groups' sizes (class
    # graph group ids) and the factor on its compute and transfers (replay.vector.class_groups)
    failed_column: tuple[int, Mapping[int, int], float] | None = None
    # variance=replica: the model fitted on the recorded replicas (replay.whatif.variance_fit);
    # the replica vector draws its columns from it in the run stage
    variance_fit: VarianceFit | None = None


@dataclass(frozen=True)
class EmulationResult:
    """What the run stage returns: the emulated timeline of a prepared run.

    Immutable; ``run_memory.with_memory`` returns a copy with the re-timed memory, and the frames,
    the write stage and the validation (``replay.validate.inside_step``) read it.

    Attributes:
        inputs: the prepared run, with the run stage's notes added.
        timeline: every node's emulated start and end (replica 0's with the replica vector) and
            every instance's last arrival.
        sync: one row per communication node that synchronises (``load._sync_frame``), with its
            ``instance`` and recorded transfer.
        n_collective: collective instances.
        n_p2p: send/recv instances.
        seconds: the core's time.
        memory: each unit's re-timed memory (``unit`` + ``replay.memory.MEMORY_COLUMNS`` less
            ``rank``); None until ``run_memory.with_memory``.
        replicas: every replica's times (``inputs.grid`` set).
        shared: per instance, whether it spans the replicas (``inputs.grid`` set).
    """

    inputs: PreparedRun
    timeline: Timeline
    sync: pl.DataFrame  # sync frame + instance, unit
    n_collective: int
    n_p2p: int
    seconds: float
    memory: pl.DataFrame | None = None  # unit + replay.memory.MEMORY_COLUMNS less rank
    replicas: ReplicaTimeline | None = None  # every replica's times (inputs.grid set)
    shared: np.ndarray | None = None  # per instance: spans the replicas (inputs.grid set)


@dataclass(frozen=True)
class WrittenRun:
    """What the write stage returns: the run written, and the result with its memory.

    Attributes:
        result: the run stage's result with its re-timed memory (``run_memory.with_memory``).
        iterations: every rank's emulated iterations, as written.
        run_id: the new run's id.
        n_events: ``event`` rows written.
        n_rank_step: ``rank_step`` rows written.
        rank_step_s: seconds spent working out and inserting the ``rank_step`` rows.
    """

    result: EmulationResult
    iterations: pl.DataFrame
    run_id: int
    n_events: int
    n_rank_step: int
    rank_step_s: float
