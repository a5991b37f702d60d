"""The package's shape: no source file under src/specjax over 450 lines, and no import circle among its modules.

The import graph is built from module-level `import` / `from` statements (class bodies included; function bodies
and `if TYPE_CHECKING:` blocks left out), read with `ast`, relative names resolved.  `from pkg import name` is an
edge to the module pkg.name when that is a module, else to pkg.  Reading source, not importing it, keeps this fast.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "specjax"
PACKAGE = "specjax"
MAX_LINES = 450
SOURCE_SUFFIXES = (".py", ".cc", ".h")


def module_name(path: Path) -> str:
    parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.AST, module_level: bool = True):
    """The Import / ImportFrom nodes of `tree`: those run when the module is imported (`module_level`), or those
    inside function bodies (not `module_level`)."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, True)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                continue
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                if in_function != module_level:
                    yield child
            else:
                yield from walk(child, in_function)

    yield from walk(tree, False)


def imported_modules(node, importer: str, is_package: bool, known: set[str]) -> set[str]:
    """The package modules an Import / ImportFrom node of module `importer` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = importer.split(".") if is_package else importer.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:  # `import a.b.c` where c is not a module of ours
            name = name.rpartition(".")[0]
        if name.startswith(PACKAGE + ".") or name == PACKAGE:
            out.add(name)
    return out


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    """Module -> package modules it imports (at module level, or only inside functions)."""
    mods = modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        deps = set()
        for node in import_nodes(tree, module_level):
            deps |= imported_modules(node, name, path.name == "__init__.py", known)
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: the import circles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def oversized() -> dict[str, int]:
    """Source files (relative to src/specjax) over MAX_LINES lines -> their line count."""
    out = {}
    for path in sorted(ROOT.rglob("*")):
        if path.suffix in SOURCE_SUFFIXES and path.is_file():
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > MAX_LINES:
                out[str(path.relative_to(ROOT))] = n
    return out


def test_no_source_file_over_the_line_limit():
    big = oversized()
    assert not big, f"files over {MAX_LINES} lines (split them along their seams): {big}"


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles among specjax modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_graph_sees_known_edges():
    """The checks above pass vacuously if the graph is empty: a few edges every version of the package has."""
    graph = import_graph()
    assert "specjax.engine.sequence" in graph["specjax.engine.engine"]
    assert "specjax.config" in graph["specjax.llm"]
    assert len(graph) > 50


if __name__ == "__main__":  # print the circles, and function-level imports that would close one if moved up
    g = import_graph()
    print("module-level circles:", cycles(g))
    print("oversized:", oversized())
    late = import_graph(module_level=False)
    for mod in sorted(late):
        for dep in sorted(late[mod] - g[mod]):
            trial = {k: set(v) for k, v in g.items()}
            trial[mod].add(dep)
            closing = [c for c in cycles(trial) if mod in c and dep in c]
            if closing:
                print(f"function-level import {mod} -> {dep} would close: {closing}")
