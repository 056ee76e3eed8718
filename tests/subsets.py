"""Representative cases of a parametrized family for the default run; the other cases go to the slow tier.

A family that runs every preset or every option for real costs the default suite minutes, and
most of its cases take the same code path. The module names the cases the default run keeps
(one per path: a group loss, a token loss, a sequence loss, ...); ``make test-all`` runs all.
"""

import pytest

_PARAM = type(pytest.param(None))


def default_run_keeps(cases, keep):
    """``cases`` (values, tuples of several arguments' values, or ``pytest.param``s) with every case
    not kept marked slow.

    ``keep``: names of cases, a case being named by its id when it has one, else by its value (one
    argument) or its tuple of values; or a predicate on that name. A name that matches no case, or
    a predicate that keeps none, raises: a renamed preset would otherwise leave the default run.
    """
    kept = keep if callable(keep) else set(keep).__contains__
    out, seen = [], []
    for case in cases:
        param = case if isinstance(case, _PARAM) else pytest.param(*(case if isinstance(case, tuple) else (case,)))
        name = param.id if param.id is not None else (param.values[0] if len(param.values) == 1 else param.values)
        if kept(name):
            seen.append(name)
            out.append(param)
        else:
            out.append(pytest.param(*param.values, marks=[*param.marks, pytest.mark.slow], id=param.id))
    missing = not seen if callable(keep) else [name for name in keep if name not in seen]
    if missing:
        raise ValueError(f"default_run_keeps: {keep if callable(keep) else sorted(map(str, missing))} keeps no case")
    return out
