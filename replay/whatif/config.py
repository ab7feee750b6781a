"""What-ifs: the ``--what-if`` words, and the checked config they parse into.

A what-if is a way an emulation departs from the recorded timing (``WhatIfConfig``;
``prism emulate --what-if ...``, see ``parse_what_if``). Every value is checked here, where it is
given, so a bad one is one line (``WhatIfError``) before any graph is loaded. How a config acts on
a run lives beside it: ``whatif.slow`` (the slow-down factors per node), ``whatif.variance``
(durations drawn from the recorded distribution) and ``whatif.expansion`` (the replicas a what-if
touches, expanded into units of their own).

- ``slow``: multiply the durations of chosen ranks and/or op names (glob) and/or node kinds by a
  factor. On a communication node the factor multiplies its transfer time instead (its recorded
  duration includes waiting, which the emulator recomputes).
- ``remove_gpu``: one GPU fails; its data-parallel replica runs at tensor-parallel degree
  ``tp - 1``. Every rank of that replica computes ``tp / (tp - 1)`` longer (its share of the
  work grew), its TP collectives run on ``tp - 1`` members (modelled transfer), and the GPUs of
  the failed GPU's TP slot (one per stage) leave the results. They stay in the graph as stand-ins
  that carry the re-sharded replica's timing to their pipeline and data-parallel peers.
- ``dp``: emulate at another data-parallel degree (the run is re-sliced first).
- ``bandwidth_scale``: multiply the network bandwidth (``replay.model.topology``).
- ``variance``: each replica draws its durations (seeded). ``replica`` mode (the default) draws
  a persistent rank effect and per-step residuals from a model fitted on every recorded replica
  of the role (``whatif.variance_fit``), so that the slowest of N replicas can exceed the
  recorded ones; ``iteration`` mode draws whole recorded iterations of the representative (a
  drawn step keeps the correlation between the ops of one recorded step); ``op`` mode draws
  every op of the representative independently. The slowest-of-N effect at data-parallel
  collectives then grows with N.

Factors are bounded by ``replay.model.topology.MAX_SLOW_FACTOR``: the timing model's int64 ns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from prism_trace.replay.model.topology import MAX_SLOW_FACTOR

from prism_trace.errors import ConfigError
from prism_trace.graph.base import NODE_KINDS
from prism_trace.limits import MAX_RANKS
from prism_trace.ranks import ascii_int

__all__ = [
    "GLOBAL_BATCH",
    "VARIANCE_MODES",
    "GlobalBatch",
    "SlowDown",
    "VarianceMode",
    "WhatIfConfig",
    "WhatIfError",
    "parse_what_if",
]

VarianceMode = Literal["iteration", "op", "replica"]
GlobalBatch = Literal["per-rank", "fixed"]
GLOBAL_BATCH: tuple[str, ...] = ("per-rank", "fixed")
"""How a dp what-if's re-slice treats the batch (``WhatIfConfig.global_batch``)."""
"""How the variance what-if draws (``WhatIfConfig.variance_mode``)."""

VARIANCE_MODES: tuple[VarianceMode, ...] = ("replica", "iteration", "op")
"""The variance modes, the default first."""


class WhatIfError(ConfigError):
    """A what-if that cannot apply to the run (bad syntax, a rank outside the world, TP 1)."""


def _check_factor(factor: float, what: str) -> float:
    """``factor`` when it is finite and in ``(0, MAX_SLOW_FACTOR]``; else a one-line error."""
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        msg = f"{what} must be a number, got {factor!r}"
        raise WhatIfError(msg)
    if not (math.isfinite(factor) and 0 < factor <= MAX_SLOW_FACTOR):
        msg = f"{what} must be > 0 and <= {MAX_SLOW_FACTOR:g} (finite), got {factor}"
        raise WhatIfError(msg)
    return float(factor)


def _check_glob(glob: str) -> None:
    """Refuse a glob whose ``[`` opens no character class (fnmatch would take it literally, so
    ``slow-ops=[@2`` silently matched nothing); ``[[]`` still matches a literal ``[``."""
    i = 0
    while (i := glob.find("[", i)) >= 0:
        j = i + 1
        if j < len(glob) and glob[j] in "!^":
            j += 1
        if j < len(glob) and glob[j] == "]":
            j += 1  # a ']' first in a class is a member
        close = glob.find("]", j)
        if close < 0:
            msg = f"slow-ops glob {glob!r} is malformed: '[' at {i} opens no class (no ']')"
            raise WhatIfError(msg)
        i = close + 1


@dataclass(frozen=True, kw_only=True)
class SlowDown:
    """Multiply the durations of the matching nodes by ``factor``.

    A node matches when every given criterion holds; an empty criterion matches everything.

    Attributes:
        factor: > 0; 1.2 = 20 % slower.
        ranks: global ranks.
        ops: glob over the node name (``*attention*``, ``forward-*``), case sensitive.
        kinds: graph node kinds (``host``, ``kernel``, ``memcpy``, ``collective``, ...).
    """

    factor: float
    ranks: tuple[int, ...] = ()
    ops: str | None = None
    kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", _check_factor(self.factor, "slow-down factor"))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "kinds", tuple(str(k) for k in self.kinds))
        bad = [r for r in self.ranks if not 0 <= r < MAX_RANKS]
        if bad:
            msg = f"slow-down rank {bad[0]} is outside [0, {MAX_RANKS}) (the rank limit)"
            raise WhatIfError(msg)
        unknown = [k for k in self.kinds if k not in NODE_KINDS]
        if unknown:
            msg = (
                f"slow-down kind {unknown[0]!r} is not a node kind; kinds: {', '.join(NODE_KINDS)}"
            )
            raise WhatIfError(msg)
        if self.ops is not None:
            _check_glob(self.ops)


@dataclass(frozen=True, kw_only=True)
class WhatIfConfig:
    """The ``what_if`` section of ``EmulationConfig``.

    Attributes:
        slow: slow-downs, applied in order (factors multiply).
        remove_gpu: global rank of a failed GPU (its replica runs at ``tp - 1``).
        dp: data-parallel degree to emulate (None: the run's own).
        global_batch: with ``dp``, how the re-slice treats the batch: ``fixed`` (a fixed global
            batch: each rank's microbatches scale by the recorded over the new dp,
            ``prism slice --global-batch fixed``) or ``per-rank`` (every rank keeps its work);
            None: a sliced run's own choice, per-rank for a recording.
        bandwidth_scale: factor on the network bandwidth (None: unchanged).
        variance: each replica draws its durations from its representative's recorded ones.
        variance_mode: ``replica`` (the default: a rank effect and residuals fitted on every
            recorded replica), ``iteration`` (draw whole recorded iterations of the
            representative) or ``op`` (each op alone).
        no_stragglers: every op takes its type's typical time (``replay.whatif.typical``); own
            delays before computations stay, communication is posted as soon as its dependencies
            allow, and every rank enters the recording when it did (its recorded release: the
            start of its first step window) (the counterpart of StragglerAnalysis's
            ``step_t_noblk``).
        no_launch_delay: every op's own delay is 0 (``step_t_nodelay``); releases stay, as with
            ``no_stragglers``, so that no what-if moves where a rank's first step starts (the
            monotone what-ifs, docs/emulator.md).
    """

    slow: tuple[SlowDown, ...] = ()
    remove_gpu: int | None = None
    dp: int | None = None
    global_batch: GlobalBatch | None = None
    bandwidth_scale: float | None = None
    variance: bool = False
    variance_mode: VarianceMode = "replica"
    no_stragglers: bool = False
    no_launch_delay: bool = False

    def __post_init__(self) -> None:
        slow = tuple(s if isinstance(s, SlowDown) else SlowDown(**s) for s in self.slow)
        object.__setattr__(self, "slow", slow)
        if self.variance_mode not in VARIANCE_MODES:
            modes = ", ".join(repr(m) for m in VARIANCE_MODES)
            msg = f"variance_mode must be one of {modes}, got {self.variance_mode!r}"
            raise WhatIfError(msg)
        if self.dp is not None and not 1 <= self.dp <= MAX_RANKS:
            msg = f"dp must be >= 1 and <= {MAX_RANKS} (the world-size limit), got {self.dp}"
            raise WhatIfError(msg)
        if self.global_batch is not None and self.global_batch not in GLOBAL_BATCH:
            msg = f"global-batch must be fixed or per-rank, got {self.global_batch!r}"
            raise WhatIfError(msg)
        if self.global_batch is not None and self.dp is None:
            msg = "global-batch says how a dp what-if treats the batch: give it with dp=N"
            raise WhatIfError(msg)
        if self.remove_gpu is not None and not 0 <= self.remove_gpu < MAX_RANKS:
            msg = f"remove-gpu rank {self.remove_gpu} is outside [0, {MAX_RANKS}) (the rank limit)"
            raise WhatIfError(msg)
        if self.bandwidth_scale is not None:
            b = self.bandwidth_scale
            if not (isinstance(b, int | float) and math.isfinite(b) and b > 0):
                msg = f"bandwidth scale must be a finite number > 0, got {b}"
                raise WhatIfError(msg)
            if not 1 / MAX_SLOW_FACTOR <= b <= MAX_SLOW_FACTOR:
                msg = (
                    f"bandwidth scale must be in [{1 / MAX_SLOW_FACTOR:g}, {MAX_SLOW_FACTOR:g}]"
                    f" (a transfer 1/scale as long must fit int64 ns), got {b}"
                )
                raise WhatIfError(msg)
        product = math.prod(s.factor for s in slow)
        if product > MAX_SLOW_FACTOR:
            msg = (
                f"the slow-down factors multiply to {product:g} (a node that all of them match"
                f" takes that much longer); at most {MAX_SLOW_FACTOR:g} (int64 ns)"
            )
            raise WhatIfError(msg)

    @property
    def active(self) -> bool:
        """Whether anything departs from the recording."""
        return bool(
            self.slow
            or self.remove_gpu is not None
            or self.dp is not None
            or self.bandwidth_scale is not None
            or self.variance
            or self.no_stragglers
            or self.no_launch_delay
        )

    def rank_targets(self) -> set[int]:
        """Ranks whose timing differs from their class (they need units of their own)."""
        out = {r for s in self.slow for r in s.ranks}
        if self.remove_gpu is not None:
            out.add(self.remove_gpu)
        return out


def _ranks(text: str) -> tuple[int, ...]:
    """``3,5..7`` as ranks; a rank outside ``[0, MAX_RANKS)`` is refused before a range is
    expanded (``0..99999999999`` must not build a list of 1e11 ranks)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dots, hi = part.partition("..")
        ends = (ascii_int(lo), ascii_int(hi)) if dots else (ascii_int(part),)
        bad = [r for r in ends if not 0 <= r < MAX_RANKS]
        if bad:
            msg = f"slow-ranks rank {bad[0]} is outside [0, {MAX_RANKS}) (the rank limit)"
            raise WhatIfError(msg)
        if ends[-1] < ends[0]:
            msg = f"slow-ranks range {part!r} is empty (its end is below its start)"
            raise WhatIfError(msg)
        out += range(ends[0], ends[-1] + 1)
    if not out:
        msg = f"slow-ranks {text!r} names no rank"
        raise WhatIfError(msg)
    return tuple(out)


_SYNTAX = (
    "what-ifs: slow-ranks=3,5..7@1.2 | slow-ops=GLOB@1.5 | slow-kind=kernel@1.1 |"
    " remove-gpu=RANK | dp=N [global-batch=fixed|per-rank] | bandwidth=FACTOR |"
    " variance[=replica|iteration|op] | no-stragglers | no-launch-delay"
)


def _once(kw: dict[str, Any], before: dict[str, Any], raw: str) -> None:
    """Refuse a what-if given twice with different values (``dp=2`` then ``dp=8``): one would
    silently win. The slow-downs are exempt: several of them apply in turn (factors multiply)."""
    for key, value in kw.items():
        if key in before and before[key] != value:
            msg = (
                f"what-if {raw.strip()!r} contradicts an earlier one ({key} = {before[key]!r});"
                " give each what-if once"
            )
            raise WhatIfError(msg)


def parse_what_if(texts: list[str] | tuple[str, ...]) -> WhatIfConfig:
    """Parse ``--what-if`` words into a config.

    Words: ``slow-ranks=3,5..7@1.2``, ``slow-ops=forward-*@1.5``, ``slow-kind=kernel@1.1``,
    ``remove-gpu=17``, ``dp=64`` (with ``global-batch=fixed`` or ``per-rank``),
    ``bandwidth=0.5``, ``variance`` (``variance=replica``, the default, ``variance=iteration``,
    ``variance=op``), ``no-stragglers``, ``no-launch-delay``.

    Raises:
        WhatIfError: a word that is not one of these, or a bad value; the message lists the
            syntax. The same word twice with different values (not ``slow-*``, which stack).
    """
    slow: list[SlowDown] = []
    kw: dict[str, Any] = {}
    for raw in texts:
        word = raw.strip()
        key, _, value = word.partition("=")
        before = dict(kw)
        try:
            if key in ("slow-ranks", "slow-ops", "slow-kind"):
                target, at, factor = value.rpartition("@")
                if not at or not target:
                    raise ValueError
                f = float(factor)
                if key == "slow-ranks":
                    slow.append(SlowDown(factor=f, ranks=_ranks(target)))
                elif key == "slow-ops":
                    slow.append(SlowDown(factor=f, ops=target))
                else:
                    slow.append(SlowDown(factor=f, kinds=tuple(target.split(","))))
            elif key == "remove-gpu":
                kw["remove_gpu"] = ascii_int(value)
            elif key == "dp":
                kw["dp"] = ascii_int(value)
            elif key == "global-batch" and value in GLOBAL_BATCH:
                kw["global_batch"] = value
            elif key == "bandwidth":
                kw["bandwidth_scale"] = float(value)
            elif key in ("no-stragglers", "no-launch-delay") and not value:
                kw[key.replace("-", "_")] = True
            elif key == "variance":
                kw["variance"] = True
                kw["variance_mode"] = value or "replica"
            else:
                raise ValueError
        except ValueError as exc:
            if isinstance(exc, WhatIfError):
                raise
            msg = f"cannot read what-if {raw!r}; {_SYNTAX}"
            raise WhatIfError(msg) from None
        _once(kw, before, raw)
    return WhatIfConfig(slow=tuple(slow), **kw)
