"""Read nccl-tests output (``all_reduce_perf`` and its siblings) into typed result tables.

A log is what a person pastes or saves from a run: the tests' own lines, often interleaved with
``NCCL INFO`` lines, MPI warnings and a launcher's tags (Open MPI's ``[1,0]<stdout>:``, Slurm's
`` 0: ``). So the reader is strict only where the data is: a line inside a result table that
does not parse as a row of that table, or a ``# Rank`` line of the device block that does not
parse, is refused with one line naming ``file:line``. Everything else (noise) is skipped. A log
without result rows is refused: nothing could be fitted on it, and a fit that silently used fewer
logs than given would mislead.

What a log tells, and where from:

- the test: ``# Collective test starting: all_reduce_perf``, else the binary named on a command
  line in the log (``./build/alltoall_perf -b 8 ...``), else the file's name;
- ranks and nodes: the ``# Using devices`` block (one line per rank: ``on HOST device D``), else
  an ``mpirun -np N -npernode M`` line; nodes are the distinct hosts;
- the algorithm/protocol the run was forced to, when the log shows ``NCCL_ALGO=``/``NCCL_PROTO=``
  (an ``mpirun -x NCCL_ALGO=Ring`` line): the fit then prices those rows with that choice only;
- each row: size (bytes), count, type, redop, root and, out-of-place then in-place, time (us),
  algbw and busbw (GB/s) and the error column (``#wrong`` count, an old float ``error``, or
  ``N/A`` where the test does not check).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from prism_trace.errors import TraceFormatError

__all__ = [
    "OPS",
    "NcclLogError",
    "NcclTestLog",
    "ResultRow",
    "read_nccl_log",
    "read_nccl_logs",
]

OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "sendrecv": "sendrecv",
    "broadcast": "broadcast",
    "reduce": "reduce",
}
"""nccl-tests binary stem -> the collective kind prism uses (``all_to_all`` as in the schema)."""


class NcclLogError(TraceFormatError):
    """An nccl-tests log that cannot be read: a malformed row or device line (``file:line``), no
    result rows, or no way to tell the test or its ranks."""


@dataclass(frozen=True)
class ResultRow:
    """One size of one test.

    Attributes:
        size: message size, bytes (nccl-tests' ``size`` column).
        count: elements.
        dtype: element type (``float``).
        redop: reduction (``sum``, ``none``).
        root: root rank (-1: none); None in logs older than the ``root`` column.
        oop_us, oop_algbw, oop_busbw: out-of-place time (us) and bandwidths (GB/s).
        oop_wrong: out-of-place error column: a count, an error magnitude, or None for ``N/A``.
        ip_us, ip_algbw, ip_busbw, ip_wrong: the same, in-place (None where the row has none).
        line: 1-based line of the row in its file.
    """

    size: int
    count: int
    dtype: str
    redop: str
    root: int | None
    oop_us: float
    oop_algbw: float
    oop_busbw: float
    oop_wrong: float | None
    ip_us: float | None
    ip_algbw: float | None
    ip_busbw: float | None
    ip_wrong: float | None
    line: int

    @property
    def time_us(self) -> float:
        """The faster of the out-of-place and in-place times whose data check passed (0: none
        did): a one-off hiccup (a 1.3 ms out-of-place 8 MiB beside a 0.32 ms in-place one) is a
        stall, not the network, and a call that delivered wrong data measured no network."""
        times = [
            t
            for t, wrong in ((self.oop_us, self.oop_wrong), (self.ip_us, self.ip_wrong))
            if t is not None and t > 0 and not self.column_failed(wrong)
        ]
        return min(times, default=0.0)

    @property
    def failed_check(self) -> bool:
        """Whether a column reports wrong data (``#wrong`` above 0)."""
        return self.column_failed(self.oop_wrong) or self.column_failed(self.ip_wrong)

    def column_failed(self, wrong: float | None) -> bool:
        """Whether ``wrong`` (one column's error value) reports wrong data."""
        # Only the ``#wrong`` column (logs with a ``root`` column) counts elements; the old
        # ``error`` column is a float's largest deviation, where a rounding error is no failure.
        return self.root is not None and wrong is not None and wrong > 0


@dataclass(frozen=True)
class NcclTestLog:
    """One test's results from one log file.

    Attributes:
        path: the file.
        op: collective kind (``OPS`` values).
        ranks: participating ranks; None when the log shows neither a device block nor an
            ``mpirun -np`` line.
        nodes: distinct hosts (None as ``ranks``).
        hosts: the hosts, in rank order of first appearance.
        algo: ``NCCL_ALGO`` the run was forced to (lower case), or None.
        proto: ``NCCL_PROTO`` the run was forced to, or None.
        rows: the result rows, in file order.
    """

    path: str
    op: str
    ranks: int | None
    nodes: int | None
    hosts: tuple[str, ...]
    algo: str | None
    proto: str | None
    rows: tuple[ResultRow, ...]

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks on the busiest node (``ceil(ranks / nodes)``)."""
        if self.ranks is None or not self.nodes:
            return None
        return -(-self.ranks // self.nodes)

    @property
    def label(self) -> str:
        """``op@ranks/nodes`` for reports."""
        return f"{self.op}@{self.ranks}r/{self.nodes}n"


_TAG = re.compile(r"^(?:\([^)]*\)\s*)?\[\d+,\d+\]<(stdout|stderr)>:")
"""An Open MPI ``--tag-output`` prefix (optionally after a Ray-style ``(head, rank=0) ``)."""
_LABEL = re.compile(r"^\s*\d+: ")
"""Slurm's ``srun --label`` prefix (the task number, right-aligned, then ``: ``); no result row
or comment of nccl-tests starts with a number and a colon."""
_DEVICE = re.compile(
    r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)\b"
)
_STARTING = re.compile(r"Collective test starting:\s*(\w+?)_perf(?:_mpi)?\b")
_BINARY = re.compile(r"(?:^|[/\s])(\w+?)_perf(?:_mpi)?(?:\s|$)")
_ROW_START = re.compile(r"^\d+\s+\d+\s")
"""A line that claims to be a result row: a size and a count, separated by blanks."""
_ENV = re.compile(r"NCCL_(ALGO|PROTO)=([A-Za-z0-9_,^]+)")
_NP = re.compile(r"(?:mpirun|mpiexec|srun)\b.*?\s-(?:n|np|-np)\s+(\d+)")
_PER_NODE = re.compile(r"\s(?:-npernode|--npernode|-N|--ntasks-per-node)[\s=](\d+)")


def _strip(raw: str) -> str | None:
    """The line without a launcher tag; None for a tagged stderr line (not the test's output)."""
    m = _TAG.match(raw)
    if m is None:
        label = _LABEL.match(raw)
        return raw[label.end() if label else 0 :].rstrip("\n")
    if m.group(1) == "stderr":
        return None
    return raw[m.end() :].rstrip("\n")


def _number(tok: str) -> float:
    return float(tok)


def _error_value(tok: str) -> float | None:
    if tok == "N/A":
        return None
    return float(tok)


class _Segment:
    """The test being read: its device block, table layout and rows so far."""

    def __init__(self) -> None:
        self.op: str | None = None
        self.ranks: dict[int, str] = {}
        self.rows: list[ResultRow] = []
        self.lead: list[str] | None = None  # the columns before the first `time`

    def empty(self) -> bool:
        return not self.rows and not self.ranks


def read_nccl_log(path: Path | str) -> list[NcclTestLog]:
    """The tests in one nccl-tests log (usually one; a log of several runs gives several).

    Args:
        path: the log file.

    Returns:
        One `NcclTestLog` per test found, in file order.

    Raises:
        NcclLogError: the file cannot be read; a result row or ``# Rank`` line is malformed
            (``file:line: ...``); the log has no result rows; the test cannot be told.
    """
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        msg = f"{path}: cannot read the log: {exc.strerror or exc}"
        raise NcclLogError(msg) from exc
    lines = text.splitlines()
    algo = proto = None
    np_ranks: int | None = None
    per_node: int | None = None
    binary: str | None = None
    segments: list[_Segment] = [_Segment()]
    for no, raw in enumerate(lines, start=1):
        line = _strip(raw)
        if line is None:
            continue
        seg = segments[-1]
        body = line.strip()
        for key, value in _ENV.findall(line):
            if key == "ALGO":
                algo = value.lower()
            else:
                proto = value
        if re.search(r"\b(?:mpirun|mpiexec|srun)\b", line):
            m = _NP.search(line)
            np_ranks = int(m.group(1)) if m else np_ranks
            m = _PER_NODE.search(line)
            per_node = int(m.group(1)) if m else per_node
        m = _BINARY.search(line) if not body.startswith("#") else None
        if m and m.group(1) in OPS:
            binary = OPS[m.group(1)]
        m = _STARTING.search(line)
        if m:
            if not seg.empty():
                seg = _Segment()
                segments.append(seg)
            seg.op = OPS.get(m.group(1))
            if seg.op is None:
                msg = f"{path}:{no}: unknown nccl-tests test {m.group(1)}_perf"
                raise NcclLogError(msg)
            continue
        if body.startswith("# Using devices") and seg.rows:
            seg = _Segment()
            segments.append(seg)
            continue
        if re.match(r"^#\s*Rank\s", body):
            d = _DEVICE.match(body)
            if d is None:
                msg = f"{path}:{no}: malformed device line of `# Using devices`: {body[:80]!r}"
                raise NcclLogError(msg)
            rank = int(d.group(1))
            if rank in seg.ranks:
                msg = f"{path}:{no}: rank {rank} is listed twice in `# Using devices`"
                raise NcclLogError(msg)
            seg.ranks[rank] = d.group(3)
            continue
        if body.startswith("#"):
            cols = body.lstrip("#").split()
            if "size" in cols and "time" in cols and cols[0] == "size":
                seg.lead = cols[: cols.index("time")]
            continue
        if seg.lead is None or not _ROW_START.match(body):
            continue  # noise: NCCL INFO lines (hosts may start with a digit), warnings
        seg.rows.append(_row(body, seg.lead, path, no))
    found = [s for s in segments if s.rows]
    if not found:
        msg = f"{path}: no nccl-tests result rows (is it the output of an *_perf test?)"
        raise NcclLogError(msg)
    out = []
    for seg in found:
        op = seg.op or binary or _op_from_name(path)
        if op is None:
            msg = (
                f"{path}: cannot tell which test wrote it: no `# Collective test starting` line,"
                " no *_perf command, and the file name names no test"
            )
            raise NcclLogError(msg)
        hosts = tuple(dict.fromkeys(seg.ranks[r] for r in sorted(seg.ranks)))
        ranks: int | None = len(seg.ranks) or None
        nodes: int | None = len(hosts) or None
        if ranks is None and np_ranks is not None:
            ranks = np_ranks
            nodes = -(-np_ranks // per_node) if per_node else None
        out.append(
            NcclTestLog(
                path=str(path),
                op=op,
                ranks=ranks,
                nodes=nodes,
                hosts=hosts,
                algo=algo,
                proto=proto,
                rows=tuple(seg.rows),
            )
        )
    return out


def _op_from_name(path: Path) -> str | None:
    stem = path.name.lower()
    for key in sorted(OPS, key=len, reverse=True):  # `all_reduce` before `reduce`
        if key in stem:
            return OPS[key]
    return None


def _row(body: str, lead: list[str], path: Path, no: int) -> ResultRow:
    """A result row laid out as its table's header says; one line naming ``file:line`` if not."""
    toks = body.split()
    n_lead = len(lead)
    if len(toks) not in (n_lead + 4, n_lead + 8):
        msg = (
            f"{path}:{no}: not a result row of this table ({len(toks)} fields, expected"
            f" {n_lead + 8} or {n_lead + 4}): {body[:80]!r}"
        )
        raise NcclLogError(msg)
    at = {name: toks[i] for i, name in enumerate(lead)}
    try:
        size = int(at.get("size", toks[0]))
        count = int(at.get("count", "0"))
        root = int(at["root"]) if "root" in at else None
        vals = toks[n_lead:]
        oop = (_number(vals[0]), _number(vals[1]), _number(vals[2]), _error_value(vals[3]))
        ip: tuple[float | None, ...] = (None, None, None, None)
        if len(vals) == 8:
            ip = (_number(vals[4]), _number(vals[5]), _number(vals[6]), _error_value(vals[7]))
    except ValueError as exc:
        msg = f"{path}:{no}: not a result row of this table ({exc}): {body[:80]!r}"
        raise NcclLogError(msg) from exc
    if size < 0 or oop[0] < 0:
        msg = f"{path}:{no}: a negative size or time: {body[:80]!r}"
        raise NcclLogError(msg)
    return ResultRow(
        size=size,
        count=count,
        dtype=at.get("type", ""),
        redop=at.get("redop", ""),
        root=root,
        oop_us=oop[0],
        oop_algbw=oop[1],
        oop_busbw=oop[2],
        oop_wrong=oop[3],
        ip_us=ip[0],
        ip_algbw=ip[1],
        ip_busbw=ip[2],
        ip_wrong=ip[3],
        line=no,
    )


def read_nccl_logs(paths: list[Path] | tuple[Path, ...]) -> list[NcclTestLog]:
    """Every test of every log, in argument order (see `read_nccl_log`)."""
    out: list[NcclTestLog] = []
    for p in paths:
        out.extend(read_nccl_log(p))
    return out
