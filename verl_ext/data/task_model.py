"""The model a run trains when ``actor_rollout_ref.model.path`` does not name one: one rule for
both engines (the embedded engine's ``recipe.gepo.embedded.tasks.resolve_model_path`` and the verl
engine's ``resolve_task_files``), so they train the same cached folder.

- a given ``model_path``: that local HF folder;
- ``task.model`` (``smollm2-135m-instruct``): the built-in pretrained model's converted folder
  (:mod:`verl_ext.data.smollm2`);
- ``task.name=toy_addition``: the toy warm start (:mod:`verl_ext.data.toy.checkpoints`).
"""

from __future__ import annotations

from typing import Any

from verl_ext.data.toy.checkpoints import resolve_toy_model

__all__ = ["resolve_task_model"]


def resolve_task_model(model_path: str, task: Any, seed: int) -> str:
    """The model to train from ``model_path`` and a ``task:`` section (the typed ``TaskConfig`` or
    its DictConfig: both engines pass theirs). With no ``model_path`` and ``task.model`` set: that
    built-in model's cached HF folder under ``task.cache_dir``
    (:func:`verl_ext.data.smollm2.prepare_smollm2`); else :func:`resolve_toy_model`, the toy warm
    start of ``task.warm_start_steps`` steps (None/null = the answer format's default)."""
    builtin = str(getattr(task, "model", "") or "")
    if builtin and not model_path:
        from verl_ext.data.smollm2 import MODEL_NAME, prepare_smollm2

        if builtin != MODEL_NAME:
            raise ValueError(f"task.model={builtin!r}; expected '' or {MODEL_NAME!r}")
        return str(prepare_smollm2(str(task.cache_dir)))
    steps = getattr(task, "warm_start_steps", None)
    if model_path and steps is not None:  # the given model is trained as is: no warm start is made
        raise ValueError(
            f"task.warm_start_steps={steps!r} sets the toy warm start's steps, but "
            f"actor_rollout_ref.model.path={model_path!r} is given and trained as is: "
            "leave task.warm_start_steps null or the model path empty"
        )
    return resolve_toy_model(
        str(model_path or ""),
        str(task.name),
        cache_dir=str(task.cache_dir),
        digits=int(task.digits),
        seed=int(seed),
        answer_format=str(getattr(task, "answer_format", "short")),
        steps=steps,
    )
