"""Evaluation: mean@k / unbiased pass@k metrics, HF (and vLLM) sampling, Best/Last reports.

Entry points: ``python -m recipe.gepo.evaluate`` and ``python -m verl_ext.eval.report``
(see docs/evaluation.md). Names are imported lazily so ``python -m verl_ext.eval.report`` runs
its module only once.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "pass_at_k": "metrics",
    "mean_at_k": "metrics",
    "group_records": "metrics",
    "benchmark_metrics": "metrics",
    "summarize": "metrics",
    "EvalPoint": "report",
    "load_history": "report",
    "best_last": "report",
    "best_last_table": "report",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"verl_ext.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'verl_ext.eval' has no attribute {name!r}")
