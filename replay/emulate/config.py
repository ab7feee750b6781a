"""What an emulation is asked for and what it returns: ``EmulationConfig`` with its sections
(``CompletionConfig``, ``MemoryConfig``), and ``EmulationReport``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from prism_trace.replay.model.timing import TimingConfig
from prism_trace.replay.model.topology import Topology
from prism_trace.replay.network.model import NetworkModel
from prism_trace.replay.whatif.config import WhatIfConfig

from prism_trace.errors import ConfigError
from prism_trace.limits import MAX_RANKS

__all__ = [
    "MAX_SEED",
    "CompletionConfig",
    "EmulationConfig",
    "EmulationConfigError",
    "EmulationReport",
    "MemoryConfig",
    "check_seed",
]

MAX_SEED = (1 << 63) - 1
"""The largest seed: seeds are stored in ``run.config_json`` and written back as TOML, whose
integers are int64; numpy's generators refuse negative seeds."""


class EmulationConfigError(ConfigError):
    """A value ``EmulationConfig`` refuses (a negative seed, a rank outside the rank limit)."""


def check_seed(seed: object, where: str = "seed") -> int:
    """``seed`` when it is an integer in ``[0, MAX_SEED]``; else a one-line error naming
    ``where`` (numpy raised a bare ValueError on a negative seed, deep in the variance mode)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        msg = f"{where} must be a whole number in [0, 2**63 - 1], got {seed!r}"
        raise EmulationConfigError(msg)
    return seed


_COMM = ("collective", "send", "recv")
_DEFAULT_CATEGORY = {
    "host": "cpu_op",
    "kernel": "kernel",
    "memcpy": "memcpy",
    "memset": "memset",
    "collective": "comm",
    "send": "comm",
    "recv": "comm",
}


@dataclass(frozen=True, kw_only=True)
class CompletionConfig:
    """When the emulator lets a communication call complete: the ``completion`` section of
    ``EmulationConfig`` (TOML ``[completion]``; it was ``ReplayConfig`` / ``[replay]``).

    Attributes:
        allow_partial: resolve a communication instance over the participants present instead of
            raising ``MissingParticipantError`` (for partial recordings; the result then ignores
            the absent ranks).
        rule: ``per_rank`` (each participant completes at last arrival + transfer + its
            recorded completion skew: exact replay of collectives whose ranks leave at different
            times, e.g. gloo) or ``common`` (all complete at last arrival + transfer).
    """

    allow_partial: bool = False
    rule: Literal["per_rank", "common"] = "per_rank"

    def __post_init__(self) -> None:
        if self.rule not in ("per_rank", "common"):
            msg = f"completion `rule` must be per_rank or common, got {self.rule!r}"
            raise ConfigError(msg)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The ``memory`` section of ``EmulationConfig`` (see ``replay.memory``).

    Attributes:
        optimizer_state_bytes: distributed-optimizer state each rank held at the recorded DP
            degree, for re-sizing its shard in a sliced run with another DP degree; None takes
            ``optimizer_state_bytes`` from the represented rank's ``rank.args`` (absent: 0, no
            change).
    """

    optimizer_state_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    """Everything that shapes an emulation; stored resolved in ``run.config_json``.

    Attributes:
        completion: when communication completes (``CompletionConfig``).
        timing: the transfer-time model (``replay.timing.TimingConfig``).
        topology: the network (``replay.topology.Topology``), used by modelled transfers.
        memory: the memory replay (``MemoryConfig``).
        what_if: departures from the recording (``replay.whatif.WhatIfConfig``).
        network: a network model fitted on nccl-tests logs (``replay.network.NetworkModel``,
            ``prism network fit``); when set it prices every collective in place of the
            topology's alpha-beta costs. Off (``intra_gbps`` unset) by default.
        seed: seed of the random models (the variance mode).
        keep_events: ranks whose own per-op events are written besides the class exemplars'
            (a class member otherwise shares its exemplar's events: ``rank.class_id``).
    """

    completion: CompletionConfig = field(default_factory=CompletionConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    topology: Topology = field(default_factory=Topology)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    what_if: WhatIfConfig = field(default_factory=WhatIfConfig)
    network: NetworkModel = field(default_factory=NetworkModel)
    seed: int = 0
    keep_events: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_seed(self.seed)
        bad = [r for r in self.keep_events if not 0 <= r < MAX_RANKS]
        if bad:
            msg = f"keep_events rank {bad[0]} is outside [0, {MAX_RANKS}) (the rank limit)"
            raise EmulationConfigError(msg)

    def check_world(self, world_size: int, run: str) -> None:
        """Refuse ``keep_events`` ranks outside ``run``'s world (they have no events to keep).

        Raises:
            EmulationConfigError: a rank ``>= world_size``.
        """
        bad = [r for r in self.keep_events if r >= world_size]
        if bad:
            msg = (
                f"keep_events rank {bad[0]} is outside the world of {world_size} ranks"
                f" of run {run!r}"
            )
            raise EmulationConfigError(msg)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form; no ``network`` section while the network model is off."""
        out = asdict(self)
        if not self.network.enabled:
            del out["network"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EmulationConfig:
        """Build from a parsed TOML/JSON mapping with the same sections.

        Args:
            data: ``{"completion": {...}, "timing": {...}, "topology": {...}, "memory": {...},
                "what_if": {...}, "seed": 0}``.

        Returns:
            The config (unknown keys raise ``TypeError``).
        """
        return cls(
            completion=CompletionConfig(**data.get("completion", {})),
            timing=TimingConfig(**data.get("timing", {})),
            topology=Topology(**data.get("topology", {})),
            memory=MemoryConfig(**data.get("memory", {})),
            what_if=WhatIfConfig(**data.get("what_if", {})),
            network=NetworkModel.from_table(data.get("network", {})),
            seed=int(data.get("seed", 0)),
            keep_events=tuple(int(r) for r in data.get("keep_events", ())),
        )


@dataclass
class EmulationReport:
    """What ``emulate_run`` did."""

    run: str
    run_id: int
    input_run: str
    input_run_id: int
    input_kind: str
    world_size: int
    units: int
    nodes: int
    edges: int
    collective_instances: int
    p2p_instances: int
    rounds: int
    events_written: int
    iteration_rows: int
    represented_events: int
    rank_step_rows: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    peak_memory: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def events_per_s(self) -> float:
        """Events of the full world (nodes x class members) per second of emulation."""
        t = self.seconds.get("emulate", 0.0)
        return self.represented_events / t if t > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "run": self.run,
            "run_id": self.run_id,
            "input_run": self.input_run,
            "input_run_id": self.input_run_id,
            "input_kind": self.input_kind,
            "world_size": self.world_size,
            "units": self.units,
            "nodes": self.nodes,
            "edges": self.edges,
            "collective_instances": self.collective_instances,
            "p2p_instances": self.p2p_instances,
            "rounds": self.rounds,
            "events_written": self.events_written,
            "iteration_rows": self.iteration_rows,
            "rank_step_rows": self.rank_step_rows,
            "represented_events": self.represented_events,
            "events_per_s": round(self.events_per_s, 1),
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "iterations": self.iterations,
            "peak_memory": {str(k): v for k, v in sorted(self.peak_memory.items())},
            "notes": self.notes,
        }

    def summary(self) -> str:
        """A few lines for the CLI."""
        lines = [
            f"emulated run {self.run!r} (id {self.run_id}) from {self.input_kind} run"
            f" {self.input_run!r}: {self.world_size} ranks as {self.units} units,"
            f" {self.nodes} nodes, {self.collective_instances} collectives,"
            f" {self.p2p_instances} send/recv pairs",
            f"  {self.seconds.get('total', 0.0):.2f} s (load {self.seconds.get('load', 0.0):.2f},"
            f" emulate {self.seconds.get('emulate', 0.0):.3f}, write"
            f" {self.seconds.get('write', 0.0):.2f}); {self.events_per_s:,.0f} events/s",
        ]
        for it in self.iterations[:10]:
            lines.append(
                f"  iteration {it['iteration']}: mean {it['mean_ns'] / 1e6:.3f} ms,"
                f" max {it['max_ns'] / 1e6:.3f} ms over {it['ranks']} ranks"
            )
        if len(self.iterations) > 10:
            lines.append(f"  ... {len(self.iterations) - 10} more iterations")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
