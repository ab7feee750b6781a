"""The cuBLAS workspaces a recording held, held again by its replay on a GPU.

PyTorch gives each host thread its own cuBLAS handle, and each (handle, stream) pair a
workspace allocated through the caching allocator (32 MiB on Hopper), kept until the process
ends. A training step runs its forward pass on the main thread and its backward pass on the
autograd engine's device thread, so a recording holds two workspaces from the first step on; the
replay runs every op on one thread and would hold one. On the first GPU run (an H200,
benchmarks/results/gpu-check_h200-*_record-replay.md) the replay's peak was 33554432 B (exactly
one workspace) below the recording's.

So before its passes the replay runs, for every other recorded thread that ran GEMMs, the same
GEMM ops once on a thread of its own, all of them alive together so that each takes a handle of
its own. The workspaces outlive the threads (PyTorch keeps them per handle), as the recording's
did. Which ops count is a list (cuBLAS's GEMM family as ATen names them); an op that reaches
cuBLAS under another name is not seen.
"""

from __future__ import annotations

import threading
from typing import Any

import polars as pl
from prism_trace.replay.kernels.schema import dtype_of_type

__all__ = ["BLAS_OPS", "blas_threads", "hold_blas_workspaces"]

BLAS_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::_addmm_activation",
        "aten::mv",
        "aten::addmv",
    }
)
"""ATen ops that call cuBLAS / cuBLASLt for a floating-point GEMM (or GEMV) on CUDA."""

_GEMM_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})
"""Dtypes cuBLAS multiplies; an integer ``mm`` has no CUDA kernel to warm."""


def blas_threads(ops: pl.DataFrame) -> list[list[tuple[str, str]]]:
    """Per recorded host thread that ran a GEMM on a GPU, its distinct ``(op, dtype)``: the
    busiest thread (the one the replay's own thread stands for) first.

    Args:
        ops: one rank's ``et_op`` rows (``name``, ``tid``, ``inputs``, ``input_types``).
    """
    if ops.is_empty() or "tid" not in ops.columns:
        return []
    gemm = ops.filter(
        pl.col("name").is_in(list(BLAS_OPS))
        & pl.col("inputs").cast(pl.String).str.contains('"cuda')
        & pl.col("tid").is_not_null()
    )
    if gemm.is_empty():
        return []
    first_type = pl.col("input_types").cast(pl.String).str.extract(r'^\["([^"]*)"', 1)
    kinds = (
        gemm.select("tid", "name", first_type.alias("type"))
        .unique()
        .sort("tid", "name", "type")
        .to_dicts()
    )
    busy = ops.group_by("tid").len().filter(pl.col("tid").is_not_null())
    order = busy.sort(["len", "tid"], descending=[True, False])["tid"].to_list()
    per: dict[int, list[tuple[str, str]]] = {}
    for k in kinds:
        dtype = dtype_of_type(k["type"] or "") or "float32"
        if dtype not in _GEMM_DTYPES:  # no cuBLAS GEMM for it (and none to warm)
            continue
        per.setdefault(int(k["tid"]), []).append((k["name"], dtype))
    return [per[t] for t in order if t in per]


def _run_gemms(kinds: list[tuple[str, str]], device: Any) -> None:
    import torch

    for name, dtype_name in kinds:
        dt = getattr(torch, dtype_name)
        m = torch.ones(2, 2, dtype=dt, device=device)
        b = torch.ones(1, 2, 2, dtype=dt, device=device)
        v = torch.ones(2, dtype=dt, device=device)
        op = name.removeprefix("aten::")
        if op == "mm":
            torch.mm(m, m)
        elif op == "addmm":  # a 1-D bias, as a linear layer's: the cuBLASLt path where it has one
            torch.addmm(v, m, m)
        elif op == "_addmm_activation":
            torch._addmm_activation(v, m, m)
        elif op == "bmm":
            torch.bmm(b, b)
        elif op in ("baddbmm",):
            torch.baddbmm(b, b, b)
        elif op == "addbmm":
            torch.addbmm(m, b, b)
        elif op == "mv":
            torch.mv(m, v)
        elif op == "addmv":
            torch.addmv(v, m, v)
    torch.cuda.synchronize(device)


def hold_blas_workspaces(threads: list[list[tuple[str, str]]], device: Any) -> int:
    """Run each recorded thread's GEMMs once: the first on this thread, the others on helper
    threads alive together; returns how many threads ran them.

    Args:
        threads: from ``blas_threads``.
        device: the CUDA ``torch.device`` the replay runs on.
    """
    if not threads:
        return 0
    _run_gemms(threads[0], device)  # this thread's handle first: no helper's is left to it
    others = threads[1:]
    if not others:
        return 1
    import torch

    all_ran = threading.Barrier(len(others))
    errors: list[BaseException] = []

    def helper(kinds: list[tuple[str, str]]) -> None:
        try:
            torch.cuda.set_device(device)
            _run_gemms(kinds, device)
        except BaseException as exc:  # reported on the replay's thread
            errors.append(exc)
        finally:
            try:  # alive until every helper holds a handle of its own
                all_ran.wait(timeout=_WAIT_S)
            except threading.BrokenBarrierError as exc:
                errors.append(exc)

    workers = [threading.Thread(target=helper, args=(k,), daemon=True) for k in others]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=2 * _WAIT_S)
    if errors or any(w.is_alive() for w in workers):
        # Fewer workspaces than the recording held would skew the peak without a word: stop.
        what = repr(errors[0]) if errors else "a helper thread did not finish"
        msg = f"holding the recording's {len(threads)} cuBLAS workspaces failed: {what}"
        raise RuntimeError(msg) from (errors[0] if errors else None)
    return len(threads)


_WAIT_S = 60.0
"""How long a helper waits for the others (each runs a few 2 x 2 GEMMs)."""
