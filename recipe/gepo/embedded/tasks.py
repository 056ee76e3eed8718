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

import numpy as np

from ..sections import TaskConfig


EVAL_PROBLEMS = "eval/n_problems"
"""How many problems each held-out evaluation scored (the width of its confidence band in curves.png)."""


class Task:
    """Prompts, scoring and evaluation of one task. ``items`` are dicts with ``prompt`` (text fed
    to the model) and ``answer``."""

    def __init__(self, config: TaskConfig, seed: int, tokenizer=None):
        """``tokenizer``: the model's, for the templates rendered by its own chat template
        (``task.template=chat`` / ``chat_1shot``; refused without one); the others ignore it."""
        self.config, self.seed = config, seed
        if config.name == "toy_addition":
            from verl_ext.data.toy.problems import make_problems

            eval_problems = make_problems(
                config.eval_size, config.digits, seed=10**6 + seed, answer_format=config.answer_format
            )
            self.eval_items = [{"prompt": p["problem"], "answer": p["answer"]} for p in eval_problems]
            self._train_pool = None
        else:
            from verl_ext.data.datasets import load_benchmark
            from verl_ext.data.templates import needs_tokenizer, render_prompt

            if needs_tokenizer(config.template) and tokenizer is None:
                raise ValueError(
                    f"task.template={config.template!r} renders with the model's own chat template: "
                    "the task needs the model's tokenizer"
                )
            own = tokenizer if needs_tokenizer(config.template) else None  # the others render without one

            def items(name, path, options, limit=None):
                rows = load_benchmark(name, path=path or None, limit=limit, **options)
                return [
                    {"prompt": render_prompt(r["problem"], config.template, own), "answer": r["answer"]} for r in rows
                ]

            self._train_pool = items(config.dataset, config.dataset_path, config.dataset_options)
            self.eval_items = items(config.eval_dataset, None, config.eval_dataset_options, config.eval_size)

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
            from verl_ext.data.toy.problems import make_problem

            hi = 10**self.config.digits
            pairs = rng.integers(0, hi, size=(n, 2))
            return [dict(zip(("prompt", "answer"), make_problem(int(a), int(b), self.config.digits))) for a, b in pairs]
        picks = rng.choice(len(self._train_pool), size=n, replace=len(self._train_pool) < n)
        return [self._train_pool[i] for i in picks]

    def answer_for(self, prompt: str) -> str | None:
        """The answer of a training prompt from the learner's own copy of the task (not from the
        sampler's record), or None when the task has no such prompt: what the learner recomputes a
        sampler's rewards against (``hetero.trust.check_rewards``)."""
        if self._train_pool is None:
            from verl_ext.data.toy.problems import make_problem, parse_problem

            operands = parse_problem(prompt, self.config.digits)
            return None if operands is None else make_problem(*operands, self.config.digits)[1]
        if not hasattr(self, "_answers"):
            self._answers = {item["prompt"]: item["answer"] for item in self._train_pool}
        return self._answers.get(prompt)

    @property
    def data_source(self) -> str:
        """The ``data_source`` of this task's rows, as verl's data files carry it (toy:
        ``toy_add<d>`` / ``toy_add<d>_scratch``, ``verl_ext.data.toy.problems.toy_data_source``; math:
        the dataset name): it picks the reward in :mod:`verl_ext.rewards.dispatch`."""
        if self.config.name == "toy_addition":
            from verl_ext.data.toy.problems import toy_data_source

            return toy_data_source(self.config.digits, self.config.answer_format)
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
        from verl_ext.data.toy.problems import parse_problem, scratchpad_response

        operands = parse_problem(item["prompt"], self.config.digits)
        if operands is None:
            raise ValueError(f"{item['prompt']!r} is not a {self.config.digits}-digit toy prompt")
        return scratchpad_response(*operands, self.config.digits)

    def evaluate(self, model, tokenizer, max_new_tokens: int, seed: int = 0) -> dict[str, float]:
        """Held-out accuracy (one sample per prompt at ``eval_temperature``) as ``eval/<name>/acc``."""
        from .policy import sample_groups

        was_training = model.training
        model.eval()
        try:
            correct, batch = 0.0, 128
            for start in range(0, len(self.eval_items), batch):
                chunk = self.eval_items[start : start + batch]
                out = sample_groups(
                    model,
                    tokenizer,
                    [it["prompt"] for it in chunk],
                    1,
                    self.config.eval_temperature,
                    max_new_tokens,
                    seed=seed + start,
                )
                correct += sum(self.score(text, it) for text, it in zip(out.texts, chunk))
        finally:
            model.train(was_training)
        acc = correct / len(self.eval_items)
        return {f"eval/{self.eval_name}/acc": acc, "eval/acc_mean": acc, EVAL_PROBLEMS: float(len(self.eval_items))}


def resolve_model_path(model_path: str, task_config: TaskConfig, seed: int) -> str:
    """The model to train: ``model_path`` if given, else (toy task) the cached warm start."""
    from verl_ext.data.task_model import resolve_task_model

    return resolve_task_model(model_path, task_config, seed)
