"""``run(cfg)``: the verl engine's entry, called by ``recipe/gepo/main_gepo.py`` for ``hetero.engine=verl``.

Validation and the dry run happen here on any machine. Everything GPU-side (verl's trainer,
FSDP/Megatron workers, vLLM) is imported only after the GPU check, so a CPU machine gets a clear
message instead of verl's ResourcePoolManager / NCCL errors.
"""

from __future__ import annotations

import importlib

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ..lifecycle import NOTHING_TO_TRAIN, finished_line, print_notes, run_directory
from .launch_plan import check_data_files, check_megatron_stack, engine_settings, is_hub_id, render, validate


class NoGPUError(RuntimeError):
    """The verl engine was asked to train on a machine without GPUs."""


def require_gpus(cfg: DictConfig | None = None) -> int:
    """Visible CUDA GPUs; 0 on a CPU machine whose config uses the CPU backend (``rollout.name=hf_cpu``,
    ``+verl_preset=cpu_toy``). :class:`NoGPUError` otherwise."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 1:
        return n
    rollout = None if cfg is None else cfg.actor_rollout_ref.rollout.get("name", None)
    if rollout == "hf_cpu":
        return 0
    raise NoGPUError(
        f"hetero.engine=verl with actor_rollout_ref.rollout.name={rollout!r} needs GPUs (vLLM/SGLang samplers); "
        "this machine has none. On a CPU machine use the CPU backend: --config-dir configs "
        "+verl_preset=cpu_toy (rollout.name=hf_cpu, FSDP2 over gloo); or hetero.dry_run=true to validate "
        "and print the plan; or hetero.engine=embedded for the embedded engine. See docs/scale-out.md."
    )


def resolve_task_files(cfg: DictConfig) -> DictConfig:
    """Fill ``actor_rollout_ref.model.path`` and ``data.train_files/val_files`` from the ``task:``
    section when they are empty (the toy task: the same warm start as the embedded engine; a math
    task: ``task.model``'s cached folder and the ``task.dataset`` / ``task.eval_dataset`` parquet
    pair; files written under ``task.cache_dir``); returns a copy."""
    from omegaconf import OmegaConf, open_dict

    from ..sections import TaskConfig
    from verl_ext.data.prepare import prepare_math_assets
    from verl_ext.data.task_model import resolve_task_model
    from verl_ext.data.toy_assets import prepare_toy_assets

    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    task = TaskConfig.from_omegaconf(cfg.task)
    given = str(cfg.actor_rollout_ref.model.path or "")
    if is_hub_id(given):
        if task.name == "toy_addition" and not cfg.data.get("train_files", None):
            raise ValueError(
                f"actor_rollout_ref.model.path={given!r} is a hub id, not a local folder: the toy "
                "task's data files are written with the model's tokenizer here, so give a local "
                "copy, or data.train_files / data.val_files"
            )
        model_path = given  # as verl's workers load it
    else:
        model_path = str(Path(resolve_task_model(given, task, int(cfg.hetero.seed))).resolve())
    with open_dict(out):
        out.actor_rollout_ref.model.path = model_path
        if task.name == "toy_addition" and not cfg.data.get("train_files", None):  # "" in the cpu_toy preset
            assets = prepare_toy_assets(
                Path(task.cache_dir) / "verl_toy",
                digits=task.digits,
                n_val=task.eval_size,
                seed=int(cfg.hetero.seed),
                model_path=model_path,
                answer_format=task.answer_format,  # scratchpad rows for the long-answer task
            )
            out.data.train_files = str(assets.train_file)
            out.data.val_files = str(assets.val_file)
        if task.name == "math" and not cfg.data.get("train_files", None):
            assets = prepare_math_assets(
                Path(task.cache_dir) / "verl_math",
                dataset=task.dataset,
                dataset_options=task.dataset_options,
                dataset_path=task.dataset_path,
                eval_dataset=task.eval_dataset,
                eval_dataset_options=task.eval_dataset_options,
                eval_size=task.eval_size,
                template=task.template,
            )
            out.data.train_files = str(assets.train_file.resolve())
            out.data.val_files = str(assets.val_file.resolve())
        out.trainer.default_local_dir = str(Path(str(cfg.trainer.default_local_dir)).resolve())
    return out


def task_runner_class():
    """verl's v1 TaskRunner as a Ray actor whose process first imports the verl engine's trainer
    (registering ``hetero_separate_async`` in verl's trainer registry there) and then runs
    verl's own loop unchanged."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_actor_class__

    trainer_module = f"{__package__}.trainer"  # this recipe's own trainer, also in a copied recipe

    class HeteroTaskRunner(base):
        def run(self, config):
            importlib.import_module(trainer_module)  # registers the trainer in this process
            return super().run(config)

    return ray.remote(num_cpus=1)(HeteroTaskRunner)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Validate, then dry-run (``hetero.dry_run=true``: print the plan, return ``{"plan": text}``)
    or train on the Ray cluster (returns ``{"run_dir": ...}`` when verl's loop ends)."""
    validated = validate(cfg)
    print_notes(validated.notes)
    if validated.hetero.dry_run:
        text = render(validated)
        print(text)
        return {"plan": text}
    require_gpus(cfg)
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
    from verl.utils.device import auto_set_device

    settings = engine_settings(resolve_task_files(cfg), ray_address=os.environ.get("RAY_ADDRESS"))
    check_data_files(settings)
    check_megatron_stack(settings)
    auto_set_device(settings)
    run_dir = Path(str(settings.trainer.default_local_dir))
    # verl resumes the directory's checkpoint by itself: the same run only
    resuming = (
        str(settings.trainer.resume_mode) == "auto" and Path(get_checkpoint_tracker_filename(str(run_dir))).is_file()
    )
    total = settings.trainer.total_training_steps
    if resuming and total:  # a finished run: say so, instead of verl starting its workers to train nothing
        done = int(Path(get_checkpoint_tracker_filename(str(run_dir))).read_text().strip() or 0)
        if done >= int(total):
            print(finished_line(run_dir, done, int(total)))
            return {NOTHING_TO_TRAIN: done, "run_dir": str(run_dir)}
    with run_directory(run_dir, settings, validated.notes, resuming):
        run_ppo(settings, task_runner_class=task_runner_class())
    from ..export import export_at_end

    for line in export_at_end(run_dir, validated.hetero.export_hf, str(settings.actor_rollout_ref.actor.strategy)):
        print(line, flush=True)
    return {"run_dir": str(run_dir)}
