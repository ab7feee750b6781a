"""How much this machine's speed drifts from one second to the next: the noise floor of timing.

A recording and its replay are taken seconds to minutes apart, so any comparison of the two
(``bench_replay_accuracy.py``, ``bench_run_accuracy.py``) cannot be more exact than the machine
is steady. This times the same small CPU work (a 64x64 ``mm``, an ``add_`` and a ``t``: the size
of the generator's ops) on 1 thread, ``--samples`` times with a pause between, and prints the
spread of the per-op time.

Usage::

    python benchmarks/bench_machine_drift.py
    python benchmarks/bench_machine_drift.py --samples 60 --pause 0.5 --no-note
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import host_kind, table, write_note


def main() -> None:
    """Sample, print (and note) the spread."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--ops", type=int, default=9000, help="ops per sample")
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    x, y = torch.rand(64, 64), torch.rand(64, 64)
    per_op_us = []
    t_start = time.perf_counter()
    for _ in range(args.samples):
        t0 = time.perf_counter()
        for _ in range(args.ops // 3):
            z = torch.mm(x, y)
            z.add_(1.0)
            z.t()
        per_op_us.append((time.perf_counter() - t0) / (args.ops // 3 * 3) * 1e6)
        time.sleep(args.pause)
    lo, med, hi = min(per_op_us), statistics.median(per_op_us), max(per_op_us)
    rows = [
        (
            "per-op time",
            f"min {lo:.2f} us, median {med:.2f} us, max {hi:.2f} us over {args.samples} samples"
            f" in {time.perf_counter() - t_start:.0f} s",
        ),
        ("spread", f"max/min {hi / lo:.2f}, (max - min) / median {100 * (hi - lo) / med:.1f} %"),
        ("samples (us/op)", " ".join(f"{v:.2f}" for v in per_op_us)),
    ]
    body = table(rows)
    print(body)
    if not args.no_note:
        note = write_note(
            "machine-drift",
            host_kind(args.host_kind),
            title="Machine speed drift (the same small ops, 1 thread)",
            command=f"python benchmarks/bench_machine_drift.py --samples {args.samples}"
            f" --pause {args.pause}",
            body="```\n" + body + "\n```",
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()
