"""Variance ladder benchmark: predict a larger data-parallel world from a small recording, with
each variance mode, and compare with recordings at the target scale.

Ingests the recordings of a ladder folder (``python -m prism_trace.datasets.ladder``; one job at
several ``dp``, the same ``pp``), slices the smallest ``dp`` to every larger one (``--from``), and
emulates each slice without variance and in each ``--modes`` under ``--seeds`` seeds. Every
emulation is compared with every recording of the target ``dp`` (repeats included): mean and p90
of the per-rank step times (signed error, %) and the two-sample KS distance, as the mean and the
spread over seeds. ``--same-scale`` adds slices of each recording from its own dp-0 replica back
to its own scale (what the variance model does where the transfers are the recorded ones), and
the recordings of one ``dp`` are compared with each other: the host's noise floor. Targets
(issue 30): mean within 2 %, p90 within 3 %, KS D <= 0.2. Writes
``results/variance_ladder_<host>_<date>.md`` unless ``--no-note``.

Usage::

    python benchmarks/bench_variance_ladder.py /work/ladder /work/ladder-variance --same-scale
    python benchmarks/bench_variance_ladder.py DIR --modes replica --seeds 5 --no-note
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import tempfile
from pathlib import Path

import numpy as np
from _common import host_kind, table, write_note


def _recordings(folders: list[Path]) -> dict[int, list[tuple[str, Path]]]:
    """The recordings of the folders by dp: ``(run name, folder)``; a second recording of one
    dp (a repeat, or another folder's) is ``dp8-2``, and so on."""
    out: dict[int, list[tuple[str, Path]]] = {}
    for folder in folders:
        for sub in sorted(p for p in folder.iterdir() if (p / "run.json").exists()):
            dp = int(json.loads((sub / "run.json").read_text())["config"]["dp"])
            taken = [n for n, _ in out.get(dp, [])]
            name = f"dp{dp}" if not taken else f"dp{dp}-{len(taken) + 1}"
            out.setdefault(dp, []).append((name, sub))
    return out


def main() -> None:
    """Record the figures of every (slice, mode, recording) and print (and note) them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--from", dest="base", type=int, default=None, help="dp to slice from")
    ap.add_argument("--modes", default="iteration,op,replica")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--same-scale", action="store_true")
    ap.add_argument("--host-kind", default=None)
    ap.add_argument("--no-note", action="store_true")
    args = ap.parse_args()

    from prism_trace.replay.emulate.config import EmulationConfig
    from prism_trace.replay.emulate.driver import emulate_in_memory
    from prism_trace.replay.validate.draws import ks_two_sample
    from prism_trace.replay.whatif.config import WhatIfConfig

    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.layout.choice import infer_layout
    from prism_trace.slicing.slicer import slice_run
    from prism_trace.store.connection import open_store

    recs = _recordings(args.folders)
    base = args.base or min(recs)
    modes = ["none", *args.modes.split(",")]
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp, open_store(Path(tmp) / "l.duckdb") as store:
        steps: dict[str, np.ndarray] = {}
        for name, path in itertools.chain.from_iterable(recs.values()):
            ingest(store, [path], run=name, progress=False)
            build_graph(store, name)
            steps[name] = (
                store.con.sql(
                    "SELECT dur FROM iteration WHERE run_id = $1", params=[store.require_run(name)]
                )
                .pl()["dur"]
                .to_numpy()
                / 1e6
            )

        def compare(label: str, run: str, targets: list[str]) -> None:
            for mode in modes:
                what = WhatIfConfig(variance=mode != "none")
                if mode != "none":
                    what = WhatIfConfig(variance=True, variance_mode=mode)  # type: ignore[arg-type]
                emu = [
                    emulate_in_memory(store, run=run, config=EmulationConfig(what_if=what, seed=s))[
                        1
                    ]["dur"].to_numpy()
                    / 1e6
                    for s in range(1 if mode == "none" else args.seeds)
                ]
                for t in targets:
                    r = steps[t]
                    mean = np.array([100 * (e.mean() / r.mean() - 1) for e in emu])
                    p90 = np.array(
                        [100 * (np.percentile(e, 90) / np.percentile(r, 90) - 1) for e in emu]
                    )
                    ks = np.array([ks_two_sample(e, r)[0] for e in emu])
                    rows.append(
                        (
                            f"{label} vs {t}, {mode}",
                            f"mean {mean.mean():+.2f} % (sd {mean.std():.2f}),"
                            f" p90 {p90.mean():+.2f} % (sd {p90.std():.2f}),"
                            f" KS D {ks.mean():.3f} (sd {ks.std():.3f});"
                            f" emulated mean {np.mean([e.mean() for e in emu]):.1f} ms,"
                            f" recorded {r.mean():.1f} ms",
                        )
                    )

        src = recs[base][0][0]
        layout = infer_layout(store, src)
        for dp in sorted(d for d in recs if d > base):
            target = dataclasses.replace(layout, dp=dp)
            out = f"s{dp}_from{base}"
            slice_run(store, run=src, layout=target, world=target.world_size, out_run=out)
            compare(f"dp{base}->dp{dp}", out, [n for n, _ in recs[dp]])
        if args.same_scale:
            for _, runs in sorted(recs.items()):
                for name, _ in runs:
                    lay = infer_layout(store, name)
                    out = f"self_{name}"
                    slice_run(store, run=name, layout=lay, world=lay.world_size, out_run=out)
                    compare(f"{name} from its dp-0 replica", out, [name])
                for (a, _), (b, _) in itertools.combinations(runs, 2):
                    x, y = steps[a], steps[b]
                    rows.append(
                        (
                            f"noise floor {a} vs {b}",
                            f"mean {100 * (x.mean() / y.mean() - 1):+.2f} %, p90"
                            f" {100 * (np.percentile(x, 90) / np.percentile(y, 90) - 1):+.2f} %,"
                            f" KS D {ks_two_sample(x, y)[0]:.3f}",
                        )
                    )
    text = table(rows)
    print(text)
    if args.no_note:
        return
    folders = " ".join(str(f) for f in args.folders)
    note = write_note(
        "variance_ladder",
        host_kind(args.host_kind),
        title=f"variance modes predicting larger dp from dp{base} ({args.seeds} seeds)",
        command=f"python benchmarks/bench_variance_ladder.py {folders} --modes {args.modes}"
        f" --seeds {args.seeds}" + (" --same-scale" if args.same_scale else ""),
        body=f"```\n{text}\n```",
    )
    print(f"note: {note}")


if __name__ == "__main__":
    main()
