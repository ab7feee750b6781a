"""A program as generated Python: one function per pass, timed or bare, and its checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prism_trace.replay.kernels.program import Program
from prism_trace.replay.kernels.schema import TensorMeta, _Unsupported

__all__ = ["check_program", "compile_pass", "render"]


_INLINE = (int, bool, str, type(None))


class _Consts:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def render(self, v: Any) -> str:
        if isinstance(v, _INLINE) or (isinstance(v, float) and v == v and abs(v) != float("inf")):
            return repr(v)
        if isinstance(v, (list, tuple)) and all(
            isinstance(x, _INLINE) or (isinstance(x, float) and x == x and abs(x) != float("inf"))
            for x in v
        ):
            return repr(list(v))
        name = f"C{len(self.values)}"
        self.values[name] = v
        return name


def _ref(ref: tuple[str, Any], consts: _Consts) -> str:
    kind, v = ref
    if kind == "c":
        return consts.render(v)
    if kind == "s":
        return f"t{v}"
    if kind == "x":
        return f"x{v}"
    if kind == "a":
        return f"a{v}"
    return "[" + ", ".join(_ref(r, consts) for r in v) + "]"


def render(
    program: Program, *, gaps: bool, device: Any, timed: bool = True
) -> tuple[str, dict[str, Any]]:
    """Python source of one replay pass over ``program`` and the globals it needs.

    The pass is straight-line code, one block per unit, so that the only work between two ops
    is a clock read, a few local stores and the frees: this keeps the replay's own overhead far
    below the ops' time (docs/replay.md). The views a unit needs (autograd's saved views, which
    the recording made inside C++ without a call of its own) are built *before* its gap wait,
    so that with ``gaps`` their µs come out of the recorded gap instead of adding to it.

    Hooks, passed as arguments: ``pc`` (clock), ``B(k)`` (an iteration starts at unit ``k``;
    ``B(len(units))`` ends the pass), ``S(k)`` (wait the
    recorded gap before unit ``k``; only with ``gaps``), ``W(k)`` (communication unit ``k``),
    ``SUB(k)`` (spend the recorded duration of a substituted op), ``AS`` (``torch.as_strided``)
    and ``ES`` (``torch.empty_strided``). ``T[2k]``/``T[2k+1]`` receive unit ``k``'s start/end.

    Args:
        program: the program.
        gaps: emit ``S(k)`` before each unit.
        device: maps recorded device strings to ``torch.device`` (for substituted results).
        timed: False renders the *bare* pass: the same ops, views, allocations and frees with
            no clock reads, no hooks, and neither communication nor substitutes; its wall time
            is what executing the ops costs without the replay, the baseline of the
            instrumentation overhead (``KernelReplayOptions.bare_passes``).

    Returns:
        ``(source, globals)``: exec the source with the globals to get ``_replay_pass``.
    """
    consts = _Consts()
    fns: dict[int, str] = {}
    glb: dict[str, Any] = {}
    lines = ["def _replay_pass(X, T, pc, B, S, W, SUB, AS, ES):"]
    if program.externals:
        names = ", ".join(f"x{i}" for i in range(len(program.externals)))
        lines.append(f"    ({names},) = X")
    prev_it: object = object()

    def stamp(i: int) -> list[str]:
        return [f"    T[{i}] = pc()"] if timed else []

    gaps = gaps and timed
    for u in program.units:
        k = u.index
        if u.iteration != prev_it and timed:
            lines.append(f"    B({k})")
        prev_it = u.iteration
        call = program.calls.get(k) if u.kind != "comm" else None
        if call is not None:  # views first, so that their cost falls inside the recorded gap
            lines += [
                f"    a{alias} = AS({_ref(base, consts)}, {list(m.shape)!r},"
                f" {list(m.strides)!r}, {m.offset})"
                for alias, base, m in call.aliases
            ]
        if gaps:
            lines.append(f"    S({k})")
        if u.kind == "comm":
            if timed:
                lines += [*stamp(2 * k), f"    W({k})", *stamp(2 * k + 1)]
            continue
        if call is None:
            if timed:
                lines += [*stamp(2 * k), f"    SUB({k})"]
            lines += [
                _alloc(slot, m, m.strides, consts, device)
                for slot, m in program.substituted_outputs.get(k, [])
            ]
            lines += stamp(2 * k + 1)
            lines += _nested_allocs(program, k, consts, device)
            lines += [f"    t{s} = None" for s in program.frees_after.get(k, [])]
            continue
        fid = id(call.op)
        if fid not in fns:
            fns[fid] = f"F{len(fns)}"
            glb[fns[fid]] = getattr(call.op, "_op", call.op)
        args = [_ref(r, consts) for r in call.args]
        args += [f"{name}={_ref(r, consts)}" for name, r in call.kwargs.items()]
        target = ""
        rest: list[str] = []
        if len(call.outputs) == 1 and call.outputs[0][1] is None and call.n_returns == 1:
            target = f"t{call.outputs[0][2]} = "
        elif call.outputs:
            target = f"r{k} = "
            for j, idx, slot, _ in call.outputs:
                sub = f"[{j}]" if call.n_returns > 1 else ""
                sub += f"[{idx}]" if idx is not None else ""
                rest.append(f"    t{slot} = r{k}{sub}")
            rest.append(f"    r{k} = None")
        lines += [
            *stamp(2 * k),
            f"    {target}{fns[fid]}({', '.join(args)})",
            *stamp(2 * k + 1),
            *rest,
        ]
        lines += _nested_allocs(program, k, consts, device)
        lines += [f"    t{s} = None" for s in call.frees]
        lines += [f"    a{a} = None" for a, _, _ in call.aliases]
    if timed:
        lines.append(f"    B({len(program.units)})")
    glb.update(consts.values)
    return "\n".join(lines) + "\n", glb


def _nested_allocs(program: Program, k: int, consts: _Consts, device: Any) -> list[str]:
    """Lines allocating the storages unit ``k``'s inner ops made for later units."""
    return [_alloc(slot, m, (1,), consts, device) for slot, m in program.nested_outputs.get(k, [])]


def _alloc(slot: int, m: TensorMeta, strides: Sequence[int], consts: _Consts, device: Any) -> str:
    """The line allocating slot ``slot`` uninitialised with ``m``'s shape, dtype and device."""
    dt = consts.render(_torch_dtype(m.dtype))
    dev = consts.render(device(m.device))
    return f"    t{slot} = ES({list(m.shape)!r}, {list(strides)!r}, {dt}, {dev})"


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def compile_pass(program: Program, *, gaps: bool, device: Any, timed: bool = True) -> Any:
    """``render`` and compile: the ``_replay_pass`` function of ``program``."""
    source, glb = render(program, gaps=gaps, device=device, timed=timed)
    code = compile(source, "<replay pass>", "exec")
    exec(code, glb)
    return glb["_replay_pass"]


def check_program(program: Program, externals: list[Any], device: Any) -> dict[int, str]:
    """Execute every rebuilt op once and return the ones that fail or disagree with the ET.

    An op fails when it raises, or when a result's shape differs from the recorded one (data-
    dependent shapes such as ``nonzero`` on random data). A failed op's results are replaced by
    empty tensors of the recorded layout, so that the ops after it are still checked.

    Args:
        program: the program.
        externals: from ``make_externals``.
        device: maps recorded device strings to ``torch.device``.

    Returns:
        Unit index -> reason, for the ops to treat as unsupported.
    """
    import torch

    slots: dict[int, Any] = {}
    aliases: dict[int, Any] = {}
    bad: dict[int, str] = {}

    def val(ref: tuple[str, Any]) -> Any:
        kind, v = ref
        if kind == "c":
            return v
        if kind == "s":
            return slots.get(v)
        if kind == "x":
            return externals[v]
        if kind == "a":
            return aliases[v]
        return [val(r) for r in v]

    def empty(m: TensorMeta) -> Any:
        return torch.empty_strided(
            m.shape, m.strides, dtype=getattr(torch, m.dtype), device=device(m.device)
        )

    with torch.no_grad():
        for u in program.units:
            call = program.calls.get(u.index)
            if call is None:
                for slot, m in program.substituted_outputs.get(u.index, []):
                    slots[slot] = empty(m)
                for slot, m in program.nested_outputs.get(u.index, []):
                    slots[slot] = empty(m)
                continue
            try:
                for a, base, m in call.aliases:
                    aliases[a] = torch.as_strided(val(base), m.shape, m.strides, m.offset)
                out = call.op(
                    *[val(r) for r in call.args], **{k: val(r) for k, r in call.kwargs.items()}
                )
                for j, idx, slot, m in call.outputs:
                    v = out[j] if call.n_returns > 1 else out
                    v = v[idx] if idx is not None else v
                    if not isinstance(v, torch.Tensor):
                        msg = f"result {j} is {type(v).__name__}, recorded a tensor"
                        raise _Unsupported(msg)
                    if tuple(v.shape) != m.shape:
                        msg = f"result shape {list(v.shape)} differs from recorded {list(m.shape)}"
                        raise _Unsupported(msg)
                    slots[slot] = v
            except Exception as exc:
                bad[u.index] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                for _, _, slot, m in call.outputs:
                    slots[slot] = empty(m)
            for slot, m in program.nested_outputs.get(u.index, []):
                slots[slot] = empty(m)
            for s in call.frees:
                slots.pop(s, None)
            aliases.clear()
    return bad
