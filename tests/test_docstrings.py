"""A module docstring is a contract: what the module owns, its inputs and outputs, and pointers to
docs/ for the evidence, in at most :data:`MAX_LINES` lines. Benchmark numbers, dates, measurements
and incident history belong in docs/ (docs/reliability.md, docs/benchmarks.md, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 15
ROOTS = ("verl_ext", "recipe", "research", "scripts")


def docstring_lines(source: str) -> int:
    """Lines of the module docstring of ``source`` as written (0 without one): the text between
    the quotes, closing line included."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return 0 if doc is None else doc.count("\n") + 1


def long_docstrings(roots: tuple[str, ...] = ROOTS, base: Path = REPO, limit: int = MAX_LINES) -> list[str]:
    """``path: N lines`` of every ``.py`` file under ``roots`` whose module docstring is over ``limit``."""
    out = []
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            n = docstring_lines(path.read_text())
            if n > limit:
                out.append(f"{path.relative_to(base)}: {n} lines")
    return out


def test_the_check_can_fail(tmp_path):
    body = "\n".join(f"line {i}" for i in range(MAX_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f'"""Summary.\n{body}\n"""\n\nX = 1\n')
    (tmp_path / "pkg" / "short.py").write_text('"""Summary.\n\nA contract.\n"""\n')
    (tmp_path / "pkg" / "none.py").write_text("X = 1\n")
    assert long_docstrings(("pkg",), base=tmp_path) == [f"pkg/long.py: {MAX_LINES + 2} lines"]
    assert docstring_lines('"""One line."""\n') == 1


def test_every_module_docstring_is_a_short_contract():
    long = long_docstrings()
    assert not long, (
        f"module docstrings over {MAX_LINES} lines (say what the module owns and its contract; "
        f"move evidence and history to docs/): {long}"
    )
