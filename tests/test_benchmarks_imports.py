"""benchmarks/ has no import circle (issue 53, item 9): faults.py ran the config fuzzer and fuzz_config.py
imported faults.py back for the CLI caller, which now lives in benchmarks/cli_calls.py. Imports inside
functions count too: they were how the circle hid."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """The benchmark modules ``path`` imports anywhere (``benchmarks.x``, or ``x`` on the script path)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            short = name.removeprefix("benchmarks.").split(".")[0]
            if short in siblings and short != path.stem:
                out.add(short)
    return out


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (module -> modules it imports) as a path, or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_the_benchmark_modules_import_each_other_without_a_circle():
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")}
    graph = {p.stem: sibling_imports(p, siblings) for p in BENCHMARKS.glob("*.py")}
    assert "cli_calls" in graph["fuzz_config"] and "faults" not in graph["fuzz_config"]
    assert cycle(graph) == [], " -> ".join(cycle(graph))


def test_the_check_sees_a_circle_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from benchmarks.c import g\n")
    (tmp_path / "c.py").write_text("def g():\n    from benchmarks import a\n")
    siblings = {"a", "b", "c"}
    graph = {p.stem: sibling_imports(p, siblings) for p in tmp_path.glob("*.py")}
    assert cycle(graph) == ["a", "b", "c", "a"]
