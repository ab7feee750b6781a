"""Network cross-check: ASTRA-sim's ring beside prism's alpha-beta model, on the same network.

1. ASTRA-sim's own microbenchmarks (all_reduce, all_gather, reduce_scatter, all_to_all on 4, 8
   and 16 NPUs, 1 MiB): ASTRA-sim's analytical time on its ring (50 GB/s, 500 ns per hop, the
   system config of ``../shared/tools/astra-sim``) beside ``prism emulate --timing alpha_beta``
   of the same files, read by prism's Chakra reader, on the same ring of n ranks
   (``ranks_per_node = n``, ``algorithm = ring``):
   - *plain*: the nominal figures (50 GB/s, 500 ns) and NCCL's collectives;
   - *ASTRA-sim options*: the same network in prism's units plus the model options that
     reproduce ASTRA-sim's collectives (`astra_sim_config`: its "GB/s" is GiB/s, its
     ``endpoint-delay`` is paid per step, ``chunks`` = ``preferred-dataset-splits``,
     ``all_to_all = ring``, ``reduction_gbps`` = ``local-mem-bw``; docs/network.md).
2. The ST op timeline sliced to 64 ranks (``dp=16,pp=4``) and exported: ASTRA-sim's finish time
   per rank beside prism's emulation of the exported files (read back) on the same ring.

Writes ``results/astra-sim_<host>_<date>.md``. Needs ``../shared`` (traces and the ASTRA-sim
build). A script, not a test.

Usage::

    python benchmarks/bench_astra_sim.py [--astra-sim PATH] [--no-slice]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from _common import HERE, dataset, host_kind, write_note

MICRO = "chakra-et/astrasim_et_examples/microbenchmarks"
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
NPUS = (4, 8, 16)
BW_GBPS, LAT_NS = 50.0, 500.0
_FINISH = re.compile(r"^(\d+) (\d+)$")


def astra(binary: Path, workload: Path, npus: int, out: Path, groups: Path | None) -> list[int]:
    """Finish cycles (ns) of every rank; raises when a rank does not finish."""
    cmd = [str(binary), "--workload", str(workload), "--npus", str(npus), "--out", str(out)]
    cmd += ["--bandwidth", str(BW_GBPS), "--latency", str(LAT_NS)]
    if groups is not None:
        cmd += ["--comm-groups", str(groups)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    done = {}
    for line in proc.stdout.splitlines():
        if m := _FINISH.match(line.strip()):
            done[int(m.group(1))] = int(m.group(2))
    if proc.returncode != 0 or len(done) != npus:
        raise SystemExit(f"ASTRA-sim failed on {workload}: {proc.stdout[-500:]}{proc.stderr}")
    return [done[r] for r in range(npus)]


def ring(n: int, gbps: float = BW_GBPS, latency_ns: float = LAT_NS):
    from prism_trace.replay import Topology

    return Topology(
        ranks_per_node=n,
        intra_node_gbps=gbps,
        inter_node_gbps=gbps,
        intra_node_latency_ns=latency_ns,
        inter_node_latency_ns=latency_ns,
    )


def astra_sim_config(binary: Path, n: int):
    """Prism's emulation config that reproduces ASTRA-sim's ring of ``n`` (docs/network.md).

    From the wrapper's ``configs/system.json``: its network's "GB/s" are GiB/s (the analytical
    backend's ``bw_GBps_to_Bpns``: ``1 GB is 2^30 B``), each message of a step also pays
    ``endpoint-delay`` (``MemBus``), a collective runs as ``preferred-dataset-splits`` chunks
    one after another, the all-to-all is relayed around the ring, and a reduction reads two
    operands and writes one at ``local-mem-bw`` (GB/s of 10^9 B: ``PacketBundle::call``).
    """
    from prism_trace.replay import EmulationConfig, TimingConfig

    system = json.loads((binary.parent / "configs" / "system.json").read_text())
    timing = TimingConfig(
        model="alpha_beta",
        algorithm="ring",
        chunks=int(system.get("preferred-dataset-splits", 1)),
        all_to_all="ring",
        reduction_gbps=float(system["local-mem-bw"]) if "local-mem-bw" in system else None,
    )
    gbps = BW_GBPS * (1 << 30) / 1e9
    hop = LAT_NS + float(system.get("endpoint-delay", 0))
    return EmulationConfig(topology=ring(n, gbps, hop), timing=timing)


def spans(store, run: str) -> dict[int, int]:
    """Per rank: the emulated run's last end minus its first start (untimed nodes left out)."""
    rows = store.con.execute(
        "SELECT e.rank, max(e.ts + e.dur) - min(e.ts) FROM event e JOIN run USING (run_id)"
        " WHERE run.name = ? AND e.ts IS NOT NULL AND e.name <> '## process_group:init ##'"
        " GROUP BY 1 ORDER BY 1",
        [run],
    ).fetchall()
    return {int(r): int(s) for r, s in rows}


def pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f} %"


def micro(binary: Path, store, tmp: Path) -> tuple[str, list[float], list[float]]:
    from prism_trace.replay import EmulationConfig, TimingConfig, emulate_run

    from prism_trace.ingestion.pipeline import ingest

    head = (
        "| collective | NPUs | ASTRA-sim (ns) | prism alpha_beta, plain (ns) | diff |"
        " prism alpha_beta, ASTRA-sim options (ns) | diff |\n|---|---|---|---|---|---|---|"
    )
    lines, plain, matched = [head], [], []
    for kind in KINDS:
        for n in NPUS:
            src = dataset(MICRO) / kind / f"{n}npus_1MB"
            f0 = next(src.glob("*.0.et"))
            t_astra = max(astra(binary, src / f0.name[: -len(".0.et")], n, tmp / "o", None))
            run = f"{kind}_{n}"
            ingest(store, [src], run=run, progress=False)
            cfg = EmulationConfig(
                topology=ring(n), timing=TimingConfig(model="alpha_beta", algorithm="ring")
            )
            emulate_run(store, run=run, out_run=f"{run}-ab", config=cfg)
            t_prism = max(spans(store, f"{run}-ab").values())
            emulate_run(store, run=run, out_run=f"{run}-as", config=astra_sim_config(binary, n))
            t_match = max(spans(store, f"{run}-as").values())
            plain.append(t_prism / t_astra - 1)
            matched.append(t_match / t_astra - 1)
            lines.append(
                f"| {kind} | {n} | {t_astra} | {t_prism} | {pct(t_prism, t_astra)} |"
                f" {t_match} | {pct(t_match, t_astra)} |"
            )
    return "\n".join(lines), plain, matched


def st_slice(binary: Path, store, tmp: Path) -> str:
    from prism_trace.replay import emulate_run

    from prism_trace.export.chakra.writer import export_chakra
    from prism_trace.graph.build import build_graph
    from prism_trace.ingestion.pipeline import ingest
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.slicing.slicer import slice_run

    ingest(store, [dataset("megatron-straggler-st-8rank")], run="st", progress=False)
    slice_run(store, run="st", layout=ParallelLayout.parse("dp=16,pp=4"), world=64, out_run="s64")
    report = export_chakra(store, run="s64", out_dir=tmp / "s64")
    finish = astra(binary, tmp / "s64" / "s64", 64, tmp / "o64", tmp / "s64" / "comm_groups.json")
    emulate_run(store, run="s64", out_run="s64-emu")
    ingest(store, [tmp / "s64"], run="s64-back", progress=False)
    build_graph(store, "s64-back")
    emulate_run(store, run="s64-back", out_run="s64-back-ab", config=astra_sim_config(binary, 64))
    # A sliced run's emulation keeps one timeline per class: each rank reads its exemplar's.
    classes = store.con.execute(
        "SELECT rank, class_id FROM rank JOIN run USING (run_id) WHERE run.name = 's64'"
    ).fetchall()
    by_class = spans(store, "s64-emu")
    rec = {int(r): by_class[int(c)] for r, c in classes}
    ab = spans(store, "s64-back-ab")
    rows = [
        "| rank | ASTRA-sim (s) | prism, recorded transfers (s) | diff |"
        " prism alpha_beta, ASTRA-sim options (s) | diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in (0, 1, 16, 17, 32, 33, 48, 49, 63):
        rows.append(
            f"| {r} | {finish[r] / 1e9:.3f} | {rec[r] / 1e9:.3f} | {pct(rec[r], finish[r])} |"
            f" {ab[r] / 1e9:.3f} | {pct(ab[r], finish[r])} |"
        )
    med_rec = statistics.median(rec[r] / finish[r] - 1 for r in range(64)) * 100
    med_ab = statistics.median(ab[r] / finish[r] - 1 for r in range(64)) * 100
    return (
        "\n".join(rows)
        + f"\n\nMedian over the 64 ranks: prism (recorded transfers) {med_rec:+.1f} %, prism"
        f" (alpha_beta, ASTRA-sim options) {med_ab:+.1f} % against ASTRA-sim. The export: "
        f"{report.sized_by_rule} communication nodes sized by the rule at"
        f" {report.size_bandwidth_gbps:g} GB/s, {report.single_member} one-member collectives"
        " as compute."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = HERE.parents[1] / "shared" / "tools" / "astra-sim" / "astra-sim"
    parser.add_argument("--astra-sim", type=Path, default=default, help="The wrapper script.")
    parser.add_argument("--no-slice", action="store_true", help="Microbenchmarks only.")
    parser.add_argument("--host", default=None, help="Host label of the result file.")
    args = parser.parse_args()
    if not args.astra_sim.is_file():
        raise SystemExit(f"{args.astra_sim}: ASTRA-sim not found (pass --astra-sim)")

    from prism_trace.store.connection import open_store

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        store = open_store(tmp / "b.duckdb")
        table, plain, matched = micro(args.astra_sim, store, tmp)
        body = (
            f"## Microbenchmarks (ring, {BW_GBPS:g} GB/s, {LAT_NS:g} ns per hop)\n\n{table}\n\n"
            f"Largest |diff|: prism alpha_beta {max(abs(x) for x in plain) * 100:.1f} %; with"
            f" ASTRA-sim's options {max(abs(x) for x in matched) * 100:.1f} %."
        )
        if not args.no_slice:
            body += (
                f"\n\n## ST sliced to 64 ranks, exported\n\n{st_slice(args.astra_sim, store, tmp)}"
            )
        store.close()
    print(body)
    cmd = "python benchmarks/bench_astra_sim.py" + (" --no-slice" if args.no_slice else "")
    note = write_note(
        "astra-sim",
        host_kind(args.host),
        title="ASTRA-sim beside prism's network model",
        command=cmd,
        body=body,
    )
    print(f"written: {note}")


if __name__ == "__main__":
    main()
