"""The house plan holds: a sub-package per concern, small modules, private names kept at home,
no import cycles, every module's surface declared, and docs/architecture.md drawn from the code.

Read from the sources with ``ast``: setuptools maps replay/, analysis/ and datasets/ into the one
package with ``package-dir``, which import graph tools cannot follow. Every import counts,
function-level (lazy) ones included: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
ROOTS = {
    "prism_trace": "prism_trace",
    "replay": "prism_trace.replay",
    "analysis": "prism_trace.analysis",
    "datasets": "prism_trace.datasets",
}
MAX_LINES = 600
GENERATED = {"chakra_pb2.py"}


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by its dotted name."""
    out: dict[str, Path] = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [package, *path.relative_to(REPO / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    """The package a module belongs to: its folder (a package's ``__init__`` is the package)."""
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _imports(module: str) -> Iterator[tuple[str, str | None]]:
    """(module imported, name taken from it or None) for every import of ours in ``module``."""
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield (sub, None) if sub in MODULES else (node.module, alias.name)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_module_map_sees_the_whole_package() -> None:
    """The checks below must not pass because they read nothing."""
    assert "prism_trace.replay.des.core" in MODULES
    assert "prism_trace.analysis.report" in MODULES
    assert len(MODULES) > 100


def test_no_module_is_over_600_lines() -> None:
    big = {
        str(path.relative_to(REPO)): n
        for path in MODULES.values()
        if path.name not in GENERATED and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}, f"split these along a seam of concerns: {big}"


def test_every_module_declares_its_surface() -> None:
    def has_all(path: Path) -> bool:
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return True
        return False

    missing = [
        str(path.relative_to(REPO))
        for path in MODULES.values()
        if path.name not in GENERATED and path.name != "__main__.py" and not has_all(path)
    ]
    assert missing == []


def test_no_private_name_is_imported_across_packages() -> None:
    crossing = [
        f"{module} imports {target}{'.' + name if name else ''}"
        for module in MODULES
        for target, name in _imports(module)
        if _is_private(name or target.rsplit(".", 1)[-1])
        and _package(module) != (_package(target) if name else target.rsplit(".", 1)[0])
    ]
    assert crossing == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_lazy_imports_included() -> None:
    edges = {m: {t for t, _ in _imports(m) if t != m} for m in MODULES}
    assert _cycles(edges) == []


def test_no_package_depends_on_itself_through_another() -> None:
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        for target, _ in _imports(module):
            a, b = _package(module), _package(target)
            if a != b and not b.startswith(a + "."):
                edges.setdefault(a, set()).add(b)
    assert _cycles(edges) == []


def test_mypy_resolves_every_import_of_ours() -> None:
    """No `ignore_missing_imports` that could cover a prism_trace module: scripts/typecheck
    maps the tree, so an unresolved import of ours is an error, not a silent Any."""
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "ignore_missing_imports" not in mypy
    assert mypy["disallow_untyped_defs"] is True
    for override in mypy.get("overrides", []):
        if override.get("ignore_missing_imports"):
            assert not any(m.startswith("prism_trace") for m in override["module"]), override


# docs/architecture.md: the block after "## The tree" lists every package, one line each:
# `prism_trace.x.y    <the first line of its __init__ docstring>`.
TREE_LINE = re.compile(r"^(prism_trace(?:\.\w+)*)\s{2,}(.+)$")


def _documented_tree() -> dict[str, str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## The tree", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    out = {}
    for line in block.splitlines():
        match = TREE_LINE.match(line.strip())
        if match:
            out[match.group(1)] = match.group(2).strip()
    return out


def _code_tree() -> dict[str, str]:
    out = {}
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            out[module] = doc.split("\n\n", 1)[0].replace("\n", " ")
    return out


def test_the_architecture_doc_is_the_tree_of_the_code() -> None:
    documented, code = _documented_tree(), _code_tree()
    expected = "\n".join(f"{name:32} {line}" for name, line in sorted(code.items()))
    assert documented == code, f"docs/architecture.md's tree should read:\n{expected}"


def test_every_package_says_what_it_owns() -> None:
    for name, line in _code_tree().items():
        assert line.endswith("."), f"{name}: its __init__ docstring's first line"


def test_the_emulator_doc_lists_every_module_of_the_emulator() -> None:
    """docs/emulator.md's module table covers the emulator's packages whole."""
    text = (REPO / "docs" / "emulator.md").read_text()
    listed = set(re.findall(r"^\| `(replay/[\w/]+\.py)` \|", text, re.M))
    packages = ("des", "emulate", "model", "whatif", "memory", "validate")
    present = {
        str(path.relative_to(REPO))
        for package in packages
        for path in (REPO / "replay" / package).glob("*.py")
        if path.name != "__init__.py"
    }
    assert listed == present
