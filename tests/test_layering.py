"""The house's one direction of imports: ``recipe`` builds on ``verl_ext``, never the reverse
(issue #12, item 6). Walks every source file of ``verl_ext`` and looks at every import statement,
module-level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import verl_ext

ROOT = Path(verl_ext.__file__).parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def test_the_walk_sees_imports():
    # the check below must be able to fail: the walk finds a known import of the library itself
    found = imported_modules(ROOT / "analysis" / "run_diagnostics.py")
    assert any(mod.startswith("verl_ext.") for _, mod in found)


def test_nothing_under_verl_ext_imports_recipe():
    sources = sorted(ROOT.rglob("*.py"))
    assert len(sources) > 30
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{line}: {mod}"
        for path in sources
        for line, mod in imported_modules(path)
        if mod == "recipe" or mod.startswith("recipe.")
    ]
    assert not offenders, "verl_ext imports the recipe:\n" + "\n".join(offenders)


RECIPE = ROOT.parent / "recipe" / "gepo"


def _imports_of(folder: Path) -> list[tuple[Path, int, str]]:
    return [(path, line, mod) for path in sorted(folder.rglob("*.py")) for line, mod in imported_modules(path)]


def test_the_two_engines_never_import_each_other():
    local, verl = RECIPE / "local", RECIPE / "verl_engine"
    offenders = [f"{p.relative_to(RECIPE)}:{line}: {mod}" for p, line, mod in _imports_of(local)
                 if mod.startswith("recipe.gepo.verl_engine")]
    offenders += [f"{p.relative_to(RECIPE)}:{line}: {mod}" for p, line, mod in _imports_of(verl)
                  if mod.startswith("recipe.gepo.local")]
    assert not offenders, "\n".join(offenders)


def _module_graph(paths: list[Path], base: Path) -> dict[str, set[str]]:
    """module -> the modules of ``paths`` it imports (``from pkg import sub`` counts as pkg.sub)."""
    def name(p: Path) -> str:
        parts = p.relative_to(base).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    names = {name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for mod, path in names.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            edges |= {t for t in targets if t in names and t != mod and not mod.startswith(t + ".")}
        graph[mod] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return trail + [node, nxt]
            if nxt not in state:
                found = visit(nxt, trail + [node])
                if found:
                    return found
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return []


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_library_or_the_recipe():
    """Module-level and function-level imports alike: one step reads one way (issue 20)."""
    for folder in (ROOT, RECIPE):
        graph = _module_graph(sorted(folder.rglob("*.py")), folder.parents[0] if folder is ROOT else RECIPE.parents[1])
        assert sum(map(len, graph.values())) > 20  # the walk sees the edges
        cycle = _cycle(graph)
        assert not cycle, " -> ".join(cycle)
