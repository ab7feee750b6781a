"""Recognising interleaved 1F1B (Megatron's virtual pipeline stages) in a recorded step, and the
period a slice repeats or drops: ``pp`` microbatches through every chunk.

Stage ``s`` of ``pp`` holds ``V`` model chunks (virtual stage ``c * pp + s``) and runs ``m``
microbatches, ``m`` a multiple of ``pp``: ``m V`` forward and ``m V`` backward units. Megatron
runs ``w = min(2 (pp - s - 1) + (V - 1) pp, m V)`` warm-up forwards, then ``m V - w`` pairs (forward
``w + j``, backward ``j``), then ``w`` cool-down backwards. The unit of index ``k`` works on chunk
``(k mod pp V) div pp``, so the steady pairs repeat every ``pp V`` pairs, and ``pp`` more (or
fewer) microbatches add (or drop) exactly one such period while the warm-up and cool-down stay as
they are. (At ``m = pp`` Megatron runs every forward first, a different shape: a target needs
``m >= 2 pp``.)

The chunks are not told apart by name here (a middle stage's chunks often run the same ops), only
by position, so ``V`` is found from the pipeline's send/recv: every unit sends its result on and
receives its input, except at the two ends of the virtual pipeline. With ``pp >= 3`` the
wrap-around between the last stage and the first is no neighbour (its offset is ``pp - 1``: no
marker), so every marker kind a stage uses occurs ``m V`` times; with ``pp = 2`` the wrap-around
goes to the same neighbour and each kind occurs ``m (2V - 1)`` times. A ``V`` fits when ``m`` is
then a whole multiple of ``pp`` and a period of ``pp`` microbatches is seen repeating (``_region``)
(``batch`` tries ``V`` = 2, 3, ... on every representative at once: the first and last stages,
whose first and last chunks differ, rule out a ``V`` that only a middle stage's equal chunks
would allow).
"""

from __future__ import annotations

import numpy as np

from prism_trace.slicing.schedule import (
    BWD_MARKERS,
    FWD_MARKERS,
    Periods,
    ScheduleNotRecognised,
    StepShape,
)

__all__ = [
    "MAX_CHUNKS",
    "markers_per_microbatch",
    "min_target_microbatches",
    "recognise_interleaved",
]

MAX_CHUNKS = 8
"""The most chunks per stage tried (Megatron's configurations use 2-8 virtual stages)."""


def markers_per_microbatch(pp: int, chunks: int) -> int:
    """Send/recv of one marker kind per microbatch (module docstring)."""
    return chunks if pp >= 3 else 2 * chunks - 1


def min_target_microbatches(pp: int) -> int:
    """The fewest microbatches per rank a slice may give an interleaved schedule: below ``2 pp``
    Megatron's warm-up takes every forward (a shape the recorded periods do not make)."""
    return 2 * pp


def _longest_periodic(tokens: np.ndarray, lag: int) -> tuple[int, int]:
    """The longest stretch ``[lo, lo + n)`` whose tokens repeat at distance ``lag``, as
    ``(lo, n)``, ``n`` counting the stretch's last period too (0 when none)."""
    if lag <= 0 or lag >= tokens.size:
        return 0, 0
    eq = np.concatenate([[False], tokens[:-lag] == tokens[lag:], [False]])
    edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
    if edges.size == 0:
        return 0, 0
    lo, hi = edges[::2], edges[1::2]
    best = int(np.argmax(hi - lo))
    return int(lo[best]), int(hi[best] - lo[best]) + lag


def _region(tokens: np.ndarray, marker: np.ndarray, quota: int) -> Periods | None:
    """The longest region of equal periods holding ``quota`` of every marker kind the step uses
    (candidate period lengths: the distances between a marker and the one ``quota`` later).

    A period is trusted when the stretch of tokens repeating at its length covers at least one
    and a half of it (with ``m = 3 pp``, a first stage's steady state is ``pp - 2`` pairs short
    of two periods); the region holds the whole periods of that stretch.
    """
    kinds = [k for k in (*FWD_MARKERS, *BWD_MARKERS) if (marker == k).any()]
    pos = np.flatnonzero(marker == kinds[0])
    if pos.size <= quota:
        return None
    best: Periods | None = None
    for lag in np.unique(pos[quota:] - pos[:-quota]).tolist():
        lo, n = _longest_periodic(tokens, lag)
        count = n // lag
        if 2 * n < 3 * lag or (best is not None and count <= best.count):
            continue  # less than a period and a half seen repeating: no period to trust
        window = marker[lo : lo + lag]
        if all(int((window == k).sum()) == quota for k in kinds):
            best = Periods(lo, lag, count)
    return best


def recognise_interleaved(
    tokens: np.ndarray, marker: np.ndarray, *, stage: int, pp: int, chunks: int
) -> StepShape:
    """One step of one rank as interleaved 1F1B with ``chunks`` chunks per stage.

    Args:
        tokens: one integer per main-track node, equal for equal ops (``schedule.recognise_step``).
        marker: per node, which pipeline send/recv it is (0: none).
        stage: the rank's pipeline stage.
        pp: the pipeline's size (at least 2).
        chunks: the chunks per stage to try (at least 2).

    Raises:
        ScheduleNotRecognised: the counts or the periods do not fit (the message says which).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    marker = np.asarray(marker, dtype=np.int64)
    counts = {k: int((marker == k).sum()) for k in (*FWD_MARKERS, *BWD_MARKERS)}
    present = {v for v in counts.values() if v}
    if pp < 2 or chunks < 2 or len(present) != 1:
        msg = f"no interleaved schedule of {chunks} chunks on {pp} stages"
        raise ScheduleNotRecognised(msg)
    per = markers_per_microbatch(pp, chunks)
    (c,) = present
    if c % per or (c // per) % pp:
        msg = (
            f"{c} pipeline send/recv of each kind is not {per} per microbatch of a multiple of"
            f" {pp} microbatches ({chunks} chunks)"
        )
        raise ScheduleNotRecognised(msg)
    m = c // per
    run = _region(tokens, marker, per * pp)
    if run is None:
        msg = (
            f"{m} microbatches of {chunks} chunks: no period of {pp} microbatches seen repeating"
            " (a period and a half) in its steady state"
        )
        raise ScheduleNotRecognised(msg)
    warmup = min(2 * (pp - stage - 1) + (chunks - 1) * pp, m * chunks)
    return StepShape("interleaved", m, warmup, (run,), chunks=chunks, per_period=pp)
