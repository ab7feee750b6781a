"""What a gloo all-reduce costs on this host as the group grows: the transfer of the CPU ladders.

The wait-mode ladders (``bench_predict.py``) run every rank on one host, so their "network" is
gloo over loopback on the host's shared cores. A prediction carries the smallest recording's
transfer to a larger group by the ring model's ratio (``docs/network.md``: ``2(n-1)`` hops,
``2(n-1)/n`` of the bytes per rank). This measures the real growth: for each group size, ``n``
processes all-reduce a float32 tensor, one of them arriving 2 ms after the others (so that its
call times the transfer alone, as the emulator's last arriver does), and the median over
repetitions is set beside the 2-rank figure and the ring's hop ratio.

``--recording FOLDER`` reads the same figure off a ladder recording instead: per gloo
collective of the step, the shortest call among the first stage's ranks (the last arriver's),
median over the steps.

Usage::

    python benchmarks/gloo_host.py [--sizes 4,40960,262144,1048576] [--ranks 2,4,8,16] [--reps 15]
    python benchmarks/gloo_host.py --recording LADDER/tp1-dp16-pp2-1f1b-wait-mb4-s100
    python benchmarks/gloo_host.py --spin-check --ranks 2,4,8 --reps 5

Measured on a 2-core host (``benchmarks/results/gloo-host_*.md``): from 2 to 16 ranks, a 40 KiB
and a 256 KiB all-reduce grow about a hundredfold while the ring's hops grow 15-fold, and a
4-byte one 7-fold.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import host_kind, write_note  # noqa: E402

__all__ = ["main", "measure"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, n: int, nbytes: int, reps: int, port: int, out: object) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    t = torch.ones(max(nbytes // 4, 1))
    took = []
    for i in range(reps + 2):
        dist.barrier()
        last = i % n  # who arrives last turns, so no rank's position is favoured
        time.sleep(0.010 + (0.002 if rank == last else 0.0))
        t0 = time.perf_counter_ns()
        dist.all_reduce(t)
        if rank == last and i >= 2:  # two warm-up calls
            took.append(time.perf_counter_ns() - t0)
    out.put(took)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def measure(n: int, nbytes: int, reps: int) -> float:
    """Median transfer (µs) of a gloo all-reduce of ``nbytes`` over ``n`` local processes."""
    return statistics.median(_run_ranks(_rank, n, nbytes, reps)) / 1e3


def _run_ranks(target: Any, n: int, *args: Any) -> list[float]:
    """Run ``target(rank, n, *args, port, queue)`` in ``n`` spawned processes; every value the
    ranks put on the queue, in one list."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, n, *args, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    out = [x for _ in procs for x in q.get(timeout=600)]
    for p in procs:
        p.join(timeout=60)
    return out


def _waiting_rank(rank: int, n: int, late_s: float, reps: int, port: int, out: object) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    t = torch.ones(10240)
    ratios = []
    for i in range(reps + 1):
        dist.barrier()
        if rank == n - 1:
            time.sleep(late_s)  # the late rank: every other rank waits for it inside the call
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        dist.all_reduce(t)
        cpu, wall = time.process_time_ns() - c0, time.perf_counter_ns() - w0
        if rank != n - 1 and i >= 1:  # one warm-up call
            ratios.append(cpu / wall)
    out.put(ratios)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def spin_check(n: int, late_s: float, reps: int) -> tuple[float, float]:
    """Whether a rank waiting inside a gloo all-reduce keeps a core: the median and the largest
    CPU time over wall time of the waiting ranks' calls (all of the process's threads), while
    one rank of ``n`` arrives ``late_s`` late. About 1: it spins; about 0: it sleeps."""
    ratios = _run_ranks(_waiting_rank, n, late_s, reps)
    return statistics.median(ratios), max(ratios)


_P2P = ("gloo:send", "gloo:recv")
"""Left out: a blocking send or receive's shortest call is no transfer (it waits for its peer)."""


def recorded(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Per gloo collective (``gloo:all_reduce``, ``gloo:reduce_scatter``...) and per call of it in
    a step: the calls per rank and the median over the steps of the last arriver's duration
    (µs), the shortest call among the first stage's ranks."""
    run = json.loads((folder / "run.json").read_text())
    dp, steps = int(run["config"]["dp"]), max(int(run["config"]["steps"]), 1)
    calls: dict[str, list[list[float]]] = {}
    for rank in range(dp):  # the first stage: ranks 0 .. dp - 1
        with gzip.open(folder / f"rank{rank}.kineto.json.gz") as f:
            events = json.load(f)["traceEvents"]
        mine: dict[str, list[float]] = {}
        for e in sorted(events, key=lambda e: e.get("ts", 0)):
            name = str(e.get("name", ""))
            if e.get("ph") == "X" and name.startswith("gloo:") and name not in _P2P:
                mine.setdefault(name, []).append(float(e["dur"]))
        for name, durs in mine.items():
            calls.setdefault(name, []).append(durs)
    out: dict[str, list[tuple[int, float]]] = {}
    for name, per_rank in sorted(calls.items()):
        if len(per_rank) < dp:
            continue
        n = min(len(c) for c in per_rank)
        last = [min(c[i] for c in per_rank) for i in range(n)]
        per_step = max(n // steps, 1)
        out[name] = [(n // per_step, statistics.median(last[j::per_step])) for j in range(per_step)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recording", type=Path, help="a ladder recording to read instead")
    ap.add_argument("--sizes", default="4,40960,262144,1048576", help="bytes, comma-separated")
    ap.add_argument("--ranks", default="2,4,8,16", help="group sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-note", action="store_true", help="do not write benchmarks/results")
    ap.add_argument(
        "--spin-check",
        action="store_true",
        help="whether ranks waiting in an all-reduce spin: their CPU over wall time, one rank"
        " 200 ms late, for each of --ranks (prints, writes nothing)",
    )
    a = ap.parse_args()
    if a.spin_check:
        for n in (int(x) for x in a.ranks.split(",")):
            med, top = spin_check(n, 0.2, a.reps)
            print(
                f"{n} ranks, one 200 ms late: waiting ranks' CPU / wall median {med:.3f},"
                f" largest {top:.3f}",
                flush=True,
            )
        return
    if a.recording:
        for name, per_step in recorded(a.recording).items():
            for j, (count, us) in enumerate(per_step):
                print(f"{name} {j} of a step: {count} calls, last arriver median {us:.0f} µs")
        return
    sizes = [int(x) for x in a.sizes.split(",")]
    ranks = [int(x) for x in a.ranks.split(",")]
    base = ranks[0]
    lines = [
        "| bytes | ranks | transfer (µs) | x the smallest group | ring hops x |",
        "|---|---|---|---|---|",
    ]
    for nbytes in sizes:
        first = None
        for n in ranks:
            us = measure(n, nbytes, a.reps)
            first = first or us
            hops = (n - 1) / (base - 1)
            lines.append(f"| {nbytes} | {n} | {us:.0f} | {us / first:.1f} | {hops:.1f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    if not a.no_note:
        note = write_note(
            "gloo-host",
            host_kind(),
            title="gloo all-reduce on one host: transfer against group size",
            command=f"python benchmarks/gloo_host.py --sizes {a.sizes} --ranks {a.ranks}"
            f" --reps {a.reps}",
            body=(
                "The last arriver's all-reduce (it arrives 2 ms after the others), median over"
                f" {a.reps} calls; `ring hops x` is the ring model's growth of its latency steps"
                f" from {base} ranks, `2(n-1)` (its bandwidth term grows by `2(n-1)/n` only).\n\n"
                + text
            ),
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()
