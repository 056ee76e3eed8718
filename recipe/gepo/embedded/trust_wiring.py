"""The embedded engine's side of :mod:`verl_ext.trust`: the gate and verifiers built from its
validated configs, with a scorer loaded as its samplers load their model (:class:`.model_placement.Placement`:
the sampler's device and precision, since a re-score recomputes a sampler's q)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from .model_placement import Placement
from .tasks import Task
from verl_ext.trust import build_gate, build_verifier
from verl_ext.trust.assignment import prompt_stream


class AssignedTask:
    """The run's task as the rewards check reads it: a group's answer is that of the prompt its
    sampler was assigned for the slot it names (batch b of ``sampler-i`` is what
    :meth:`Task.train_items` gives stream i + 1), so no sampler picks which prompts it sends."""

    CACHED_BATCHES = 256
    """Batches whose prompts are kept (a sampler's groups of one batch arrive together)."""

    def __init__(self, task: Task, per_batch: int):
        self.task, self.per_batch = task, int(per_batch)
        self._batches: OrderedDict[tuple[int, int], list[dict]] = OrderedDict()

    def assigned_prompt(self, sampler_id: str, batch: int, slot: int) -> Optional[dict]:
        """The item (``prompt``, ``answer``) of slot ``slot`` of ``sampler_id``'s batch ``batch``, or
        None past a batch's prompts."""
        if not 0 <= slot < self.per_batch:
            return None
        key = (prompt_stream(sampler_id), int(batch))
        items = self._batches.get(key)
        if items is None:
            items = self._batches[key] = self.task.train_items(self.per_batch, stream=key[0], index=key[1])
            while len(self._batches) > self.CACHED_BATCHES:
                self._batches.popitem(last=False)
        return items[slot]

    def answer_for(self, prompt: str) -> Optional[str]:
        return self.task.answer_for(prompt)

    def score(self, response: str, item: dict) -> float:
        return self.task.score(response, item)


def embedded_verifier(engine: Any, model_path: Optional[str], task: Optional[Task], keep_versions: int, **kwargs):
    """A verifier with its own model copy from ``model_path`` (the task built on its tokenizer when
    ``task`` is None), or, with ``model_path`` None, rewards only (``tokenizer=`` required)."""
    hetero = engine.hetero
    scorer, tokenizer = None, kwargs.pop("tokenizer", None)
    if model_path is not None:
        scorer, tokenizer = Placement.of(hetero).load_sampler(model_path)
    if task is None:
        task = Task(engine.task, hetero.seed, tokenizer)
    return build_verifier(
        hetero.trust,
        tokenizer,
        AssignedTask(task, engine.settings.prompts_per_step),
        engine.settings.temperature,
        engine.algorithm,
        keep_versions=keep_versions,
        scorer=scorer,
        **kwargs,
    )


def embedded_gate(engine: Any, model_path: str, task: Task, buffer: Any, local_checks: bool = True):
    """The run's gate; ``local_checks``: its checks run in the caller's thread (a second model copy
    here), else elsewhere (:mod:`.checker`)."""
    hetero = engine.hetero
    trust = hetero.trust
    verifier = None
    if local_checks and (trust.verify_fraction > 0 or trust.check_rewards):
        verifier = embedded_verifier(engine, model_path, task, keep_versions=hetero.max_delay + 1)
    return build_gate(trust, buffer, verifier, precisions=accepted_precisions(engine))


def accepted_precisions(engine: Any) -> tuple[str, ...]:
    """The sampler precisions a run accepts: its ``hetero.sampler_precision`` and those its
    ``hetero.trust.bounds_file`` calibrated. A sampler cannot widen its bounds by what it declares."""
    calibrated = engine.hetero.trust.bounds().calibrated
    return tuple(sorted({engine.hetero.sampler_precision, *calibrated}))
