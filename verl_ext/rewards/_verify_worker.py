"""Verification worker process: runs math_verify's ``parse``/``verify`` with its own timeouts off.

Started by :class:`verl_ext.rewards.verify_pool.VerifyPool` as
``python -c "<runpy this file>"``, so it needs neither the project on ``sys.path`` nor the
parent's ``__main__`` (unlike multiprocessing's spawn/forkserver). It talks over stdin/stdout
with length-prefixed pickles; anything else printed goes to stderr. The parent enforces the
wall-clock timeout by killing the process, so math_verify's ``signal.alarm`` timeouts (which
break in threads) are disabled here: ``parsing_timeout=None``, ``timeout_seconds=None``.

Request:  ``("check", golds: list[str], pred: str, float_rounding: int)`` or ``("ping",)``.
Reply:    ``("ok", {"status": "ok" | "gold_unparsable" | "pred_unparsable", "correct": bool})``
          or ``("exc", "<exception text>")``; the first message is ``("ready", pid)``.
This file imports only the standard library and math_verify: keep it that way.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
import struct
import sys

_HEADER = struct.Struct(">I")

# "17\%", "17 %", "17\text{\%}", "17 percent": a percentage written after a number. Only used when
# math_verify itself cannot parse the answer: latex2sympy2_extended's parser generated for
# antlr4-python3-runtime 4.9.3 (the version hydra-core/omegaconf force) fails on "\%".
_PERCENT_RE = re.compile(
    r"^\s*(?P<num>[-+]?[0-9][0-9.,\\!{} ]*?)\s*(?:\\%|%|\\text\{\s*\\?%\s*\}|(?:\\,)?\s*percent)\s*\.?\s*$"
)


def _clean(text: str) -> str:
    """Strip whitespace, trailing sentence punctuation, LaTeX negative spaces (``\\!``) and
    thousands separators (``29,322,216`` -> ``29322216``)."""
    text = re.sub(r"[\s.,;:]+$", "", text.replace("\\!", "").replace("{,}", ","))
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text).strip()


def _strip_percent(text: str) -> str | None:
    m = _PERCENT_RE.match(text)
    return m.group("num").strip() if m else None


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n > 0:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(fd: int):
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0])
    if body is None:
        return None
    return pickle.loads(body)


def _send(fd: int, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = _HEADER.pack(len(body)) + body
    while data:
        written = os.write(fd, data)
        data = data[written:]


def main() -> None:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints (sympy, antlr) must not corrupt the protocol on stdout
    sys.stdout = sys.stderr
    in_fd = 0
    # math_verify warns once per process that its timeouts are disabled: that is intended here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    check = make_checker()
    _send(out_fd, ("ready", os.getpid()))
    while True:
        msg = _recv(in_fd)
        if msg is None:  # parent closed our stdin: exit quietly
            return
        try:
            if msg[0] == "ping":
                reply = ("ok", {"status": "pong"})
            elif msg[0] == "check":
                _, golds, pred, float_rounding = msg
                reply = ("ok", check(golds, pred, float_rounding))
            else:
                reply = ("exc", f"unknown request {msg[0]!r}")
        except Exception as exc:  # a math_verify crash on odd input must not kill the worker
            reply = ("exc", f"{type(exc).__name__}: {exc}")
        _send(out_fd, reply)


def make_checker():
    """Return ``check(golds, pred, float_rounding) -> {"status", "correct"}`` (no timeouts).

    ``golds`` are candidate gold answers (any match counts); a gold is usable when math_verify
    turns it into at least one sympy object (a bare string fallback does not count), so
    ``status == "gold_unparsable"`` is never scored as correct. ``pred`` is the content of the
    response's last boxed answer.
    """
    from math_verify import parse, verify

    def has_math(parsed) -> bool:
        return any(not isinstance(item, str) for item in parsed)

    def parse_math(text: str):
        parsed = parse(text, parsing_timeout=None)
        return parsed if parsed and has_math(parsed) else None

    def boxed(text: str) -> str:
        return text if "\\boxed" in text else "\\boxed{" + text + "}"

    def alternatives(text: str) -> list:
        """Parsed readings of an answer string, most literal first; [] when none has math.

        1. math_verify on ``\\boxed{text}``; 2. (only if that has no math) the text with
        trailing punctuation and ``\\!`` removed; 3. a percentage ``X\\%`` read both as X and
        X/100 (math_verify's own percent semantics); 4. the bare text.
        """
        parsed = parse_math(boxed(text))
        if parsed is not None:
            return [parsed]
        cleaned = _clean(text)
        if cleaned and cleaned != text:
            parsed = parse_math(boxed(cleaned))
            if parsed is not None:
                return [parsed]
        number = _strip_percent(cleaned or text)
        if number is not None:
            readings = [parse_math(boxed(number)), parse_math("\\boxed{\\frac{" + number + "}{100}}")]
            readings = [r for r in readings if r is not None]
            if readings:
                return readings
        if "\\boxed" not in text:
            parsed = parse_math(text)
            if parsed is not None:
                return [parsed]
        return []

    @functools.lru_cache(maxsize=8192)
    def parse_gold(gold: str) -> tuple:
        return tuple(alternatives(gold))

    def parse_pred(pred: str) -> list:
        readings = alternatives(pred)
        if readings:
            return [item for reading in readings for item in reading]
        # no math at all: keep math_verify's string reading so string golds can still compare
        return parse(boxed(pred), parsing_timeout=None)

    def check(golds, pred, float_rounding):
        parsed_golds = [alt for gold in golds for alt in parse_gold(gold)]
        if not parsed_golds:
            return {"status": "gold_unparsable", "correct": False}
        parsed_pred = parse_pred(pred)
        if not parsed_pred:
            return {"status": "pred_unparsable", "correct": False}
        for gold in parsed_golds:
            if verify(gold, parsed_pred, float_rounding=float_rounding, timeout_seconds=None):
                return {"status": "ok", "correct": True}
        return {"status": "ok", "correct": False}

    return check


if __name__ == "__main__":
    main()
