"""Text helpers shared by the rewards and the dataset loaders: find the last ``\\boxed{...}``.

Pure string code (no sympy, no math_verify), so it is cheap to call in the parent process before
any answer is sent to a verification worker.
"""

from __future__ import annotations

import re

__all__ = ["last_boxed", "last_boxed_content", "BOXED_COMMANDS"]

#: LaTeX commands whose argument is taken as a final answer. ``\fbox`` is what some MATH
#: solutions use instead of ``\boxed``.
BOXED_COMMANDS = ("\\boxed", "\\fbox")

_COMMAND_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced_argument(text: str, start: int) -> tuple[str, int] | None:
    """Return (content, end) of the brace group opening at ``text[start] == '{'``.

    ``end`` is the index just past the closing brace. Escaped braces (``\\{``, ``\\}``) do not
    count. Returns None when the group is never closed (a truncated response).
    """
    depth = 0
    i = start
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, e.g. \{ or \}
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def _iter_boxed(text: str):
    """Yield (content, span_start, span_end) for every complete boxed answer, left to right."""
    for match in _COMMAND_RE.finditer(text):
        j = match.end()
        # skip spaces between the command and its argument: "\boxed {5}" and "\boxed 5"
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            found = _braced_argument(text, j)
            if found is None:
                continue
            content, end = found
            yield content, match.start(), end
        elif j > match.end():
            # "\boxed 5": the argument is the next run of characters up to space or "$"
            m = re.match(r"[^\s$]+", text[j:])
            if m:
                yield m.group(0), match.start(), j + m.end()


def last_boxed(text: str) -> str | None:
    """The last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, command included.

    Returns None when there is none (unclosed braces at the end of a truncated response do not
    count as an answer).
    """
    if not isinstance(text, str):
        raise TypeError(f"last_boxed expects a str, got {type(text).__name__}: {text!r:.80}")
    last = None
    for _content, start, end in _iter_boxed(text):
        last = text[start:end]
    return last


def last_boxed_content(text: str) -> str | None:
    """The argument of the last complete boxed answer, stripped; None when there is none.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``. An empty box (``\\boxed{}``) gives None,
    since it holds no answer.
    """
    if not isinstance(text, str):
        raise TypeError(f"last_boxed_content expects a str, got {type(text).__name__}: {text!r:.80}")
    last = None
    for content, _start, _end in _iter_boxed(text):
        last = content
    if last is None:
        return None
    last = last.strip()
    return last or None
