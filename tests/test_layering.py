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
