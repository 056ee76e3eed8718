"""Tasks for the embedded engine: where prompts come from, how a response is scored, how the
policy is evaluated. The ``task:`` section of ``gepo_trainer.yaml`` picks one.

- ``toy_addition``: zero-padded n-digit addition on a ~1M-parameter Llama warm-started on CPU
  (``verl_ext.data.toy``); the CPU laboratory. ``answer_format=scratchpad`` is its long-answer
  variant (column sums and carries written out, 6 digits + 3 tokens per response; only the final
  sum is rewarded), with its own warm start.
- ``math``: a math dataset (``verl_ext.data.datasets.load_benchmark``) with a prompt template and
  the math_verify reward; for a real model on a GPU machine (runs on CPU, slowly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

TASKS = ("toy_addition", "math")


@dataclass
class TaskConfig:
    """The ``task:`` section; every field is in ``gepo_trainer.yaml`` (a test keeps them in step)."""

    name: str = "toy_addition"
    """toy_addition | math."""
    digits: int = 3
    """toy_addition: operand digits."""
    answer_format: str = "short"
    """toy_addition: ``short`` (the sum, digits + 2 tokens) or ``scratchpad`` (long answers: the
    column sums and carries, then ``=`` and the sum; 6 digits + 3 tokens; set
    ``data.max_response_length`` accordingly)."""
    diagnostics_every: int = 0
    """Replay mode: every k-th step log the E[A] estimation error (``diag/*``, see
    ``verl_ext.analysis.run_diagnostics``); 0 = off."""
    diagnostics_samples: int = 32
    """Fresh learner samples per prompt for the E[A] diagnostic."""
    eval_size: int = 256
    """Held-out prompts per evaluation (toy: fresh problems never trained on; math: first N)."""
    eval_temperature: float = 1.0
    """Sampling temperature of evaluation (one sample per prompt)."""
    warm_start_accuracy: list[float] = field(default_factory=lambda: [0.3, 0.6])
    """toy_addition: the supervised warm start stops once held-out accuracy is inside this window."""
    warm_start_max_seconds: float = 600.0
    """toy_addition: wall-clock budget of the warm start."""
    warm_start_steps: int = 0
    """toy_addition: > 0 = the pinned warm start, exactly this many supervised steps from seed
    ``hetero.seed`` with deterministic ops, the same weights on any machine (its sha256 in the
    folder's ``warm_start.json``; ``verl_ext.data.toy.warm_start(steps=...)``); the two
    ``warm_start_accuracy`` / ``warm_start_max_seconds`` keys are then not used. 0 = the older
    accuracy-window warm start, whose time budget makes it depend on the machine's speed."""
    cache_dir: str = ".cache/heterorl"
    """Where warm-started checkpoints are cached (reused across runs with the same settings)."""
    dataset: str = "math_train"
    """math: training set name for ``load_benchmark`` (math_train, gsm8k, math500, ...)."""
    dataset_path: str = ""
    """math: file for datasets that need one (aime24, ...); empty = the built-in location."""
    eval_dataset: str = "math500"
    """math: evaluation set name."""
    template: str = "qwen3_nothink"
    """math: prompt template (``verl_ext.data.templates``)."""

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"task.name={self.name!r}; expected one of {TASKS}")
        if self.answer_format not in ("short", "scratchpad"):
            raise ValueError(f"task.answer_format={self.answer_format!r}; expected short | scratchpad")
        if self.answer_format != "short" and self.name != "toy_addition":
            raise ValueError("task.answer_format applies to task.name=toy_addition only")
        if self.diagnostics_every < 0 or self.diagnostics_samples < 1:
            raise ValueError(
                f"task.diagnostics_every={self.diagnostics_every} must be >= 0 and "
                f"task.diagnostics_samples={self.diagnostics_samples} >= 1"
            )
        if self.eval_size < 1:
            raise ValueError(f"task.eval_size={self.eval_size} must be >= 1")
        if isinstance(self.warm_start_steps, bool) or not isinstance(self.warm_start_steps, int) or self.warm_start_steps < 0:
            raise ValueError(f"task.warm_start_steps={self.warm_start_steps!r} must be an int >= 0 (0 = accuracy window)")
        if len(self.warm_start_accuracy) != 2 or not 0 <= self.warm_start_accuracy[0] <= self.warm_start_accuracy[1] <= 1:
            raise ValueError(f"task.warm_start_accuracy={self.warm_start_accuracy} must be [low, high] in [0, 1]")

    @classmethod
    def from_omegaconf(cls, node: DictConfig | dict) -> "TaskConfig":
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        return cls(**data)


class Task:
    """Prompts, scoring and evaluation of one task. ``items`` are dicts with ``prompt`` (text fed
    to the model) and ``answer``."""

    def __init__(self, config: TaskConfig, seed: int):
        self.config, self.seed = config, seed
        if config.name == "toy_addition":
            from verl_ext.data.toy import make_problems

            eval_problems = make_problems(config.eval_size, config.digits, seed=10**6 + seed,
                                          answer_format=config.answer_format)  # fmt: skip
            self.eval_items = [{"prompt": p["problem"], "answer": p["answer"]} for p in eval_problems]
            self._train_pool = None
        else:
            from verl_ext.data.datasets import load_benchmark
            from verl_ext.data.templates import render_prompt

            def items(name, path, limit=None):
                rows = load_benchmark(name, path=path or None, limit=limit)
                return [{"prompt": render_prompt(r["problem"], config.template), "answer": r["answer"]} for r in rows]

            self._train_pool = items(config.dataset, config.dataset_path)
            self.eval_items = items(config.eval_dataset, None, config.eval_size)

    @property
    def reward_range(self) -> tuple[float, float]:
        """Bounds of a valid reward; a group outside them is rejected on arrival. Both rewards
        score in [0, 1] (toy: exact match; math: accuracy with the default weights)."""
        return (0.0, 1.0)

    @property
    def eval_name(self) -> str:
        if self.config.name == "toy_addition":
            return "toy" if self.config.answer_format == "short" else "toy_scratch"
        return self.config.eval_dataset

    def train_items(self, n: int, stream: int, index: int) -> list[dict]:
        """``n`` training prompts for batch ``index`` of stream ``stream`` (a sampler): a pure
        function of (seed, stream, index), so replayed and resumed runs see the same prompts."""
        rng = np.random.default_rng([self.seed, stream, index])
        if self._train_pool is None:
            from verl_ext.data.toy import make_problem

            hi = 10**self.config.digits
            pairs = rng.integers(0, hi, size=(n, 2))
            return [dict(zip(("prompt", "answer"), make_problem(int(a), int(b), self.config.digits))) for a, b in pairs]
        picks = rng.choice(len(self._train_pool), size=n, replace=len(self._train_pool) < n)
        return [self._train_pool[i] for i in picks]

    @property
    def data_source(self) -> str:
        """The ``data_source`` of this task's rows, as verl's data files carry it (toy:
        ``toy_add<d>`` / ``toy_add<d>_scratch``, see ``verl_ext.data.toy.make_problems``; math:
        the dataset name): it picks the reward in :mod:`verl_ext.rewards.dispatch`."""
        if self.config.name == "toy_addition":
            suffix = "" if self.config.answer_format == "short" else "_scratch"
            return f"toy_add{self.config.digits}{suffix}"
        return self.config.eval_dataset

    def score(self, response: str, item: dict) -> float:
        """The reward of ``response`` to ``item``, through the reward dispatch both engines share."""
        from verl_ext.rewards.dispatch import compute_score

        return float(compute_score(self.data_source, response, item["answer"])["score"])

    def target_response(self, item: dict) -> str:
        """The correct response text for a toy item (the sum, or the scratchpad then the sum)."""
        if self.config.name != "toy_addition":
            raise ValueError("target_response is defined for the toy task only")
        if self.config.answer_format == "short":
            return item["answer"]
        from verl_ext.data.toy import scratchpad_response

        a, b = (int(x) for x in item["prompt"].rstrip("=").split("+"))
        return scratchpad_response(a, b, self.config.digits)

    def evaluate(self, model, tokenizer, max_new_tokens: int, seed: int = 0) -> dict[str, float]:
        """Held-out accuracy (one sample per prompt at ``eval_temperature``) as ``eval/<name>/acc``."""
        from recipe.gepo.local.policy import sample_groups

        was_training = model.training
        model.eval()
        try:
            correct, batch = 0.0, 128
            for start in range(0, len(self.eval_items), batch):
                chunk = self.eval_items[start : start + batch]
                out = sample_groups(
                    model, tokenizer, [it["prompt"] for it in chunk], 1, self.config.eval_temperature,
                    max_new_tokens, seed=seed + start,
                )  # fmt: skip
                correct += sum(self.score(text, it) for text, it in zip(out.texts, chunk))
        finally:
            model.train(was_training)
        acc = correct / len(self.eval_items)
        return {f"eval/{self.eval_name}/acc": acc, "eval/acc_mean": acc}


def resolve_model_path(model_path: str, task_config: TaskConfig, seed: int) -> str:
    """The model to train: ``model_path`` if given, else (toy task) the cached warm start."""
    from verl_ext.data.toy import resolve_task_model

    return resolve_task_model(model_path, task_config, seed)