"""Architecture rules, checked on the source: imports point from a layer to the same or a lower one
(data → models → algorithms → engine → experiment → cli), no module imports itself back through a cycle,
and no engine class grows past ~250 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import fedskew

SRC = Path(fedskew.__file__).parent
#: layer of each top-level part of the package; shared leaf modules sit at 0
LAYERS = {
    "errors": 0, "registry": 0, "seeding": 0, "settings": 0, "protos": 0, "__init__": 0,
    "data": 1, "models": 2, "algorithms": 3, "engine": 4, "experiment": 5, "flower": 6, "cli": 6,
    "__main__": 7,
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path) -> set[str]:
    """Every fedskew module ``path`` imports at run time (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node)
        for n in ast.walk(node)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedskew"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fedskew"))
    return out


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    return {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else 0


def test_imports_point_to_the_same_or_a_lower_layer():
    bad = [(m, i) for m, deps in graph().items() for i in deps if layer(i) > layer(m)]
    assert not bad, bad


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if d.startswith(m + "."):
                continue  # a package's __init__ re-exporting its own modules is not a cycle
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d) :], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_no_engine_class_over_250_lines():
    for path in (SRC / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                assert length <= 250, f"{path.name}: class {node.name} has {length} lines"
