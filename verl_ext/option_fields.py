"""Config dataclass fields that declare which runners honour them (:func:`option`).

A run executes in one of three ways (a *runner*): the embedded engine in replay mode, in async
mode, or the verl engine. Each project option is declared where it lives with :func:`option`;
``recipe.gepo.options`` holds the contract that refuses a non-default value a runner would ignore.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Optional

REPLAY, ASYNC, VERL = "replay", "async", "verl"
RUNNERS = (REPLAY, ASYNC, VERL)
EMBEDDED = (REPLAY, ASYNC)
EVERYWHERE = RUNNERS

RUNNER_NAMES = {
    REPLAY: "hetero.engine=embedded hetero.mode=replay",
    ASYNC: "hetero.engine=embedded hetero.mode=async",
    VERL: "hetero.engine=verl",
}


def runner_of(engine: str, mode: str) -> str:
    """The runner of ``hetero.engine`` / ``hetero.mode`` (the verl engine is always async)."""
    return VERL if engine == "verl" else mode


def option(
    default: Any = dataclasses.MISSING,
    *,
    honoured_by: Iterable[str],
    factory: Optional[Callable[[], Any]] = None,
    instead: str | dict[str, str] = "",
) -> Any:
    """A config dataclass field that declares which runners honour it.

    Args:
        default: the field's default (or ``factory`` for mutable defaults).
        honoured_by: the runners (:data:`REPLAY`, :data:`ASYNC`, :data:`VERL`) that act on it.
        instead: what the other runners do instead (one text, or one per runner), quoted in the
            error that refuses a non-default value there.
    """
    runners = tuple(honoured_by)
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown or not runners:
        raise ValueError(f"option honoured_by={runners!r}: expected a non-empty subset of {RUNNERS}")
    metadata = {"honoured_by": runners, "instead": instead}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def honoured_by(field: dataclasses.Field) -> tuple[str, ...]:
    """The runners that honour ``field`` (every runner for a field declared without :func:`option`)."""
    return tuple(field.metadata.get("honoured_by", RUNNERS))


def _instead(field: dataclasses.Field, runner: str) -> str:
    instead = field.metadata.get("instead", "")
    return instead.get(runner, "") if isinstance(instead, dict) else instead


def field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default (its factory's product for a mutable one; MISSING if none)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def option_fields(cls: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field, type]]:
    """``(dotted key, field, owner class)`` for every field of the config dataclass ``cls`` and of
    the config dataclasses nested in it (``hetero.delay.*``)."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        default = field_default(f)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            yield from option_fields(type(default), key)
        else:
            yield key, f, cls
