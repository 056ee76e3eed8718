"""The house's one direction of imports: ``recipe`` builds on ``verl_ext``, never the reverse.
Walks every source file and looks at every import statement, module-level or inside a function;
relative imports are resolved against the file's own package, so the recipe (which refers to
itself relatively, so that a copy of it runs its own code) is walked like the library."""

from __future__ import annotations

import ast
from pathlib import Path

import verl_ext

ROOT = Path(verl_ext.__file__).parent
REPO = ROOT.parent


def _package_of(path: Path) -> list[str]:
    return list(path.resolve().relative_to(REPO).with_suffix("").parts[:-1])


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The dotted module an ``ImportFrom`` names, relative imports resolved against ``path``'s package."""
    if node.level == 0:
        return node.module or ""
    package = _package_of(path)
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative ones resolved to absolute names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            out.append((node.lineno, _absolute(node, path)))
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


def test_the_walk_resolves_relative_imports():
    assert "recipe.gepo.embedded.engine_config" in {m for _, m in imported_modules(RECIPE / "embedded" / "loop.py")}
    assert any(mod == "recipe.gepo.sections" for _, mod in imported_modules(RECIPE / "embedded" / "engine_config.py"))


def test_the_recipe_never_names_itself_absolutely():
    """A copy (``cp -r recipe/gepo recipe/mygepo``) must run its own modules, not gepo's."""
    offenders = [
        f"{p.relative_to(REPO)}:{node.lineno}"
        for p in sorted(RECIPE.rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("recipe"))
        or (isinstance(node, ast.Import) and any(a.name.startswith("recipe") for a in node.names))
    ]
    assert not offenders, "absolute imports of the recipe (use relative ones):\n" + "\n".join(offenders)


def test_the_two_engines_never_import_each_other():
    embedded, verl = RECIPE / "embedded", RECIPE / "verl_engine"
    assert _imports_of(embedded) and _imports_of(verl)
    offenders = [
        f"{p.relative_to(RECIPE)}:{line}: {mod}"
        for p, line, mod in _imports_of(embedded)
        if mod.startswith("recipe.gepo.verl_engine")
    ]
    offenders += [
        f"{p.relative_to(RECIPE)}:{line}: {mod}"
        for p, line, mod in _imports_of(verl)
        if mod.startswith("recipe.gepo.embedded")
    ]
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
            elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
                module = _absolute(node, path)
                targets = [f"{module}.{a.name}" for a in node.names] + [module]
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
    """Module-level and function-level imports alike: one step reads one way."""
    for folder in (ROOT, RECIPE):
        graph = _module_graph(sorted(folder.rglob("*.py")), folder.parents[0] if folder is ROOT else RECIPE.parents[1])
        assert sum(map(len, graph.values())) > 20  # the walk sees the edges
        cycle = _cycle(graph)
        assert not cycle, " -> ".join(cycle)


def test_the_trust_package_imports_neither_ray_nor_an_engine():
    """Everything that decides admission is engine-neutral (verl_ext/trust): both engines wire it,
    neither owns it. Ray and the engines' packages stay out of it."""
    trust = ROOT / "trust"
    imports = _imports_of(trust)
    assert len(imports) > 20  # the walk sees the package
    offenders = [
        f"{p.relative_to(REPO)}:{line}: {mod}"
        for p, line, mod in imports
        if mod == "ray" or mod.startswith(("ray.", "recipe.", "verl_ext.cpu", "verl.workers"))
    ]
    assert not offenders, "\n".join(offenders)


def test_the_library_and_the_recipe_import_no_tool():
    """``scripts/`` (what users run) and ``research/`` (research and test-bed tooling) are run from
    the repository root and not installed: nothing under verl_ext/ or recipe/ may import them."""
    imports = _imports_of(ROOT) + _imports_of(REPO / "recipe")
    assert len(imports) > 100  # the walk sees both
    offenders = [
        f"{p.relative_to(REPO)}:{line}: {mod}"
        for p, line, mod in imports
        if mod.split(".")[0] in ("scripts", "research")
    ]
    assert not offenders, "\n".join(offenders)
