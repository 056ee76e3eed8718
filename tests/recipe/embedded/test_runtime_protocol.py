"""Both runtimes the driver loop drives (in-process and async mode's proxy) answer every call of
the :class:`Runtime` protocol with the protocol's parameters."""

from __future__ import annotations

import inspect

import pytest

from recipe.gepo.embedded.loop import LearnerRuntime, Runtime
from recipe.gepo.embedded.learner_actor import LearnerWorker
from recipe.gepo.embedded.supervisor import RemoteRuntime

PROTOCOL_METHODS = [
    name for name, value in vars(Runtime).items() if inspect.isfunction(value) and not name.startswith("_")
]


def test_the_protocol_names_what_run_loop_calls():
    from recipe.gepo.embedded import loop

    source = inspect.getsource(loop.run_loop)
    called = {name for name in PROTOCOL_METHODS if f"runtime.{name}(" in source}
    assert called == set(PROTOCOL_METHODS)


@pytest.mark.parametrize("cls", [LearnerRuntime, RemoteRuntime, LearnerWorker])
def test_each_runtime_takes_the_protocols_arguments(cls):
    for name in PROTOCOL_METHODS:
        wanted = inspect.signature(getattr(Runtime, name))
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} has no {name}()"
        # every positional parameter of the protocol binds by position and by name
        args = [p.name for p in wanted.parameters.values()]
        inspect.signature(method).bind(*args)
        inspect.signature(method).bind(**{a: a for a in args})
