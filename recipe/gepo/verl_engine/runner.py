"""``run(cfg)``: the verl engine's entry, called by ``recipe/gepo/main_gepo.py`` for ``hetero.engine=verl``.

Validation and the dry run happen here on any machine. Everything GPU-side (verl's trainer,
FSDP/Megatron workers, vLLM) is imported only after the GPU check, so a CPU machine gets a clear
message instead of verl's ResourcePoolManager / NCCL errors.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from recipe.gepo.verl_engine.plan import dry_run, engine_settings, render, validate


class NoGPUError(RuntimeError):
    """The verl engine was asked to train on a machine without GPUs."""


def require_gpus() -> int:
    """Number of visible CUDA GPUs; :class:`NoGPUError` if there are none."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 1:
        raise NoGPUError(
            "hetero.engine=verl trains with verl's FSDP/Megatron learners and vLLM samplers and needs "
            "GPUs; this machine has none. Use hetero.dry_run=true to validate the config and print the "
            "plan here, or hetero.engine=local for the embedded CPU engine. See docs/scale-out.md."
        )
    return n


def task_runner_class():
    """verl's v1 TaskRunner as a Ray actor whose process first imports the verl engine's trainer
    (registering ``hetero_separate_async`` in verl's trainer registry there) and then runs
    verl's own loop unchanged."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_actor_class__

    class HeteroTaskRunner(base):
        def run(self, config):
            import recipe.gepo.verl_engine.trainer  # noqa: F401  (registers the trainer)

            return super().run(config)

    return ray.remote(num_cpus=1)(HeteroTaskRunner)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate, then dry-run (``hetero.dry_run=true``: print the plan, return ``{"plan": text}``)
    or train on the Ray cluster (returns ``{}`` when verl's loop ends)."""
    validated = validate(cfg)
    if validated.hetero.dry_run:
        text = render(validated)
        print(text)
        return {"plan": text}
    require_gpus()
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    settings = engine_settings(cfg)
    auto_set_device(settings)
    run_ppo(settings, task_runner_class=task_runner_class())
    return {}


__all__ = ["NoGPUError", "dry_run", "require_gpus", "run", "task_runner_class"]
