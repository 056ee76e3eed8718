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
import struct
import sys

_HEADER = struct.Struct(">I")


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

    @functools.lru_cache(maxsize=8192)
    def parse_gold(gold: str):
        if "\\boxed" in gold:
            candidates = [gold]
        else:
            candidates = ["\\boxed{" + gold + "}", gold]
        for text in candidates:
            parsed = parse(text, parsing_timeout=None)
            if parsed and has_math(parsed):
                return parsed
        return None

    def check(golds, pred, float_rounding):
        parsed_golds = [g for g in (parse_gold(gold) for gold in golds) if g is not None]
        if not parsed_golds:
            return {"status": "gold_unparsable", "correct": False}
        parsed_pred = parse("\\boxed{" + pred + "}", parsing_timeout=None)
        if not parsed_pred:
            return {"status": "pred_unparsable", "correct": False}
        for gold in parsed_golds:
            if verify(gold, parsed_pred, float_rounding=float_rounding, timeout_seconds=None):
                return {"status": "ok", "correct": True}
        return {"status": "ok", "correct": False}

    return check


if __name__ == "__main__":
    main()
