"""Evaluation: mean@k / unbiased pass@k metrics, HF (and vLLM) sampling, Best/Last reports.

Entry point: ``python -m recipe.gepo.evaluate`` (see docs/evaluation.md).
"""
from verl_ext.eval.metrics import benchmark_metrics, group_records, mean_at_k, pass_at_k, summarize
from verl_ext.eval.report import EvalPoint, best_last, best_last_table, load_history

__all__ = [
    "pass_at_k",
    "mean_at_k",
    "group_records",
    "benchmark_metrics",
    "summarize",
    "EvalPoint",
    "load_history",
    "best_last",
    "best_last_table",
]
