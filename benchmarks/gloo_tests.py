"""gloo's collectives on this host, written as nccl-tests logs: the network of the CPU ladders.

A prediction prices the target's collectives with a network model fitted on the cluster's
nccl-tests logs (``prism network fit``, docs/network.md). The wait-mode ladders
(``bench_predict.py``) run every rank on one host, so their cluster is gloo over loopback on
the host's shared cores, and no nccl-tests exist for it. This measures what nccl-tests would:
for each group size ``n``, each collective and each size, ``n`` processes run the call, and the
log keeps the time from the last arrival to the last arriver's return (one host, one monotonic
clock; the rank meant to arrive last does so 2 ms after the others), the median over ``--reps``
calls: the transfer the emulator's last arriver carries, not nccl-tests' back-to-back average.
Each group size is one log per collective, ``<op>_perf_<n>r.log``, in nccl-tests' own layout (a
``# Using devices`` block of ``n`` ranks on one host, the out-of-place and in-place columns), so
``prism network fit`` reads it as it reads a cluster's.

Usage::

    python benchmarks/gloo_tests.py --out DIR [--ranks 2,4,8,16]
        [--ops all_reduce,reduce_scatter,all_gather] [--sizes 4,1024,...] [--reps 15]
    prism network fit DIR/*.log -o host-gloo.toml

Measured on the 2-core host (``results/gloo-tests_x86-64-2cpu_2026-11-28.md``): a 16-rank
all-reduce of 40-256 KiB takes 56-66 ms after the last arrival on a quiet host, whether the
others arrive together or spread over 10 or 40 ms before it (``--spread-ms``), twice what the
same calls take inside the ladder recordings (27-28 ms at dp 16: ``gloo_host.py --recording``).
So these logs do not stand for the job's own network, and the ladders' predictions are not
priced with a fit of them; and a 4-byte call (gloo's one-element path: 3 ms at 16 ranks) is 20
times faster than a 1 KiB one, which no latency-plus-bandwidth model follows (``prism network
fit`` of the four all-reduce logs: median error 60 %).

The sizes are nccl-tests' ``size`` (``max(in, out)`` bytes of float32): the whole input of a
reduce_scatter and the whole output of an all_gather, rounded down to a multiple of ``4n``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gloo_host import _run_ranks  # noqa: E402

__all__ = ["OPS", "main", "measure_group", "nccl_tests_log"]

OPS = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives the ladders call (``datasets/_comm.py``), by nccl-tests' binary stem."""

SIZES = (4, 1024, 4096, 16384, 65536, 262144, 1048576)
"""Bytes: the ladders' buckets (40-256 KB) and a decade either side."""


def _elements(op: str, size: int, n: int) -> tuple[int, int]:
    """(nccl-tests' size in bytes, each rank's input elements) of ``op`` at ``size`` over
    ``n`` ranks: list collectives move ``n`` parts, so their size is a multiple of ``4n``."""
    if op == "all_reduce":
        count = max(size // 4, 1)
        return 4 * count, count
    part = max(size // (4 * n), 1)
    return 4 * part * n, part


def _call(op: str, n: int, part: int) -> object:
    """A zero-argument function running ``op`` once on tensors made here (not in the timing)."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        t = torch.ones(part)
        return lambda: dist.all_reduce(t)
    if op == "reduce_scatter":
        out, ins = torch.empty(part), [torch.ones(part) for _ in range(n)]
        return lambda: dist.reduce_scatter(out, ins)
    if op == "all_gather":
        mine, outs = torch.ones(part), [torch.empty(part) for _ in range(n)]
        return lambda: dist.all_gather(outs, mine)
    raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")


def _rank(
    rank: int,
    n: int,
    ops: tuple[str, ...],
    sizes: tuple[int, ...],
    reps: int,
    spread_s: float,
    port: int,
    out: object,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    took: list[tuple[str, int, int, int, int]] = []
    for op in ops:
        for size in sizes:
            nbytes, part = _elements(op, size, n)
            call = _call(op, n, part)
            for i in range(reps + 2):
                dist.barrier()
                last = i % n  # who arrives last turns, so no rank's position is favoured
                early = spread_s * random.Random(f"{i}:{rank}").random()  # the others' spread
                time.sleep(0.010 + (spread_s + 0.002 if rank == last else early))
                t0 = time.monotonic_ns()
                call()  # type: ignore[operator]
                if i >= 2:  # two warm-up calls
                    took.append((op, nbytes, i, t0, time.monotonic_ns()))
    out.put(took)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def measure_group(
    n: int, ops: tuple[str, ...], sizes: tuple[int, ...], reps: int, spread_s: float = 0.0
) -> dict[tuple[str, int], float]:
    """Median last-arriver time (µs) of each (collective, nccl-tests size) over ``n`` local
    processes, all measured in one group (one spawn); the others arrive spread uniformly over
    ``spread_s`` before the last."""
    calls: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for op, nbytes, i, t0, t1 in _run_ranks(_rank, n, ops, sizes, reps, spread_s):  # type: ignore[misc]
        calls.setdefault((op, nbytes, i), []).append((t0, t1))
    samples: dict[tuple[str, int], list[float]] = {}
    for (op, nbytes, _), spans in calls.items():
        # One host, one monotonic clock: the transfer runs from the last arrival to the last
        # arriver's return, whichever rank that was (the barrier's own skew can beat 2 ms).
        arrival, done = max(spans)
        samples.setdefault((op, nbytes), []).append((done - arrival) / 1e3)
    return {key: statistics.median(v) for key, v in samples.items()}


_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n}
"""nccl-tests' bus factor: 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter."""


def nccl_tests_log(op: str, n: int, times: dict[int, float], *, reps: int) -> str:
    """One nccl-tests log of ``op`` over ``n`` ranks on this host: ``times`` maps nccl-tests'
    size (bytes) to µs, written as both the out-of-place and the in-place time."""
    host = platform.node() or "localhost"
    factor = _BUS_FACTOR.get(op, lambda n: (n - 1) / n)(n)
    redop = "none" if op == "all_gather" else "sum"
    lines = [
        "# nccl-tests layout, written by prism-trace benchmarks/gloo_tests.py (gloo on CPU,"
        " last-arriver median)",
        f"# Collective test starting: {op}_perf",
        f"# nThread 1 nGpus 1 minBytes {min(times)} maxBytes {max(times)} step: 4(factor)"
        f" warmup iters: 2 iters: {reps} agg iters: 1 validation: 0 graph: 0",
        "#",
        "# Using devices",
        *(
            f"#  Rank {r:>2} Group  0 Pid {os.getpid():>6} on {host:>10} device  0 [cpu] gloo"
            for r in range(n)
        ),
        "#",
        "#                                                              out-of-place"
        "                       in-place          ",
        "#       size         count      type   redop    root     time   algbw   busbw  #wrong"
        "     time   algbw   busbw  #wrong ",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)        "
        "     (us)  (GB/s)  (GB/s)         ",
    ]
    for size, us in sorted(times.items()):
        algbw = size / (us * 1e3)
        cols = f"{us:8.1f} {algbw:7.4f} {algbw * factor:7.4f}     N/A"
        lines.append(f"{size:12d}  {size // 4:12d}     float  {redop:>6}      -1 {cols} {cols}")
    lines += ["# Out of bounds values : 0 OK", f"# Collective test concluded: {op}_perf", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the logs")
    ap.add_argument("--ranks", default="2,4,8,16", help="group sizes, comma-separated")
    ap.add_argument("--ops", default=",".join(OPS), help="collectives, comma-separated")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    ap.add_argument("--reps", type=int, default=15, help="timed calls per size (median)")
    ap.add_argument(
        "--spread-ms",
        type=float,
        default=0.0,
        help="the other ranks arrive spread uniformly over this long before the last one",
    )
    a = ap.parse_args()
    ops = tuple(a.ops.split(","))
    for op in ops:
        if op not in OPS:
            ap.error(f"--ops: unknown collective {op!r}; one of {', '.join(OPS)}")
    sizes = tuple(int(x) for x in a.sizes.split(","))
    a.out.mkdir(parents=True, exist_ok=True)
    for n in (int(x) for x in a.ranks.split(",")):
        t0 = time.perf_counter()
        times = measure_group(n, ops, sizes, a.reps, a.spread_ms / 1e3)
        for op in ops:
            path = a.out / f"{op}_perf_{n}r.log"
            mine = {size: us for (o, size), us in times.items() if o == op}
            path.write_text(nccl_tests_log(op, n, mine, reps=a.reps))
            print(
                f"{path}: " + ", ".join(f"{s} B {us:.0f} µs" for s, us in sorted(mine.items())),
                flush=True,
            )
        print(f"{n} ranks in {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
