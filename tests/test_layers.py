"""The package's layers, read from its source with `ast` (nothing is imported).

The training core (`maskrcnn_tut/` outside `lab/`) never imports the lab, at any level, nor the book's
display and NVML libraries at module level; it stays small enough to read in an afternoon; no module
passes 400 lines and no function 80 (but train.py's loop); and no modules import each other in a circle,
imports inside functions included.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "maskrcnn_tut"
BOOK_ONLY = ("matplotlib", "ipywidgets", "IPython", "pynvml")
#: The core's line budget; code only the lab uses leaves the core before the budget grows.
CORE_MAX_LINES = 6000
MODULE_MAX_LINES = 400
FUNCTION_MAX_LINES = 80
#: The one function allowed to be longer: train.py's loop, written out to be read top to bottom.
LONG_FUNCTIONS = {"maskrcnn_tut.train.run"}


def module_name(path: Path, package: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path) -> dict[str, Path]:
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def is_core(name: str, package: Path) -> bool:
    return not (name + ".").startswith(f"{package.name}.lab.")


def imports(path: Path, package: Path) -> list[tuple[str, bool, int]]:
    """(imported module or `module.name`, at module level, line) for every import in the file."""
    name = module_name(path, package)
    is_package = path.name == "__init__.py"
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, top, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolved against this module's package
                    anchor = name.split(".")[: len(name.split(".")) - child.level + is_package]
                    base = ".".join(anchor + ([base] if base else []))
                found.extend((f"{base}.{alias.name}", top, child.lineno) for alias in child.names)
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def layer_violations(package: Path) -> list[str]:
    """Core modules importing the lab anywhere, or a book-only library at module level."""
    lab = f"{package.name}.lab"
    bad = []
    for name, path in modules(package).items():
        if not is_core(name, package):
            continue
        for target, top, line in imports(path, package):
            if target == lab or target.startswith(lab + "."):
                bad.append(f"{path.relative_to(package.parent)}:{line} imports the lab ({target})")
            elif top and target.split(".")[0] in BOOK_ONLY:
                bad.append(f"{path.relative_to(package.parent)}:{line} imports {target.split('.')[0]} at module level")
    return bad


def import_graph(package: Path) -> dict[str, set[str]]:
    """Which package modules each module imports; `from pkg import sub` counts as importing `pkg.sub`."""
    known = modules(package)
    graph = {}
    for name, path in known.items():
        edges = set()
        for target, _, _ in imports(path, package):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def line_counts(package: Path) -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in modules(package).items()}


def long_functions(package: Path) -> dict[str, int]:
    """Every function (nested ones and methods too, named `module.function`) over `FUNCTION_MAX_LINES`."""
    found = {}
    for name, path in modules(package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_MAX_LINES:
                    found[f"{name}.{node.name}"] = lines
    return found


def test_the_core_imports_no_lab_and_no_book_library_at_module_level():
    assert layer_violations(PACKAGE) == []


def test_the_core_stays_small_and_no_module_is_long():
    counts = line_counts(PACKAGE)
    core = sum(n for name, n in counts.items() if is_core(name, PACKAGE))
    print(f"the core: {core} of {CORE_MAX_LINES} lines")
    assert core <= CORE_MAX_LINES, f"the core has {core} lines, over its budget of {CORE_MAX_LINES}"
    assert {name: n for name, n in counts.items() if n > MODULE_MAX_LINES} == {}


def test_no_function_is_long_but_the_training_loop():
    assert {name: n for name, n in long_functions(PACKAGE).items() if name not in LONG_FUNCTIONS} == {}


def test_no_import_cycles():
    assert cycles(import_graph(PACKAGE)) == []


@pytest.fixture
def broken_copy(tmp_path) -> Path:
    """A copy of the package with a core module that breaks every rule."""
    copy = tmp_path / PACKAGE.name
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "data" / "bad.py").write_text(
        "import matplotlib.pyplot as plt\n"
        "from ..lab import book\n"
        "from maskrcnn_tut import train\n\n\n"
        "def later():\n"
        "    import pynvml  # allowed inside a function\n"
        "    from maskrcnn_tut.lab.bench import harness\n"
        + "    pass\n" * FUNCTION_MAX_LINES + "\n" * MODULE_MAX_LINES)
    (copy / "errors.py").write_text((copy / "errors.py").read_text() + "\n\ndef f():\n    from .data import bad\n")
    return copy


def test_the_checks_catch_a_bad_copy(broken_copy):
    assert layer_violations(broken_copy) == [
        "maskrcnn_tut/data/bad.py:1 imports matplotlib at module level",
        "maskrcnn_tut/data/bad.py:2 imports the lab (maskrcnn_tut.lab.book)",
        "maskrcnn_tut/data/bad.py:8 imports the lab (maskrcnn_tut.lab.bench.harness)",
    ]
    assert any({"maskrcnn_tut.data.bad", "maskrcnn_tut.errors"} <= set(group) for group in cycles(import_graph(broken_copy)))
    assert line_counts(broken_copy)["maskrcnn_tut.data.bad"] > MODULE_MAX_LINES
    assert long_functions(broken_copy)["maskrcnn_tut.data.bad.later"] > FUNCTION_MAX_LINES
