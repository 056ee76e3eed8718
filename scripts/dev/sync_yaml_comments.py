"""Keep ``gepo_trainer.yaml``'s comments on HeteroRL's own options equal to their docstrings.

Every field of the project's config dataclasses (``hetero:`` -> ``HeteroConfig`` with its
``delay`` and ``trust``, ``task:`` -> ``TaskConfig``, ``verl_engine:`` -> ``VerlEngineConfig``;
``recipe.gepo.sections``, ``verl_ext.trust.config``) has a docstring (the string right after the
field) whose first line is its one-line summary. In ``recipe/gepo/config/gepo_trainer.yaml`` its
key carries that summary as its trailing ``# comment``; the docstring is the source.

    python -m scripts.dev.sync_yaml_comments          # rewrite the trailing comments from the docstrings
    python -m scripts.dev.sync_yaml_comments --check  # exit 1, listing every difference

Only those trailing comments are written: values, comment lines and every other key stay as they
are. ``tests/recipe/test_yaml_comments.py`` runs the check.
"""

from __future__ import annotations

import argparse
import ast
import collections
import inspect
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[2]
YAML_PATH = ROOT / "recipe" / "gepo" / "config" / "gepo_trainer.yaml"
WIDTH = 120
"""The house line width (pyproject.toml): a summary fits it on the docstring's first line."""
REQUIRED_SECTIONS = ("hetero", "task")
"""Sections the YAML must write out; another section (``verl_engine:``) may be absent, but when
written it lists every field."""
MIN_GAP = 2
"""Fewest spaces between a key's value and its comment."""


class Option(NamedTuple):
    key: str
    """Dotted key (``hetero.trust.max_divergence``)."""
    owner: type
    """The dataclass that declares the field."""
    doc: Optional[str]
    """The field's docstring, cleaned (``inspect.cleandoc``); None when it has none."""
    line: str
    """The source line the docstring starts on (its first line), or "" without a docstring."""
    section: bool
    """Whether the field is itself a dataclass (``hetero.delay``, ``hetero.trust``)."""

    @property
    def summary(self) -> str:
        return self.doc.splitlines()[0].strip() if self.doc else ""


class Entry(NamedTuple):
    index: int
    """0-based line number in the YAML text."""
    code: str
    """The line up to its trailing comment, right-stripped."""
    comment: Optional[str]
    """The trailing comment's text (after ``#``, stripped); None when the line has none."""
    column: Optional[int]
    """0-based column of the comment's ``#``."""


def sections() -> dict[str, type]:
    """Top-level YAML section -> its dataclass."""
    from recipe.gepo.options import PROJECT_SECTIONS
    from recipe.gepo.sections import HeteroConfig, TaskConfig, VerlEngineConfig

    classes = {"hetero": HeteroConfig, "task": TaskConfig, "verl_engine": VerlEngineConfig}
    assert set(classes) == set(PROJECT_SECTIONS), (classes, PROJECT_SECTIONS)
    return classes


def field_docstrings(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (cleaned docstring, the source line it starts on) for every annotated field of
    ``cls`` followed by a string literal, read from its module's source with ``ast``."""
    path = Path(inspect.getsourcefile(cls))
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, filename=str(path))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    if node is None:
        raise LookupError(f"class {cls.__name__} is not defined at the top level of {path}")
    docs = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = (inspect.cleandoc(after.value.value), lines[after.lineno - 1])
    return docs


def options() -> list[Option]:
    """Every option of every section, leaves (``recipe.gepo.options.option_fields``) and nested
    sections alike, in declaration order."""
    from recipe.gepo.options import option_fields

    found: dict[str, Option] = {}
    for prefix, cls in sections().items():
        owners = {prefix: cls}
        leaves = list(option_fields(cls, prefix))
        for key, _, owner in leaves:
            owners[key.rpartition(".")[0]] = owner
        for key, f, owner in leaves:
            parts = key.split(".")
            for depth in range(2, len(parts) + 1):
                dotted = ".".join(parts[:depth])
                if dotted in found:
                    continue
                parent = owners[".".join(parts[: depth - 1])]
                doc, line = field_docstrings(parent).get(parts[depth - 1], (None, ""))
                found[dotted] = Option(dotted, parent, doc, line, depth < len(parts))
    return list(found.values())


def docstring_problems(opts: list[Option]) -> list[str]:
    """One line per option whose docstring cannot give its summary: none, a first line that does
    not end a phrase (``.``), has reST markup, or does not fit ``WIDTH`` columns with its indentation."""
    problems = []
    for opt in opts:
        where = f"{opt.owner.__module__}.{opt.owner.__name__}"
        if not opt.doc:
            problems.append(f"{opt.key}: the field has no docstring in {where}")
            continue
        if not opt.summary.endswith("."):
            problems.append(
                f"{opt.key}: the docstring's first line is not a complete phrase (ends without '.'): {opt.summary!r}"
            )
        if "``" in opt.summary:
            problems.append(f"{opt.key}: the docstring's first line has reST markup (``), which the YAML would quote")
        if len(opt.line) > WIDTH:
            problems.append(f"{opt.key}: the docstring's first line is {len(opt.line)} columns (> {WIDTH}) in {where}")
    return problems


_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w-]*):(?=\s|$)")


def _comment_start(line: str, start: int) -> Optional[int]:
    """Column of the ``#`` that starts ``line``'s trailing comment (outside quotes, after a
    space), searching from ``start``; None when it has none."""
    quote = None
    for i in range(start, len(line)):
        ch = line[i]
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and line[i - 1] in " \t":
            return i
    return None


def yaml_entries(text: str, tops: tuple[str, ...]) -> dict[str, Entry]:
    """Dotted key -> :class:`Entry` for every block-mapping key under the top-level sections
    ``tops`` of the YAML ``text`` (a line parser keyed by indentation; comment lines, blank lines
    and list items are skipped)."""
    entries: dict[str, Entry] = {}
    stack: list[tuple[int, str]] = []
    for index, line in enumerate(text.splitlines()):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _KEY.match(line)
        if not m:
            continue
        indent = len(m.group("indent"))
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, m.group("key"))]
        if stack[0][1] not in tops or len(stack) == 1:
            continue
        hash_at = _comment_start(line, m.end())
        code = (line if hash_at is None else line[:hash_at]).rstrip()
        comment = None if hash_at is None else line[hash_at + 1 :].strip()
        entries[".".join(k for _, k in stack)] = Entry(index, code, comment, hash_at)
    return entries


def _normalised(text: Optional[str]) -> str:
    return " ".join((text or "").split())


def yaml_problems(text: str, opts: list[Option]) -> list[str]:
    """One line per difference between the YAML ``text`` and the options ``opts``: a field
    missing from a written section, a key under a section that is no field, a comment that is
    not the field's summary (naming the key, the YAML's text and the docstring's)."""
    tops = tuple(sections())
    entries = yaml_entries(text, tops)
    written = {key.split(".")[0] for key in entries} | set(REQUIRED_SECTIONS)
    by_key = {opt.key: opt for opt in opts}
    problems = []
    for opt in opts:
        if opt.key.split(".")[0] not in written:
            continue
        entry = entries.get(opt.key)
        if entry is None:
            problems.append(f"{opt.key}: field of {opt.owner.__name__} missing from the YAML")
        elif _normalised(entry.comment) != _normalised(opt.summary):
            problems.append(
                f"{opt.key}: the YAML comment differs from the docstring's first line\n"
                f"    yaml:      {entry.comment!r}\n"
                f"    docstring: {opt.summary!r}"
            )
    for key in entries:
        if key in by_key:
            continue
        parent = key.rpartition(".")[0]
        if parent in tops or (parent in by_key and by_key[parent].section):
            problems.append(f"{key}: key in the YAML that is no field of {sections()[key.split('.')[0]].__name__}")
    return problems


def check(text: Optional[str] = None) -> list[str]:
    """Every problem: the docstrings' and the YAML's (``text``: the YAML's; default the file's)."""
    opts = options()
    text = YAML_PATH.read_text() if text is None else text
    return docstring_problems(opts) + yaml_problems(text, opts)


def rewrite(text: str, opts: Optional[list[Option]] = None) -> str:
    """``text`` with the trailing comment of every option's key set to the option's summary, at
    the column most of its section's comments already use (at least ``MIN_GAP`` spaces after the value)."""
    opts = options() if opts is None else opts
    entries = yaml_entries(text, tuple(sections()))
    columns: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for key, entry in entries.items():
        if entry.column is not None:
            columns[key.split(".")[0]][entry.column] += 1
    lines = text.splitlines(keepends=True)
    for opt in opts:
        entry = entries.get(opt.key)
        if entry is None or not opt.summary:
            continue
        counts = columns[opt.key.split(".")[0]]
        column = counts.most_common(1)[0][0] if counts else 0
        ending = lines[entry.index][len(lines[entry.index].rstrip("\r\n")) :]
        pad = max(column - len(entry.code), MIN_GAP)
        lines[entry.index] = f"{entry.code}{' ' * pad}# {opt.summary}{ending}"
    return "".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 listing every difference")
    parser.add_argument("--yaml", type=Path, default=YAML_PATH, help="the config file (default: %(default)s)")
    args = parser.parse_args(argv)
    text = args.yaml.read_text()
    opts = options()
    if not args.check:
        new = rewrite(text, opts)
        if new != text:
            args.yaml.write_text(new)
            print(f"rewrote the option comments of {args.yaml}")
        text = new
    problems = docstring_problems(opts) + yaml_problems(text, opts)
    for problem in problems:
        print(problem)
    if problems:
        what = "differences" if args.check else "problems the rewrite cannot fix (edit the docstrings or the keys)"
        print(f"{len(problems)} {what}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
