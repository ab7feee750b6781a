"""The interleaved 1F1B recogniser on token sequences of Megatron's schedule (the generator's plans,
``datasets._interleaved``) over a grid of pipeline depths, chunks and microbatch counts: it finds
the recorded count and the chunks, and the sequence with whole periods added or dropped is the
schedule's own at the target count."""

from __future__ import annotations

import numpy as np
import pytest
from prism_trace.datasets._interleaved import interleaved_plans

from prism_trace.slicing.interleaved import min_target_microbatches, recognise_interleaved
from prism_trace.slicing.schedule import (
    RECV_NEXT,
    RECV_PREV,
    SEND_NEXT,
    SEND_PREV,
    ScheduleNotRecognised,
)


def _step(pp: int, chunks: int, m: int, stage: int) -> tuple[list[str], np.ndarray]:
    """One step of ``stage`` as token texts and markers, the way the slicer sees a main track: a
    chunk's ops by name (embedding on virtual stage 0, head on the last, the same layer ops
    elsewhere), a send/recv by direction and peer offset, a marker when the peer is one stage
    away."""
    texts: list[str] = []
    marks: list[int] = []
    last_virtual = pp * chunks - 1
    for a in interleaved_plans(pp, m, chunks)[stage]:
        if a.kind in ("fwd", "bwd"):
            virtual = a.chunk * pp + stage
            ops = ["layer", "layer"]
            if virtual == 0:
                ops = ["embed", *ops]
            if virtual == last_virtual:
                ops = [*ops, "head"]
            for op in ops if a.kind == "fwd" else ops[::-1]:
                texts.append(f"{a.kind}|{op}")
                marks.append(0)
            continue
        nxt = a.kind in ("send_fwd", "recv_bwd")
        peer = (stage + 1) % pp if nxt else (stage - 1) % pp
        d = peer - stage
        recv = a.kind.startswith("recv")
        texts.append(f"{'recv' if recv else 'send'}|{d}")
        if abs(d) != 1:
            marks.append(0)
        elif recv:
            marks.append(RECV_PREV if d < 0 else RECV_NEXT)
        else:
            marks.append(SEND_PREV if d < 0 else SEND_NEXT)
    return texts, np.asarray(marks, dtype=np.int64)


def _tokens(texts: list[str], vocab: dict[str, int]) -> np.ndarray:
    return np.asarray([vocab.setdefault(t, len(vocab)) for t in texts], dtype=np.int64)


GRID = [
    (pp, chunks, m) for pp in (2, 3, 4) for chunks in (2, 3, 4) for m in (pp * k for k in (3, 4, 6))
]


@pytest.mark.parametrize(("pp", "chunks", "m"), GRID)
def test_periods_rebuild_the_schedule_at_another_count(pp: int, chunks: int, m: int) -> None:
    """Every stage: the recorded count and chunks are found, and every target from ``2 pp`` to
    ``2 m`` microbatches that keeps a whole period is the recorded step with periods added or
    dropped; the others are the ones the slicer refuses."""
    for stage in range(pp):
        vocab: dict[str, int] = {}
        texts, marker = _step(pp, chunks, m, stage)
        shape = recognise_interleaved(
            _tokens(texts, vocab), marker, stage=stage, pp=pp, chunks=chunks
        )
        assert (shape.microbatches, shape.chunks, shape.per_period) == (m, chunks, pp)
        (run,) = shape.runs
        assert run.count >= 1
        for m_new in range(min_target_microbatches(pp), 2 * m + 1, pp):
            k = run.count + (m_new - m) // pp
            if k < 1:
                continue  # the slicer refuses: no whole period left on this stage
            built = texts[: run.start] + texts[run.start : run.start + run.length] * k
            built += texts[run.end :]
            want, _ = _step(pp, chunks, m_new, stage)
            assert built == want, f"stage {stage}: {m} -> {m_new} microbatches"


def test_a_wrong_chunk_count_does_not_fit() -> None:
    """Two chunks' schedule is not read as three (the counts do not divide), nor three as two
    (no period of two chunks seen repeating)."""
    for chunks, tried in ((2, 3), (3, 2)):
        texts, marker = _step(4, chunks, 12, 0)
        with pytest.raises(ScheduleNotRecognised):
            recognise_interleaved(_tokens(texts, {}), marker, stage=0, pp=4, chunks=tried)
