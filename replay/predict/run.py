"""`prism predict`: a small recording emulated at a larger recording's scale, then compared.

``predict_run`` slices the small recording to the large one's layout and world and emulates it
(the emulator's ``dp`` what-if: a temporary slice, deleted before the transaction ends), once per
seed when the variance what-if draws each replica's durations, and hands the emulated runs and
the large recording to a comparison (the analysis layer's ``compare_runs``, passed in: the
replay and analysis layers do not import each other). One transaction holds it all: without
``out_run`` it is rolled back once the comparison is made, so the store is left exactly as it
was (graphs built on the way included); with ``out_run`` the first seed's emulated run is kept
under that name and the rest is deleted before the commit. See docs/predict.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from prism_trace.replay.emulate.config import EmulationConfig
from prism_trace.replay.emulate.driver import emulate_run
from prism_trace.replay.whatif.config import WhatIfConfig

from prism_trace.errors import RunStateError, UsageError
from prism_trace.layout.choice import infer_layout
from prism_trace.slicing.report import one_member_note
from prism_trace.store.write import claim_run_name, drop_run

if TYPE_CHECKING:
    from prism_trace.layout.mesh import ParallelLayout
    from prism_trace.store.connection import Store

__all__ = ["Comparison", "Prediction", "predict_run", "target_layout"]


class Comparison(Protocol):
    """What a comparison gives back: its figures as JSON and as text."""

    def as_dict(self) -> dict[str, Any]:
        """Every figure, JSON-ready."""
        ...

    def summary(self) -> str:
        """The readable form."""
        ...


C = TypeVar("C", bound=Comparison)


@dataclass
class Prediction(Generic[C]):
    """What ``predict_run`` did and what the comparison found.

    Attributes:
        run: the small recording predicted from.
        against: the recording at the target scale.
        layout: the target layout's spec (``against``'s).
        order: its rank order.
        world_size: ranks of the target world.
        variance: the variance mode, or None.
        seeds: emulations made (one per seed).
        runs: the emulated runs compared (all but ``kept`` are gone from the store).
        kept: the emulated run kept (``out_run``), or None.
        comparison: what ``compare`` returned.
        seconds: wall time of the emulations, the comparison and the whole.
        notes: anything the reader should know.
    """

    run: str
    against: str
    layout: str
    order: str
    world_size: int
    variance: str | None
    seeds: int
    runs: list[str]
    kept: str | None
    comparison: C
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, the comparison's figures under ``comparison``."""
        return {
            "run": self.run,
            "against": self.against,
            "layout": self.layout,
            "order": self.order,
            "world_size": self.world_size,
            "variance": self.variance,
            "seeds": self.seeds,
            "runs": self.runs,
            "kept": self.kept,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "notes": self.notes,
            "comparison": self.comparison.as_dict(),
        }

    def summary(self) -> str:
        """A header line, then the comparison's text."""
        how = f", variance {self.variance}, {self.seeds} seeds" if self.variance else ""
        kept = f"kept as {self.kept!r}" if self.kept else "nothing kept"
        head = (
            f"predicted {self.against!r} ({self.world_size} ranks, {self.layout}) from"
            f" {self.run!r}{how}: {kept}; {self.seconds.get('total', 0.0):.1f} s"
        )
        return "\n".join([head, *(f"note: {n}" for n in self.notes), self.comparison.summary()])


class _Discard(Exception):
    """Raised at the end of a prediction that keeps nothing: the transaction rolls back."""


def target_layout(store: Store, run: str, against: str) -> ParallelLayout:
    """``against``'s layout (declared or inferred), after checking that ``run``'s differs from
    it in dp only (a prediction changes the data-parallel degree, as slicing does).

    Raises:
        PrismError: either run has no layout, or the layouts differ beyond dp.
    """
    large = infer_layout(store, against)
    small = infer_layout(store, run)
    if dataclasses.replace(small, dp=large.dp) != large:
        msg = (
            f"{store.path}: run {run!r} has layout {small.spec} (order {small.order_spec}) and"
            f" {against!r} {large.spec} (order {large.order_spec}); a prediction changes dp only,"
            " so every other axis and the rank order must agree"
        )
        raise UsageError(msg)
    return large


def _check(store: Store, run: str, against: str, out_run: str | None) -> None:
    """Refuse what cannot be predicted, before anything is built."""
    if store.read_only:
        msg = f"{store.path}: a prediction emulates inside a transaction; open the store writable"
        raise UsageError(msg)
    if run == against:
        msg = f"{store.path}: --run and --against name the same run {run!r}"
        raise UsageError(msg)
    if out_run is not None and out_run in (run, against):
        msg = f"{store.path}: --out-run {out_run!r} is an input run; choose a new name"
        raise UsageError(msg)
    for name, option in ((run, "--run"), (against, "--against")):
        ((kind,),) = store.con.execute(
            "SELECT kind FROM run WHERE run_id = ?", [store.require_run(name)]
        ).fetchall()
        if kind != "recorded":
            msg = f"{store.path}: {option} {name!r} is a {kind} run; a prediction needs recordings"
            raise RunStateError(msg)


def _free_name(store: Store, name: str, taken: Sequence[str]) -> str:
    """``name``, or ``name~2``, ``name~3``, ...: the first that no run has."""
    out, n = name, 1
    while store.run_id(out) is not None or out in taken:
        n += 1
        out = f"{name}~{n}"
    return out


def predict_run(
    store: Store,
    *,
    run: str,
    against: str,
    compare: Callable[[Store, list[str], str], C],
    variance: Literal["replica", "iteration", "op"] | None = None,
    seeds: int = 1,
    global_batch: Literal["per-rank", "fixed"] = "per-rank",
    out_run: str | None = None,
    replace: bool = False,
    config: EmulationConfig | None = None,
) -> Prediction[C]:
    """Predict the recording ``against`` from the smaller recording ``run``, and compare.

    Args:
        store: an open, writable store holding both recordings.
        run: the small recording (its layout may differ from ``against``'s in dp only).
        against: the recording at the target scale: its layout and world are the target.
        compare: ``(store, emulated runs, against) -> comparison``, called inside the
            transaction while the emulated runs exist (``prism_trace.compare_runs``).
        variance: emulate with each replica drawing its durations (``replica``: its own rank effect
            and recorded residuals, see ``replay.whatif.variance_fit``; ``iteration`` or ``op``).
        seeds: emulations, seeds ``config.seed`` onwards (more than one needs ``variance``).
        global_batch: ``fixed``: the job keeps its global batch, so each rank of the target
            runs the recorded microbatches times the recorded over the target dp
            (``prism slice --global-batch fixed``); ``per-rank``: each rank keeps its work.
        out_run: keep the first seed's emulated run under this name.
        replace: overwrite an emulated run called ``out_run``.
        config: the emulation config (default ``EmulationConfig()``); its what-ifs are replaced
            by the prediction's (``dp``, and ``variance`` when asked).

    Returns:
        What was predicted, with the comparison.

    Raises:
        PrismError: a run that is not a recording, layouts that differ beyond dp, a read-only
            store, ``seeds`` below 1 or above 1 without ``variance``, an ``out_run`` taken, or
            what slicing and emulating refuse. Nothing is written then.
    """
    t0 = time.perf_counter()
    if seeds < 1 or (seeds > 1 and variance is None):
        msg = (
            f"--seeds {seeds}: give at least 1, and more only with --variance (else each is alike)"
        )
        raise UsageError(msg)
    _check(store, run, against, out_run)
    target = target_layout(store, run, against)
    base = config or EmulationConfig()
    what_if = WhatIfConfig(
        dp=target.dp,
        global_batch=global_batch,
        variance=variance is not None,
        variance_mode=variance or "replica",
    )
    outer = store.in_transaction
    notes: list[str] = []
    found: list[Prediction[C]] = []
    try:
        with store.transaction():
            if out_run is not None:
                claim_run_name(store, out_run, replace=replace, over=("emulated",))
            names: list[str] = []
            for i in range(seeds):
                seed = base.seed + i
                keep = out_run is not None and i == 0
                name = out_run if keep else _free_name(store, f"{run}->{against}:seed{seed}", names)
                assert name is not None
                cfg = dataclasses.replace(base, what_if=what_if, seed=seed)
                rep = emulate_run(
                    store, run=run, out_run=name, replace=keep and replace, config=cfg
                )
                grown = one_member_note(target.dp)
                if i == 0 and grown in rep.notes:  # what one recorded replica cannot tell
                    notes.append(grown)
                names.append(name)
            t1 = time.perf_counter()
            _graph_for_ops(store, against)
            comparison = compare(store, names, against)
            t2 = time.perf_counter()
            for name in names:
                if name != out_run:
                    run_id = store.run_id(name)
                    if run_id is not None:
                        drop_run(store.con, run_id)
            if out_run is None and outer:
                notes.append(
                    "inside the caller's transaction: the emulated runs are deleted, a graph"
                    " built for a recording stays with the caller's writes"
                )
            found.append(
                Prediction(
                    run=run,
                    against=against,
                    layout=target.spec,
                    order=target.order_spec,
                    world_size=target.world_size,
                    variance=variance,
                    seeds=seeds,
                    runs=names,
                    kept=out_run,
                    comparison=comparison,
                    seconds={"emulate": t1 - t0, "compare": t2 - t1},
                    notes=notes,
                )
            )
            if out_run is None and not outer:
                raise _Discard
    except _Discard:
        pass
    found[0].seconds["total"] = time.perf_counter() - t0
    return found[0]


def _graph_for_ops(store: Store, against: str) -> None:
    """Build ``against``'s execution graph when it has none: its nodes are the ops the
    prediction's are compared with (kept only with the predicted run, ``out_run``)."""
    run_id = store.require_run(against)
    if not store.con.execute(
        "SELECT count(*) FROM graph_node WHERE run_id = ?", [run_id]
    ).fetchall()[0][0]:
        from prism_trace.graph.build import build_graph

        build_graph(store, against)
