"""Architecture rules, checked on the source: imports point from a layer to the same or a lower one
(data → models → algorithms → engine → experiment → cli), no module imports itself back through a cycle,
and the size limits of the developers' guide hold everywhere in ``src/``: no module over 450 lines, no
class over 250, no function over 60 (``LONG_FUNCTIONS`` lists the stated exceptions). Cyclomatic
complexity (ruff's C901, at most 12) is checked by ruff itself."""

from __future__ import annotations

import ast
from pathlib import Path

import fedskew

SRC = Path(fedskew.__file__).parent
#: layer of each top-level part of the package; shared leaf modules sit at 0
LAYERS = {
    "errors": 0, "registry": 0, "seeding": 0, "settings": 0, "numerics": 0, "threads": 0, "__init__": 0,
    "runtimes": 0, "search_space": 0, "plugins": 5, "testing": 6,
    "update_rules": 0,
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


#: functions allowed past 60 lines, each with its reason (empty: none needed today)
LONG_FUNCTIONS: dict[str, str] = {}
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 450, 250, 60


def _sizes() -> list[tuple[str, str, str, int]]:
    """(kind, file, name, lines) of every module, class and function of the package."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        rel = str(path.relative_to(SRC))
        out.append(("module", rel, rel, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append((kind, rel, node.name, (node.end_lineno or node.lineno) - node.lineno + 1))
    return out


def test_no_module_class_or_function_over_its_size_limit():
    limits = {"module": MODULE_LINES, "class": CLASS_LINES, "function": FUNCTION_LINES}
    over = [
        f"{rel}: {kind} {name} has {lines} lines (limit {limits[kind]})"
        for kind, rel, name, lines in _sizes()
        if lines > limits[kind] and f"{rel}:{name}" not in LONG_FUNCTIONS
    ]
    assert not over, "\n".join(over)


def test_no_test_asserts_a_literal_that_is_always_true():
    """``assert {k: check(k) for k in ...}`` passes whatever the checks say (a non-empty dict is true): the
    shape that hid SCAFFOLD's server-state parity in test_injection (issue 53, item 8)."""
    always_true = (ast.Dict, ast.DictComp, ast.Set, ast.SetComp, ast.List, ast.ListComp, ast.Tuple,
                   ast.GeneratorExp, ast.Constant, ast.JoinedStr, ast.Lambda)  # fmt: skip
    tests = Path(__file__).parent
    bad = [
        f"{path.relative_to(tests)}:{node.lineno}"
        for path in tests.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert) and isinstance(node.test, always_true)
    ]
    assert not bad, bad
