"""The calibration passes' spans read back from a Kineto trace (``top_level_spans``).

A CUDA replay's profiler mirrors each ``record_function`` onto the GPU timeline as a
``gpu_user_annotation`` event of the same name. The first replay on a GPU (an H200,
benchmarks/results/gpu-check_h200-*) counted each calibration pass twice and stopped with
"zip() argument 2 is longer than argument 1"; the events below follow that trace's shape.
"""

from __future__ import annotations

from pathlib import Path

import orjson
from prism_trace.replay.hybrid.call_overhead import PASS_MARK, top_level_spans


def _x(cat: str, name: str, ts: float, dur: float, tid: object) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _trace(tmp_path: Path, events: list[dict[str, object]]) -> Path:
    path = tmp_path / "calibration.kineto.json"
    path.write_bytes(orjson.dumps({"traceEvents": events}))
    return path


def test_gpu_mirrors_of_the_pass_mark_are_not_passes(tmp_path: Path) -> None:
    events = []
    for p, t0 in enumerate((1000.0, 5000.0)):
        events.append(_x("user_annotation", PASS_MARK, t0, 3000.0, 7))
        # The GPU's copy: the span of the kernels the pass launched, later than the host's.
        events.append(_x("gpu_user_annotation", PASS_MARK, t0 + 40.0, 2990.0, "stream 7"))
        events.append(_x("cpu_op", "aten::mm", t0 + 10.0, 100.0, 7))
        events.append(_x("cpu_op", "aten::addmm", t0 + 200.0, 50.0 + p, 7))
        events.append(_x("cpu_op", "aten::t", t0 + 210.0, 5.0, 7))  # nested in addmm
        events.append(_x("kernel", "sm90_xmma_gemm", t0 + 60.0, 30.0, "stream 7"))
        events.append(_x("cuda_runtime", "cudaLaunchKernel", t0 + 20.0, 4.0, 7))
    spans = top_level_spans(_trace(tmp_path, events))
    assert spans == [
        [("aten::mm", 1_010_000, 100_000), ("aten::addmm", 1_200_000, 50_000)],
        [("aten::mm", 5_010_000, 100_000), ("aten::addmm", 5_200_000, 51_000)],
    ]


def test_a_trace_without_categories_still_has_its_passes(tmp_path: Path) -> None:
    """Older exports may leave ``cat`` out of annotations: a mark without one is the host's."""
    events: list[dict[str, object]] = [
        {"ph": "X", "name": PASS_MARK, "ts": 0.0, "dur": 100.0, "tid": 1},
        _x("cpu_op", "aten::add", 1.0, 2.0, 1),
        _x("cpu_op", "aten::add", 1.0, 2.0, 2),  # another thread: not the pass's
    ]
    assert top_level_spans(_trace(tmp_path, events)) == [[("aten::add", 1000, 2000)]]
