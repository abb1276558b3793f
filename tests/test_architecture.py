"""The package's import structure: no module imports one that imports it back (at module level
or inside functions), and no private name crosses from one sub-package to another."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "fastload"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _walk_runtime(tree: ast.AST):
    """ast.walk, leaving out ``if TYPE_CHECKING:`` blocks (they never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo += child.orelse
            else:
                todo.append(child)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported fastload module, names taken from it) for every import statement in the file."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = []
    for node in _walk_runtime(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("fastload")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                mod = ".".join(target)
            else:
                mod = node.module or ""
            if not mod.startswith("fastload"):
                continue
            names = [a.name for a in node.names]
            # "from . import x" imports a submodule x (or a C extension module, built from x.c)
            subs = [n for n in names if f"{mod}.{n}" in modules]
            names = [n for n in names if not (PKG.parent / (f"{mod}.{n}".replace(".", "/") + ".c")).is_file()]
            found += [(f"{mod}.{n}", []) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest:  # names from the module itself (not only its submodules)
                found.append((mod, rest))
    return [(m, ns) for m, ns in found if m in modules]


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for t, _ in _imports(m, p, modules) if t != m} for m, p in modules.items()}
    # a package's __init__ that imports nothing eagerly does not close a cycle through it
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_cross_sub_packages():
    modules = _modules()
    bad = []
    for m, p in modules.items():
        home = m.split(".")[:2]
        for target, names in _imports(m, p, modules):
            if target.split(".")[:2] == home:
                continue
            bad += [f"{m} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_relative_and_function_level_imports():
    modules = _modules()
    deps = {t for t, _ in _imports("fastload.gpu.dali", modules["fastload.gpu.dali"], modules)}
    assert {"fastload.checks", "fastload.data.order", "fastload.data.plan"} <= deps
    lazy = {t for t, _ in _imports("fastload.data.loader", modules["fastload.data.loader"], modules)}
    assert "fastload.gpu.pinning" in lazy  # imported inside a method
