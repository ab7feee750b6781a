"""The recording's per-thread cuBLAS workspaces, held again by a CUDA replay (``replay.blas``).

The thread lists follow the first GPU recording's rank 0 (an H200, gloo, dp 2): the autograd
thread ran 21817 ops with ``aten::mm``; the main thread 10010 ops with ``aten::addmm`` and
``aten::mm``; two gloo threads ran none.
"""

from __future__ import annotations

import polars as pl
import pytest
from prism_trace.replay.hybrid.blas import blas_threads, hold_blas_workspaces

_GPU = '[[1,2,0,4,4,"cuda:0"],[3,4,0,4,4,"cuda:0"]]'
_CPU = '[[1,2,0,4,4,"cpu"],[3,4,0,4,4,"cpu"]]'


def _ops(rows: list[tuple[int | None, str, str, str]]) -> pl.DataFrame:
    return pl.DataFrame(
        rows, schema=["tid", "name", "inputs", "input_types"], orient="row"
    ).with_columns(pl.col("tid").cast(pl.Int64))


def test_busiest_thread_first_with_its_gemm_kinds() -> None:
    f32 = '["Tensor(float)","Tensor(float)"]'
    bf16 = '["Tensor(c10::BFloat16)","Tensor(c10::BFloat16)"]'
    rows = [(1, "aten::addmm", _GPU, f32), (1, "aten::mm", _GPU, bf16), (1, "aten::add", _GPU, f32)]
    rows += [(2, "aten::mm", _GPU, f32)] * 3 + [(2, "aten::mul", _GPU, f32)] * 5
    rows += [
        (3, "aten::copy_", _GPU, f32),
        (4, "aten::mm", _CPU, f32),
        (None, "aten::mm", _GPU, f32),
        (5, "aten::mm", _GPU, '["Tensor(long int)","Tensor(long int)"]'),  # no cuBLAS GEMM
    ]
    assert blas_threads(_ops(rows)) == [
        [("aten::mm", "float32")],
        [("aten::addmm", "float32"), ("aten::mm", "bfloat16")],
    ]


def test_a_cpu_recording_holds_none() -> None:
    f32 = '["Tensor(float)","Tensor(float)"]'
    assert blas_threads(_ops([(1, "aten::mm", _CPU, f32)])) == []
    assert blas_threads(_ops([])) == []
    assert hold_blas_workspaces([], device=None) == 0


@pytest.mark.skipif(
    not pytest.importorskip("torch").cuda.is_available(), reason="needs a CUDA device"
)
def test_each_recorded_thread_leaves_a_workspace_allocated() -> None:
    import torch

    dev = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.memory_allocated(dev)
    n = hold_blas_workspaces([[("aten::mm", "float32")]] * 3, dev)
    assert n == 3
    # The helpers' workspaces outlive them: at least two more than before (this thread's may
    # have existed already).
    assert torch.cuda.memory_allocated(dev) > before
