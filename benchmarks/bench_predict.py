"""Prediction against real recordings at the target scale (issue 30): the ladder benchmark.

For each scenario, the generator records one job at several data-parallel sizes (a *ladder*,
``python -m prism_trace.datasets.ladder``; recordings already in ``--ladder`` with the same config
are reused), ``prism ingest`` takes each into one store, and ``prism predict`` predicts every
larger scale from the smallest: the structure of a step (ops, collectives with their bytes and
groups, p2p), step times (mean, p90, the KS statistic of per-rank step times) and per-rank peak
memory, against the recording of that scale. A second recording of the same job at each scale
(``--repeat 2``) compared with the first the same way gives the machine's noise floor: what one
real run predicts of another.

Scenarios (wait mode: compute ops sleep seeded durations, so many ranks share the 2 cores; see
datasets/README.md):

- ``wait``: fixed per-rank work, tp1 x dp{2,4,8,16} x pp2, 1F1B, plus dp32 (64 ranks);
- ``wait-long``: ``wait`` at dp{2,4,8,16} with 100 steps of 25 ms a layer, so that the KS
  statistic of step times is measured from enough steps to tell 0.2 from chance (one job);
- ``interleaved``: ``wait``'s job with Megatron's interleaved 1F1B, 2 model chunks a stage (one
  job; per-rank work: the slicer does not recognise the schedule at a fixed global batch);
- ``global-batch``: a fixed global batch (``--global-batch``), the same ladder;
- ``zero1``: ZeRO-1, sharded optimizer state and reduce-scatter / all-gather of dp shards;
- ``real``: real compute (the tiny GPT on CPU), dp{2,4} x pp2, where 2 cores allow.

Usage::

    python benchmarks/bench_predict.py                      # every scenario, writes a result note
    python benchmarks/bench_predict.py --scenarios wait-long --seeds 5   # ~15 min recording
    python benchmarks/bench_predict.py --scenarios wait --dp 2,4,8 --no-note
    python benchmarks/bench_predict.py --ladder ~/.cache/prism-trace/ladder   # the cache (default)

Figures depend on the host: a 2-core machine shared by 32-64 sleeping ranks still schedules every
wake-up and every hop of a collective's ring. ``cores busy`` of each recording (CPU time over wall
time, summed over ranks) says how far a recording is from host-bound; compare with the noise floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import WAIT_JOB, host_kind, run, write_note  # noqa: E402

DEFAULT_LADDER = Path(
    os.environ.get("PRISM_LADDER", Path.home() / ".cache" / "prism-trace" / "ladder")
)

# One job shape for every wait-mode scenario (4 micro-batches a rank, or a global batch of 16 x
# dp_min samples).
WAIT = WAIT_JOB


@dataclass(frozen=True)
class Scenario:
    """One ladder: the generator options it adds, and its data-parallel sizes."""

    name: str
    options: tuple[str, ...]
    dp: tuple[int, ...]
    pp: int = 2
    repeat: int = 2
    slice_options: tuple[tuple[str, Any], ...] = ()
    job_seeds: bool = True  # other jobs by seed (wait mode: other rank factors and noise)


SCENARIOS = {
    "wait": Scenario("wait", (*WAIT, "--microbatches", "4"), (2, 4, 8, 16, 32)),
    # KS D counts steps, not ranks (a synchronous job's ranks end a step together): 5 steps a
    # side cannot tell 0.2 from chance (`ks_critical_steps_5pct`), 99 can (about 0.19).
    "wait-long": Scenario(
        "wait-long",
        (*WAIT, "--microbatches", "4", "--steps", "100", "--wait-ms-per-layer", "25"),
        (2, 4, 8, 16),
        job_seeds=False,
    ),
    # wait-long with a 16-wide model: one gradient bucket of about 40 KB a stage instead of two of
    # 256 KB, so the dp all-reduce that this host's gloo makes long at dp 16 (27 ms after the last
    # arrival against 2 x 24-26 ms: `gloo_host.py --recording`) weighs half as much in the step.
    "wait-sync": Scenario(
        "wait-sync",
        (
            *WAIT,
            "--microbatches",
            "4",
            "--steps",
            "100",
            "--wait-ms-per-layer",
            "25",
            "--hidden",
            "16",
        ),
        (2, 4, 8, 16),
    ),
    # 64 ranks on 2 cores: with the 64-wide model two recordings of one job differ by 11 % on the
    # mean (their two 256 KB all-reduces over 32 ranks crowd the cores); with the 16-wide one,
    # by 0.02 %.
    "wait-64": Scenario(
        "wait-64",
        (*WAIT, "--microbatches", "4", "--steps", "20", "--hidden", "16"),
        (2, 32),
    ),
    "interleaved": Scenario(
        "interleaved",
        (*WAIT, "--microbatches", "4", "--schedule", "interleaved", "--chunks", "2"),
        (2, 4, 8, 16),
        job_seeds=False,
    ),
    "global-batch": Scenario(
        "global-batch",
        (*WAIT, "--global-batch", "64"),
        (2, 4, 8, 16),
        slice_options=(("global_batch", "fixed"),),
    ),
    # Interleaved at a fixed global batch: 16, 8, 4 microbatches a rank; dp 16 would leave 2,
    # fewer than Megatron's interleaved warm-up takes (2 pp).
    "interleaved-gb": Scenario(
        "interleaved-gb",
        (*WAIT, "--global-batch", "64", "--schedule", "interleaved", "--chunks", "2"),
        (2, 4, 8),
        slice_options=(("global_batch", "fixed"),),
        job_seeds=False,
    ),
    "zero1": Scenario("zero1", (*WAIT, "--microbatches", "4", "--zero", "1"), (2, 4, 8, 16)),
    # ZeRO-1 with the 16-wide model: its per-owner broadcasts stay small at dp 16.
    "zero1-sync": Scenario(
        "zero1-sync",
        (*WAIT, "--microbatches", "4", "--zero", "1", "--hidden", "16"),
        (2, 4, 8, 16),
        job_seeds=False,
    ),
    # One replica recorded (dp 1: its gradient all-reduce over a one-member group), the 16-wide
    # model: structure and memory from a single-GPU trace; its step time meets neither the
    # other replicas' draws (slowest of N) nor a transfer to scale (the network model's alone).
    "one-replica": Scenario(
        "one-replica",
        (*WAIT, "--microbatches", "4", "--hidden", "16", "--dp-sync-always"),
        (1, 4, 8, 16),
        job_seeds=False,
    ),
    # Interleaved 1F1B with the real model (2 chunks a stage, one layer a virtual stage).
    "interleaved-real": Scenario(
        "interleaved-real",
        (
            *("--schedule", "interleaved", "--chunks", "2", "--layers", "4"),
            *("--microbatches", "4", "--steps", "6"),
        ),
        (2, 4),
        job_seeds=False,
    ),
    "real": Scenario(
        "real", ("--schedule", "1f1b", "--layers", "4", "--steps", "6"), (2, 4), job_seeds=False
    ),
}


def record(
    scenario: Scenario, dp: tuple[int, ...], ladder: Path, job_seed: int = 0
) -> dict[tuple[int, int], Path]:
    """Record (or reuse) the scenario's ladder; the folder of each (dp, repeat).

    Job seed 0 is the scenario's folder; another seed (other wait-mode draws: other rank
    factors, other per-call noise) records into ``<scenario>-seed<N>``, with one repeat (the
    noise floor is seed 0's).
    """
    out = ladder / (scenario.name if not job_seed else f"{scenario.name}-seed{job_seed}")
    repeat = scenario.repeat if not job_seed else 1
    cmd = [
        sys.executable, "-m", "prism_trace.datasets.ladder", "--out", str(out),
        "--dp", ",".join(map(str, dp)), "--pp", str(scenario.pp), "--tp", "1",
        "--repeat", str(repeat), "--seed", str(job_seed), *scenario.options,
    ]  # fmt: skip
    t0 = time.perf_counter()
    lines = run(cmd).splitlines()
    print(f"# {scenario.name}: ladder ready in {time.perf_counter() - t0:.0f} s", flush=True)
    for line in lines:
        if line.startswith("tp"):
            print("  " + line, flush=True)
    folders: dict[tuple[int, int], Path] = {}
    for path in sorted(out.iterdir()):
        run_json = path / "run.json"
        if not run_json.is_file():
            continue
        cfg = json.loads(run_json.read_text())["config"]
        if int(cfg["dp"]) not in dp or int(cfg["pp"]) != scenario.pp:
            continue
        last = path.name.rsplit("-", 1)[-1]  # "r1", "r2": a repeat (the ladder's names)
        rep = int(last[1:]) if last[:1] == "r" and last[1:].isdigit() else 0
        folders[(int(cfg["dp"]), rep)] = path
    return folders


def _busy(folder: Path) -> float:
    """Cores busy during the profiled steps: CPU time over wall time, summed over ranks."""
    run = json.loads((folder / "run.json").read_text())
    total = 0.0
    for rank in run["ranks"]:
        steps = [s for s in rank["steps"] if s.get("profiled")]
        cpu = sum(s.get("cpu_ns", 0) for s in steps)
        wall = sum(s["dur_ns"] for s in steps)
        total += cpu / wall if wall else 0.0
    return total


def predict_scenario(
    scenario: Scenario,
    folders: dict[tuple[int, int], Path],
    seeds: int,
    work: Path,
    first_job: dict[tuple[int, int], Path] | None = None,
    network: Path | None = None,
    pooled: dict[tuple[str, int], tuple[list[float], list[float]]] | None = None,
) -> list[dict[str, Any]]:
    """Ingest the ladder, predict every larger scale from the smallest, and the noise floor.

    ``first_job`` (for another job seed): job seed 0's recordings, each compared with this job's
    at the same dp (``between_jobs``): how far apart two jobs of one population are, the spread a
    prediction that cannot know the unrecorded ranks' draws is up against. ``network``: a model
    fitted on this host's collectives (``gloo_tests.py``, ``prism network fit``) that prices the
    target's collectives instead of the topology preset, as ``prism predict --network`` does.
    ``pooled`` collects each prediction's per-rank step times and the recording's, per
    (scenario, dp), so that the jobs' predictions can be set against the jobs' recordings as two
    populations (`over_jobs`).
    """
    from prism_trace import EmulationConfig, Topology, compare_runs, ingest, open_store, predict_run

    # Every rank of every recording ran on this one host: the target is one node too (the
    # default topology puts 8 ranks on a node, and a dp group across nodes on the NIC's model).
    one_host = EmulationConfig(topology=Topology(ranks_per_node=max(folders)[0] * scenario.pp))
    if network is not None:
        from prism_trace.replay.network import read_network_file

        one_host = dataclasses.replace(one_host, network=read_network_file(network))

    db = work / f"{scenario.name}.duckdb"
    rows: list[dict[str, Any]] = []
    with open_store(db) as store:
        names = {}
        for (dp, rep), folder in sorted(folders.items()):
            name = f"dp{dp}" + (f"-r{rep}" if rep else "")
            ingest(store, [folder], run=name, progress=False)
            names[(dp, rep)] = name
        small = min(dp for dp, _ in names)
        base = names[(small, 0)]
        for (dp, rep), name in sorted(names.items()):
            if rep:
                continue
            row: dict[str, Any] = {
                "scenario": scenario.name,
                "dp": dp,
                "ranks": dp * scenario.pp,
                "busy": round(_busy(folders[(dp, rep)]), 2),
            }
            if dp != small:
                t0 = time.perf_counter()

                def compare(st: Any, names: list[str], against: str, dp: int = dp) -> Any:
                    c = compare_runs(st, names, against)
                    if pooled is not None:
                        pred, rec = _step_samples(st, names, against, c.steps.iterations)
                        mine = pooled.setdefault((scenario.name, dp), ([], []))
                        mine[0].extend(pred)
                        mine[1].extend(rec)
                    return c

                p = predict_run(
                    store,
                    run=base,
                    against=name,
                    compare=compare,
                    variance="replica",
                    seeds=seeds,
                    config=one_host,
                    **dict(scenario.slice_options),
                )
                row["prediction"] = _figures(p.comparison.as_dict())
                row["predict_s"] = round(time.perf_counter() - t0, 1)
            twin = names.get((dp, 1))
            if twin is not None:
                row["noise_floor"] = _figures(compare_runs(store, twin, name).as_dict())
            other = (first_job or {}).get((dp, 0))
            if other is not None:
                ingest(store, [other], run=f"{name}-job0", progress=False)
                row["between_jobs"] = _figures(compare_runs(store, name, f"{name}-job0").as_dict())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _step_samples(
    store: Any, predicted: list[str], recorded: str, iterations: list[int]
) -> tuple[list[float], list[float]]:
    """Per-rank step times (ns) of the predicted runs and of the recording over
    ``iterations``, on the ranks all of them hold: the samples the comparison's KS D reads."""
    names = [*predicted, recorded]
    rows = store.con.execute(
        "SELECT r.name, i.rank, i.dur FROM iteration i JOIN run r USING (run_id)"
        " WHERE list_contains($1, r.name) AND list_contains($2, i.iteration)",
        [names, iterations],
    ).fetchall()
    ranks = set.intersection(*({rk for n, rk, _ in rows if n == name} for name in names))
    pred = [float(d) for n, rk, d in rows if n != recorded and rk in ranks]
    rec = [float(d) for n, rk, d in rows if n == recorded and rk in ranks]
    return pred, rec


def _figures(comparison: dict[str, Any]) -> dict[str, Any]:
    """The figures the table shows, from a comparison's JSON form."""
    steps = comparison.get("step_time", {})
    structure = comparison.get("structure", {})
    errors = comparison.get("rank_errors", {})
    return {
        "differences": structure.get("differences"),
        "mean_pct": steps.get("mean_error_pct"),
        "p90_pct": steps.get("p90_error_pct"),
        "ks_d": steps.get("ks_d"),
        "peak_max_pct": errors.get("peak_max_abs_error_pct"),
        "peak_within": (
            f"{errors['peak_ranks_within_target']}/{errors['peak_ranks']}"
            if errors.get("peak_ranks")
            else "n/a"
        ),
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f} %"


def _diff_text(diff: dict[str, int] | None) -> str:
    return "n/a" if diff is None else str(sum(diff.values()))


def table(rows: list[dict[str, Any]]) -> str:
    """The result table: prediction beside the noise floor."""
    head = (
        "| scenario | job seed | dp | ranks | cores busy | structure diffs | mean | p90 | KS D |"
        " peak mem max | peak mem ≤ 0.5 % | floor: mean | floor: p90 | floor: KS D |"
        " floor: peak mem max | floor: peak mem ≤ 0.5 % |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    out = []
    for r in rows:
        p = r.get("prediction") or {}
        f = r.get("noise_floor") or {}
        ks = p.get("ks_d")
        fks = f.get("ks_d")
        out.append(
            f"| {r['scenario']} | {r.get('job_seed', 0)} | {r['dp']} | {r['ranks']} | {r['busy']} |"
            f" {_diff_text(p.get('differences')) if p else 'recorded (base)'} |"
            f" {_pct(p.get('mean_pct'))} | {_pct(p.get('p90_pct'))} |"
            f" {'n/a' if ks is None else f'{ks:.3f}'} | {_pct(p.get('peak_max_pct'))} |"
            f" {p.get('peak_within', 'n/a')} |"
            f" {_pct(f.get('mean_pct'))} | {_pct(f.get('p90_pct'))} |"
            f" {'n/a' if fks is None else f'{fks:.3f}'} | {_pct(f.get('peak_max_pct'))} |"
            f" {f.get('peak_within', 'n/a')} |"
        )
    return head + "\n".join(out) + "\n"


def over_jobs(
    rows: list[dict[str, Any]],
    pooled: dict[tuple[str, int], tuple[list[float], list[float]]] | None = None,
) -> str:
    """Per scenario and dp predicted from more than one job seed: the mean of the signed errors
    (a bias the model has) and of their magnitudes (what one job's luck adds), and the KS D of
    every job's predictions pooled against every job's recording pooled (``pooled``): whether
    the predictions have the step-time distribution of the population of such jobs, which a
    prediction that cannot know the unrecorded ranks' draws can promise, where one job's own
    distribution is that population's spread away."""
    from prism_trace.analysis.prediction.steps import ks_two_sample

    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    apart: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r.get("prediction"):
            cells.setdefault((r["scenario"], r["dp"]), []).append(r["prediction"])
        ks = (r.get("between_jobs") or {}).get("ks_d")
        if ks is not None:
            apart.setdefault((r["scenario"], r["dp"]), []).append(ks)
    lines = []
    for (name, dp), preds in sorted(cells.items()):
        if len(preds) < 2:
            continue

        def avg(key: str, *, magnitude: bool, ps: list[dict[str, Any]] = preds) -> str:
            xs = [p[key] for p in ps if p.get(key) is not None]
            if not xs:
                return "n/a"
            v = sum(abs(x) if magnitude else x for x in xs) / len(xs)
            return f"{v:.3f}" if key == "ks_d" else f"{v:+.2f} %"

        ks_apart = apart.get((name, dp))
        pred, rec = (pooled or {}).get((name, dp), ([], []))
        lines.append(
            f"| {name} | {dp} | {len(preds)} | {avg('mean_pct', magnitude=False)} |"
            f" {avg('mean_pct', magnitude=True)} | {avg('p90_pct', magnitude=False)} |"
            f" {avg('p90_pct', magnitude=True)} | {avg('ks_d', magnitude=False)} |"
            f" {f'{sum(ks_apart) / len(ks_apart):.3f}' if ks_apart else 'n/a'} |"
            f" {f'{ks_two_sample(pred, rec):.3f}' if pred and rec else 'n/a'} |"
        )
    if not lines:
        return ""
    return (
        "\nOver the job seeds (`KS D: jobs apart`: each other job's recording against job seed"
        " 0's at the same dp, the spread between two jobs that differ only in their draws;"
        " `KS D: pooled`: every job's predictions pooled against every job's recording pooled,"
        " the population of such jobs against the model's):\n\n"
        "| scenario | dp | jobs | mean: bias | mean: avg abs | p90: bias | p90: avg abs |"
        " KS D: avg | KS D: jobs apart | KS D: pooled |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", type=Path, default=DEFAULT_LADDER, help="recordings (a cache)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    ap.add_argument("--dp", default=None, help="dp sizes to use (default: each scenario's)")
    ap.add_argument("--seeds", type=int, default=5, help="variance seeds per prediction")
    ap.add_argument(
        "--job-seeds",
        default="0",
        help="comma-separated generator seeds: independent jobs of each scenario (other rank"
        " factors and noise), so that a bias of the model shows apart from one job's luck",
    )
    ap.add_argument("--no-note", action="store_true", help="do not write benchmarks/results")
    ap.add_argument(
        "--note-tag",
        default="",
        help="results file predict-TAG_<host>_<date>.md (a run of some scenarios beside the"
        " day's full one)",
    )
    ap.add_argument(
        "--network",
        type=Path,
        default=None,
        help="a network model of this host (gloo_tests.py logs, prism network fit) pricing the"
        " target's collectives, as prism predict --network",
    )
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    pooled: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.scenarios.split(","):
            scenario = SCENARIOS[name]
            dp = tuple(int(x) for x in a.dp.split(",")) if a.dp else scenario.dp
            dp = tuple(d for d in dp if d in scenario.dp) or dp
            seeds = [int(x) for x in a.job_seeds.split(",")] if scenario.job_seeds else [0]
            first: dict[tuple[int, int], Path] | None = None
            for job_seed in seeds:
                folders = record(scenario, dp, a.ladder, job_seed)
                work = Path(tmp) / f"seed{job_seed}"
                work.mkdir(exist_ok=True)
                other = first if job_seed else None
                for row in predict_scenario(
                    scenario, folders, a.seeds, work, other, a.network, pooled
                ):
                    rows.append({**row, "job_seed": job_seed})
                first = first or (folders if job_seed == 0 else None)
    text = table(rows) + over_jobs(rows, pooled)
    print(text)
    if not a.no_note:
        command = (
            f"python benchmarks/bench_predict.py --scenarios {a.scenarios} --seeds {a.seeds}"
            + (f" --job-seeds {a.job_seeds}" if a.job_seeds != "0" else "")
            + (f" --note-tag {a.note_tag}" if a.note_tag else "")
            + (f" --network {a.network}" if a.network else "")
        )
        body = (
            "Predicted from the smallest dp of each ladder (`prism predict`, variance `replica`"
            f" over {a.seeds} seeds"
            + (f", collectives priced by the network model {a.network}" if a.network else "")
            + "); the noise floor is a second recording of the same job"
            " compared with the first. Errors are predicted against recorded; `peak mem max`"
            " is the largest per-rank |error| of peak memory, `peak mem ≤ 0.5 %` the ranks within"
            " issue 30's bound.\n\n"
            f"{text}\n{time.perf_counter() - t0:.0f} s in all."
        )
        note = write_note(
            f"predict-{a.note_tag}" if a.note_tag else "predict",
            host_kind(),
            title="Prediction against recordings at the target scale",
            command=command,
            body=body,
        )
        print(f"wrote {note}")


if __name__ == "__main__":
    main()
