"""What each op type of an op timeline is: its category, the lane (track) it runs on, and the
collective or point-to-point call it makes."""

from __future__ import annotations

__all__: list[str] = []

_LANES = {"compute": 0, "pp-comm": 1, "dp-comm": 3, "misc": 4}

_P2P = {  # optype -> (direction, stage offset of the peer)
    "forward-send": ("send", 1),
    "forward-recv": ("recv", -1),
    "backward-send": ("send", -1),
    "backward-recv": ("recv", 1),
}

_SYNC_OPS = frozenset({"optimizer-clip-main-grad"})
_COMPUTE_OPS = frozenset({"optimizer", "gc"})


def _collective(optype: str) -> tuple[str, str] | None:
    """(kind, group family) of a collective optype, or None."""
    if optype == "embedding-grads-all-reduce":
        return "all_reduce", "embd"
    if optype == "layernorm-grads-all-reduce":
        return "all_reduce", "tp"
    for suffix, kind in (
        ("all-reduce", "all_reduce"),
        ("all-gather", "all_gather"),
        ("reduce-scatter", "reduce_scatter"),
        ("all-to-all", "all_to_all"),
        ("broadcast", "broadcast"),
    ):
        if optype.endswith(suffix):
            return kind, "dp"
    return None


def _category_lane(optype: str) -> tuple[str, str]:
    """(category, lane) of an optype: the event's ``category`` and the track it runs on."""
    if optype in _P2P:
        return "comm", "pp-comm"
    if _collective(optype) is not None or optype in _SYNC_OPS:
        return "comm", "dp-comm"
    if optype.endswith("-compute") or optype in _COMPUTE_OPS:
        return "compute", "compute"
    return "other", "misc"
