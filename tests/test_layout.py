"""The package's layout: no import circle, no private name used across modules, no file too long to read.

Read from the sources' syntax trees, so a circle hidden in a function-level import counts as much as one at the top of
a module: a module that needs such an import to load is a module in the wrong place.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "hf_dynspec"
MAX_LINES = 600
LONG_FILE_NOTE = "Over 600 lines because"
"""How a module that must stay long says why, in its docstring."""


def _modules(root: Path = SOURCES) -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package's `__init__`)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _imports(name: str, path: Path, is_package: bool, modules: dict) -> list[tuple[str, list[str], int]]:
    """Every import of a module of the package in `name`'s file, at any depth (`TYPE_CHECKING` blocks included):
    (the module imported from, the names imported, the line)."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name.startswith(PACKAGE)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.startswith(PACKAGE):
                found.append((source, [alias.name for alias in node.names], node.lineno))
    return found


def _graph(modules: dict) -> dict[str, set[str]]:
    """Module -> the modules it imports (a name that is a submodule counts as that submodule)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        for source, names, _ in _imports(name, path, is_package, modules):
            submodules = {f"{source}.{n}" for n in names if f"{source}.{n}" in modules}
            graph[name] |= submodules or ({source} if source in modules else set())
        graph[name].discard(name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph[node]):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_module_imports_itself_through_others() -> None:
    circles = _circles(_graph(_modules()))
    assert not circles, f"Import circles (each a set of modules that import each other): {circles}"


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import f\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text("from hf_dynspec.a import f\n")
    assert _circles(_graph(_modules(tmp_path))) == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c"]]


def test_no_private_name_is_imported_across_modules() -> None:
    modules = _modules()
    private = [
        f"{path.relative_to(SOURCES)}:{line} imports {n} from {source}"
        for name, (path, is_package) in modules.items()
        for source, names, line in _imports(name, path, is_package, modules)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not private, "Private names used outside their module (make them public where they belong):\n" + "\n".join(
        private
    )


def test_a_long_module_says_why() -> None:
    long = []
    for path, _ in _modules().values():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_LINES and LONG_FILE_NOTE not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(SOURCES)}: {lines} lines")
    assert not long, (
        f"Modules over {MAX_LINES} lines: split them, or say at the top why one must stay one file "
        f"({LONG_FILE_NOTE!r} in its docstring):\n" + "\n".join(long)
    )


def test_only_the_engine_module_imports_continuous_batchings_internals() -> None:
    internals = "transformers.generation.continuous_batching"
    importers = sorted({
        str(path.relative_to(SOURCES))
        for path, _ in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(internals)
        or isinstance(node, ast.Import) and any(alias.name.startswith(internals) for alias in node.names)
    })
    assert importers == ["hf_dynspec/continuous/engine.py"], importers
