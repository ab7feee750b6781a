"""Write a large synthetic multi-rank Kineto trace set by repeating a real trace.

Each output file holds K repetitions of the source trace's ``traceEvents``. Every repetition is
shifted so the file stays a valid, self-consistent trace:

- ``ts`` moves by one source span (plus a 1 ms gap) per repetition;
- flow ids (``id``) and the integer ids in ``args`` (``External id``, ``correlation``,
  ``Record function id``, ``Ev Idx``, ``Sequence number``) move by their range per repetition, so
  CPU op ↔ runtime ↔ kernel links and fwd/bwd flows never collide;
- ``ProfilerStep#N`` is renumbered so every repetition has its own steps;
- metadata events (``ph == "M"``) are written once.

Each rank gets its own file with ``distributedInfo.rank`` set, ``world_size`` and the process
group resized to the number of ranks, the host pid/tid moved by the rank and the GPU events put on
device ``rank % 8``. The file is written in Kineto's layout (a pretty header, then one event per
line) and streamed with orjson, so the generator's memory does not grow with the output size.

Usage::

    python benchmarks/make_big_trace.py OUT_DIR --ranks 8 --mb-per-rank 100
    python benchmarks/make_big_trace.py OUT_DIR --ranks 1 --mb-per-rank 2048 --gzip
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

DEFAULT_SOURCE = (
    Path(__file__).resolve().parents[2] / "shared/datasets/hta-nccl-rank0/nccl_data.json.gz"
)

_ARG_IDS = ("External id", "correlation", "Record function id", "Ev Idx", "Sequence number")
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_N_DEVICES = 8
_GAP_US = 1000.0


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        return orjson.loads(fh.read())


class _Template:
    """The source trace with the per-repetition strides it needs to be repeated safely."""

    def __init__(self, trace: dict[str, Any]) -> None:
        events = trace.get("traceEvents")
        if not events:
            msg = "source trace has no `traceEvents`"
            raise ValueError(msg)
        self.meta = {k: v for k, v in trace.items() if k != "traceEvents"}
        self.metadata_events = [e for e in events if e.get("ph") == "M"]
        self.events = [e for e in events if e.get("ph") != "M"]
        ts = [float(e["ts"]) for e in self.events if "ts" in e]
        ends = [float(e["ts"]) + float(e.get("dur", 0)) for e in self.events if "ts" in e]
        self.ts_stride = math.ceil(max(ends) - min(ts)) + _GAP_US
        self.id_stride = 1 + max(
            (e["id"] for e in self.events if isinstance(e.get("id"), int)), default=0
        )
        self.arg_strides: dict[str, int] = {}
        for key in _ARG_IDS:
            vals = [
                e["args"][key] for e in self.events if isinstance(e.get("args", {}).get(key), int)
            ]
            if vals:
                self.arg_strides[key] = max(vals) + 1
        steps = [int(m.group(1)) for e in self.events if (m := _STEP_RE.match(str(e.get("name"))))]
        self.step_stride = (max(steps) - min(steps) + 1) if steps else 0

    def rank_events(
        self, rank: int, world_size: int
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Return (metadata events, repetition-0 events) adjusted for ``rank``."""
        pg_ranks = str(list(range(world_size)))
        device = rank % _N_DEVICES

        def adjust(e: dict[str, Any]) -> dict[str, Any]:
            e = copy.deepcopy(e)
            pid = e.get("pid")
            if isinstance(pid, int) and pid >= _N_DEVICES:  # host process: one per rank
                e["pid"] = pid + rank
                if isinstance(e.get("tid"), int) and e["tid"] >= _N_DEVICES:
                    e["tid"] += rank
            elif pid == 0 and e.get("ph") != "M":  # GPU events of device 0 → the rank's device
                e["pid"] = device
            args = e.get("args")
            if isinstance(args, dict):
                if "device" in args and args["device"] == 0:
                    args["device"] = device
                if "Process Group Ranks" in args and args["Process Group Ranks"] not in (
                    "[]",
                    None,
                ):
                    args["Process Group Ranks"] = pg_ranks
                if "Group size" in args:
                    args["Group size"] = world_size
                if "Global rank start" in args:
                    args["Global rank start"] = 0
            return e

        return [adjust(e) for e in self.metadata_events], [adjust(e) for e in self.events]

    def repetition(self, events: list[dict[str, Any]], rep: int) -> Iterator[dict[str, Any]]:
        """Yield ``events`` shifted to repetition ``rep`` (shallow copies, args copied)."""
        if rep == 0:
            yield from events
            return
        dts = rep * self.ts_stride
        did = rep * self.id_stride
        arg_shift = {k: rep * s for k, s in self.arg_strides.items()}
        dstep = rep * self.step_stride
        for e in events:
            e2 = dict(e)
            if "ts" in e2:
                e2["ts"] = round(e2["ts"] + dts, 3)
            if isinstance(e2.get("id"), int):
                e2["id"] += did
            args = e2.get("args")
            if args:
                args = dict(args)
                for k, s in arg_shift.items():
                    v = args.get(k)
                    if isinstance(v, int) and v >= 0:
                        args[k] = v + s
                e2["args"] = args
            if dstep and (m := _STEP_RE.match(str(e2.get("name")))):
                e2["name"] = f"ProfilerStep#{int(m.group(1)) + dstep}"
            yield e2


def _header(meta: dict[str, Any], rank: int, world_size: int, name: str) -> bytes:
    meta = copy.deepcopy(meta)
    dist = meta.get("distributedInfo") or {"backend": "nccl"}
    dist["rank"] = rank
    dist["world_size"] = world_size
    for pg in dist.get("pg_config", []):
        pg["pg_size"] = world_size
        pg["ranks"] = list(range(world_size))
    meta["traceName"] = name
    # Kineto's layout: one top-level key per line, `"rank": N` with a space (HTA's rank regex
    # `"rank":\s+(\d+)` scans line by line, so the header must not share a line with the events).
    lines = [
        "{",
        f'  "schemaVersion": {json.dumps(meta.pop("schemaVersion", 1))},',
        f'  "distributedInfo": {json.dumps(dist)},',
    ]
    meta.pop("distributedInfo", None)
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in meta.items()]
    lines.append('  "traceEvents": [')
    return ("\n".join(lines) + "\n").encode()


def write_rank(
    template: _Template,
    out: Path,
    *,
    rank: int,
    world_size: int,
    target_bytes: int,
    gzip_level: int | None = None,
) -> tuple[int, int]:
    """Write one rank's file of at least ``target_bytes`` of JSON (before gzip).

    Args:
        template: The source trace.
        out: Output path (``.json`` or ``.json.gz``).
        rank: Value for ``distributedInfo.rank``.
        world_size: Number of ranks in the set.
        target_bytes: Uncompressed size to reach; at least one repetition is written.
        gzip_level: Compress with this level when set.

    Returns:
        (uncompressed bytes written, events written).
    """
    meta_events, events = template.rank_events(rank, world_size)
    raw: BinaryIO = open(out, "wb")  # noqa: SIM115 - wrapped by gzip below when asked
    fh: BinaryIO = (
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=gzip_level) if gzip_level else raw
    )
    written = 0
    n_events = 0

    def put(b: bytes) -> None:
        nonlocal written
        fh.write(b)
        written += len(b)

    try:
        put(_header(template.meta, rank, world_size, out.name))
        first = True
        for e in meta_events:
            put((b"    " if first else b",\n    ") + orjson.dumps(e))
            first = False
            n_events += 1
        rep = 0
        while rep == 0 or written < target_bytes:
            chunk = bytearray()
            for e in template.repetition(events, rep):
                chunk += (b"    " if first else b",\n    ") + orjson.dumps(e)
                first = False
                n_events += 1
            put(bytes(chunk))
            rep += 1
        put(b"\n  ]\n}\n")
    finally:
        if fh is not raw:
            fh.close()
        raw.close()
    return written, n_events


def make_set(
    out_dir: Path,
    *,
    ranks: int,
    mb_per_rank: float,
    source: Path = DEFAULT_SOURCE,
    gzip_level: int | None = None,
) -> list[Path]:
    """Write ``ranks`` files ``rank{r}_trace.json[.gz]`` into ``out_dir`` and return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    template = _Template(_load(source))
    suffix = ".json.gz" if gzip_level else ".json"
    paths = []
    for r in range(ranks):
        p = out_dir / f"rank{r}_trace{suffix}"
        write_rank(
            template,
            p,
            rank=r,
            world_size=ranks,
            target_bytes=int(mb_per_rank * 1e6),
            gzip_level=gzip_level,
        )
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument(
        "--mb-per-rank",
        type=float,
        default=100.0,
        help="uncompressed JSON size per rank file, in MB (1e6 bytes)",
    )
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="a real Kineto trace")
    ap.add_argument(
        "--gzip",
        type=int,
        nargs="?",
        const=1,
        default=None,
        metavar="LEVEL",
        help="gzip the output (level 1 unless given)",
    )
    args = ap.parse_args(argv)
    paths = make_set(
        args.out_dir,
        ranks=args.ranks,
        mb_per_rank=args.mb_per_rank,
        source=args.source,
        gzip_level=args.gzip,
    )
    for p in paths:
        print(f"{p}\t{p.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
