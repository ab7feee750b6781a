"""Dependencies point one way, and the core works without torch.

`prism_trace` never imports `replay` or `analysis` (its CLI only inside command functions); only
`replay` and `datasets` may import torch.
Checked on the source with `ast`, and by importing every `prism_trace` module with torch hidden.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"replay", "analysis", "datasets"}


def _layer(module: str) -> str:
    """``prism_trace.replay.x`` -> ``replay``, ``prism_trace.x`` -> ``prism_trace``."""
    parts = module.split(".")
    if parts[0] == "prism_trace" and len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    return parts[0]


def imported_modules(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {_layer(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(_layer(node.module))
    return out


def test_the_layer_names_resolve() -> None:
    """The check below sees through the one import package (it must not pass vacuously)."""
    assert _layer("prism_trace.replay.emulator") == "replay"
    assert imported_modules(REPO / "replay" / "launch.py") >= {"prism_trace"}
    assert "analysis" in imported_modules(REPO / "analysis" / "report.py")


def test_prism_trace_imports_no_upper_layer_and_no_torch() -> None:
    for path in (REPO / "prism_trace").rglob("*.py"):
        # cli.py tops the stack: it may import a command's module inside the command function.
        mods = imported_modules(path, top_level_only=path.name == "cli.py")
        assert not mods & {"replay", "analysis", "torch"}, f"{path.relative_to(REPO)}: {mods}"


def test_analysis_does_not_import_torch() -> None:
    for path in (REPO / "analysis").rglob("*.py"):
        assert "torch" not in imported_modules(path), path


def test_core_imports_with_torch_hidden() -> None:
    modules = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts)  # prism_trace/x.py -> prism_trace.x
        for p in (REPO / "prism_trace").rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import importlib\n"
        f"for m in {modules!r}: importlib.import_module(m.removesuffix('.__init__'))\n"
        "print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
