"""Traces unlike ours, the whole path: ingest → graph → slice → emulate → validate (issue 16).

Builds, in a temporary folder, the inputs the issue names from the shared traces and the bundled
(generated) sample, and runs every step on each:

- ``dlrm-stripped``: DLRM's 8 ranks with the args of ``record_param_comms`` removed;
- ``dlrm-c10d``: DLRM with only the ``c10d::`` ops (no ``record_param_comms``, no ``nccl:``);
- ``dlrm-2of128``: two DLRM ranks stated as ranks 0 and 64 of a 128-rank job, the second's
  all-to-alls 1000 times larger (different exchanges: they must not be matched);
- ``sample-tp0``: the generated tp=2 sample without its TP peers' files (ranks 0, 2, 4, 6);
- ``st-tp2`` / ``st-cp2``: the ST op timeline whose meta says ``tp_size: 2`` / ``dsp_size: 2``
  and ``world_size: 16`` (the parquet unchanged: its ranks 0..7 are read as one per TP/CP group);
- ``pair-declared``: the sample's TP pair showing only the default group, ingested with
  ``--layout tp=2``;

and counts the mixed collective instances (different kinds, or sizes of a sized kind) on the
shared sets as they are. Prints a table and writes ``results/real-layouts_<host>_<date>.md``
unless ``--no-note``. Targets: replay error within 0.1 % on the collapsed recordings, 0 mixed
instances everywhere.

Usage::

    python benchmarks/bench_real_layouts.py [--no-note]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from _common import REPO, SHARED, host_kind, write_note
from prism_trace.datasets.variants import kineto_variant, two_ranks_of_many
from prism_trace.replay import CompletionConfig, EmulationConfig, emulate_run
from prism_trace.replay.validate.emulated import validate_run

from prism_trace.errors import PrismError
from prism_trace.graph.build import build_graph
from prism_trace.graph.matching import match_comms
from prism_trace.ingestion.pipeline import ingest
from prism_trace.layout.choice import choose_layout
from prism_trace.layout.declare import declare_layout
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.layout.symmetry import missing_ranks, symmetric_partners
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import open_store

SAMPLE = REPO / "datasets" / "sample"
DLRM = SHARED / "param-dlrm-8rank" / "kineto"
ST = SHARED / "megatron-straggler-st-8rank"


def _dlrm(out: Path, **kw: Any) -> None:
    for i, f in enumerate(sorted(DLRM.glob("*.json.gz"))):
        kineto_variant(f, out / f"rank{i}.json.gz", **kw)


def _two_of_128(out: Path) -> None:
    two_ranks_of_many(sorted(DLRM.glob("*.json.gz")), out)


def _sample_tp0(out: Path) -> None:
    out.mkdir(parents=True)
    for r in (0, 2, 4, 6):
        for kind in ("kineto", "et"):
            shutil.copy(SAMPLE / f"rank{r}.{kind}.json.gz", out)


def _st(key: str) -> Callable[[Path], None]:
    def make(out: Path) -> None:
        out.mkdir(parents=True)
        shutil.copy(ST / "trace-ST.parquet", out / "trace-ST.parquet")  # ranks 0..7 as they are
        meta = yaml.safe_load((ST / "meta-ST.yaml").read_text())
        meta.update({key: 2, "world_size": 16})
        (out / "meta-ST.yaml").write_text(yaml.safe_dump(meta))
        shutil.copy(ST / "result-ST.json", out / "result-ST.json")

    return make


def _pair(out: Path) -> None:
    for r in (0, 1):
        kineto_variant(
            SAMPLE / f"rank{r}.kineto.json.gz",
            out / f"rank{r}.kineto.json.gz",
            drop=r"^(prism_comm:pg=(?!1;)|record_param_comms$)",
            only_default_group=True,
            world_size=2,
        )


# name, builder, declared layout
INPUTS: list[tuple[str, Callable[[Path], None], str | None]] = [
    ("dlrm-stripped", lambda o: _dlrm(o, strip_comm_args=True), None),
    ("dlrm-c10d", lambda o: _dlrm(o, drop=r"^(record_param_comms|nccl:)"), None),
    ("dlrm-2of128", _two_of_128, None),
    ("sample-tp0", _sample_tp0, None),
    ("st-tp2", _st("tp_size"), None),
    ("st-cp2", _st("dsp_size"), None),
    ("pair-declared", _pair, "tp=2"),
]
SHARED_SETS = [
    ("st", ST),
    ("dlrm", SHARED / "param-dlrm-8rank"),
    ("resnet-chakra", SHARED / "chakra-et/astrasim_et_examples/resnet50_dp_64npus_text_converted"),
    ("hta-nccl", SHARED / "hta-nccl-rank0"),
]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f} %"


def _path(store: Any, name: str, declared: str | None) -> dict[str, str]:
    """Every step on one run; each figure or the one line that stopped it."""
    row: dict[str, str] = {}
    if declared is not None:
        declare_layout(store, name, ParallelLayout.parse(declared))
    build_graph(store, name)
    choice = choose_layout(store, name)
    layout = choice.layout
    ranks = [
        r
        for (r,) in store.con.execute(
            "SELECT rank FROM rank JOIN run USING (run_id) WHERE run.name = ?", [name]
        ).fetchall()
    ]
    copies = [] if layout is None else symmetric_partners(layout, ranks)[0].tolist()
    m = match_comms(store, name, copies=copies)
    modes = sorted({str(e["mode"]) for e in m.matching})
    row["instances"] = (
        f"{m.complete}/{m.instances} complete ({m.complete_with_copies} with the TP/CP copies),"
        f" {m.mixed} mixed"
    )
    row["matching"] = ", ".join(modes)
    row["layout"] = f"{layout.spec if layout else '-'} ({choice.source})"
    ((world,),) = store.con.execute("SELECT world_size FROM run WHERE name = ?", [name]).fetchall()
    row["missing"] = missing_ranks(int(world), ranks, layout) or "none"
    if layout is not None:
        target = dataclasses.replace(layout, dp=layout.dp * 2)  # refused when dp=1
        try:
            rep = slice_run(
                store, run=name, layout=target, world=target.world_size, out_run=f"{name}-s"
            )
            row["slice"] = f"{target.spec}: {len(rep.classes)} classes"
            emulate_run(store, run=f"{name}-s", out_run=f"{name}-se")
        except PrismError as exc:
            row["slice"] = f"refused: {str(exc).splitlines()[0]}"
    partial = row["missing"] != "none" and "not recorded" in row["missing"]
    cfg = EmulationConfig(completion=CompletionConfig(allow_partial=partial))
    t0 = time.perf_counter()
    rep_e = emulate_run(store, run=name, out_run=f"{name}-e", config=cfg)
    row["emulate"] = (
        f"{rep_e.world_size} ranks as {rep_e.units} units{' (--partial)' if partial else ''},"
        f" {time.perf_counter() - t0:.2f} s"
    )
    try:
        v = validate_run(store, run=name)
        row["validate"] = (
            f"replay {_pct(v.replay_iteration_time_error_pct)},"
            f" slice {_pct(v.slice_iteration_time_error_pct)}"
        )
    except PrismError as exc:
        row["validate"] = f"refused: {str(exc).splitlines()[0].split(': ', 1)[-1]}"
    return row


def main() -> None:
    """Build the inputs, run the path on each, print and note the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-note", action="store_true")
    ap.add_argument("--host", default=None)
    args = ap.parse_args()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="prism-layouts-") as tmp:
        for name, build, declared in INPUTS:
            src = Path(tmp) / name
            build(src)
            store = open_store(Path(tmp) / f"{name}.duckdb")
            t0 = time.perf_counter()
            ingest(store, [src], run=name, progress=False)
            t_ingest = time.perf_counter() - t0
            row = _path(store, name, declared)
            store.close()
            lines.append(f"## {name}\n")
            lines.append(f"- ingest: {t_ingest:.2f} s")
            lines += [f"- {k}: {v}" for k, v in row.items()]
            lines.append("")
            print("\n".join(lines[-len(row) - 3 :]), flush=True)
        lines.append("## shared sets, as they are\n")
        store = open_store(Path(tmp) / "shared.duckdb")
        for name, path in SHARED_SETS:
            ingest(store, [path], run=name, progress=False)
            m = match_comms(store, name)
            line = f"- {name}: {m.instances} instances, {m.complete} complete, {m.mixed} mixed"
            lines.append(line)
            print(line, flush=True)
        store.close()
    if not args.no_note:
        note = write_note(
            "real-layouts",
            host_kind(args.host),
            title="Traces unlike ours: ingest → graph → slice → emulate → validate",
            command="python benchmarks/bench_real_layouts.py",
            body="\n".join(lines),
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()
