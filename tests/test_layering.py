"""Dependencies point one way, and the core works without torch.

The layers: core (`prism_trace`, minus its CLI and its facade) -> `replay` | `analysis` ->
`prism_trace.cli` and the facade `prism_trace/__init__.py` (the Python API, which loads each
name from whichever layer defines it, on first use).
The core imports neither `replay`, `analysis` nor the CLI; `replay` and `analysis` do not import
each other (one listed exception) nor the CLI; nothing imports the CLI. Only `replay` and
`datasets` may import torch. Checked on the source with `ast` (import-linter cannot see
`replay/` and `analysis/` as subpackages: setuptools maps them in with `package-dir`), and by
importing every core module with torch hidden.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"replay", "analysis", "datasets", "cli"}

ALLOWED_ACROSS = {("analysis/report/data.py", "replay")}
"""Imports between `replay` and `analysis` that stay, each for a reason: the report draws a
recorded run's memory from its host ET with the replay's tensor-lifetime model (inside the
function that needs it)."""


def _layer(module: str) -> str:
    """``prism_trace.replay.x`` -> ``replay``, ``prism_trace.cli.x`` -> ``cli``,
    ``prism_trace.x`` -> ``prism_trace``."""
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
    assert _layer("prism_trace.replay.des.core") == "replay"
    assert imported_modules(REPO / "replay" / "pg" / "launch.py") >= {"prism_trace"}
    assert "analysis" in imported_modules(REPO / "analysis" / "report" / "html.py")


FACADE = REPO / "prism_trace" / "__init__.py"


def _core_files() -> list[Path]:
    cli = REPO / "prism_trace" / "cli"
    return [p for p in (REPO / "prism_trace").rglob("*.py") if cli not in p.parents and p != FACADE]


def test_the_cli_is_a_package_on_top() -> None:
    assert (REPO / "prism_trace" / "cli" / "__init__.py").is_file()
    assert not (REPO / "prism_trace" / "cli.py").exists()


def test_prism_trace_imports_no_upper_layer_and_no_torch() -> None:
    for path in _core_files():
        mods = imported_modules(path)
        assert not mods & {"replay", "analysis", "cli", "torch"}, (
            f"{path.relative_to(REPO)}: {mods}"
        )


def test_replay_and_analysis_are_independent_and_below_the_cli() -> None:
    for layer, other in (("replay", "analysis"), ("analysis", "replay")):
        for path in (REPO / layer).rglob("*.py"):
            mods = imported_modules(path)
            rel = str(path.relative_to(REPO))
            assert "cli" not in mods, rel
            if (rel, other) not in ALLOWED_ACROSS:
                assert other not in mods, f"{rel} imports {other}"


def test_the_cli_holds_no_sql() -> None:
    """The CLI parses and prints; queries belong to the layers below it."""
    for path in (REPO / "prism_trace" / "cli").rglob("*.py"):
        text = path.read_text()
        assert ".execute(" not in text, path.relative_to(REPO)
        assert ".sql(" not in text, path.relative_to(REPO)


def test_analysis_does_not_import_torch() -> None:
    for path in (REPO / "analysis").rglob("*.py"):
        assert "torch" not in imported_modules(path), path


def test_core_imports_with_torch_hidden() -> None:
    modules = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts)  # prism_trace/x.py -> prism_trace.x
        for p in _core_files()
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


def test_the_cli_loads_without_the_analysis_layer() -> None:
    """Every command pays the CLI's imports: `prism ingest` must not import polars, numpy or the
    analyses only to let click list `prism analyze`'s words (``cli/_words.py``), which must
    still be the analysis layer's own."""
    from prism_trace.analysis import COMPARISONS, WORDS

    from prism_trace.cli._words import ANALYZE_WORDS, COMPARE_WORDS

    assert ANALYZE_WORDS == WORDS
    assert tuple(COMPARISONS) == COMPARE_WORDS
    code = (
        "import sys, prism_trace.cli; "
        "print(sorted(m for m in ('polars', 'numpy', 'prism_trace.analysis', 'torch')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_facade_loads_nothing_until_asked() -> None:
    """`import prism_trace` (which every command pays) loads no layer, DuckDB, polars or torch;
    a name of the API loads its own module only."""
    code = (
        "import sys, prism_trace\n"
        "heavy = ('duckdb', 'polars', 'torch', 'prism_trace.replay', 'prism_trace.analysis')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "prism_trace.ParallelLayout\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.splitlines() == ["[]", "[]"]
