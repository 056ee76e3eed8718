"""The verl engine's side of tests/algos/test_engines_agree.py, run in its own process.

``python tests/algos/verl_fsdp_objective.py IN.pt OUT.pt`` (the repository on PYTHONPATH): a
single-rank gloo process group (what a verl worker process is), verl's real ``TrainingWorker``
with its FSDP2 ``language_model`` engine on the CPU, built from the project's config
(``gepo_trainer`` + ``+verl_preset=cpu_toy`` + an algorithm preset, through hydra, as
``main_gepo hetero.engine=verl`` builds it), the worker's loss swapped exactly as
``HeteroActorWorker.init_model`` does (``bridge_loss_fn``), the driver-side group denominators
from ``recipe.gepo.verl_engine.batch_rules``, and the batch laid out as verl's trainer hands it
to ``update_actor`` (``DataProto.to_tensordict`` + ``left_right_2_no_padding`` + the trainer's
and ``train_batch``'s non-tensor keys). One ``forward_backward_batch`` (what ``train_batch`` runs
before the optimizer step) per preset and micro-batch size; the loss, the gradient of every
parameter and the worker's metrics are saved to OUT.pt as
``{preset: {micro_batch_size: {"loss", "grads", "metrics"}}}``.

IN.pt: ``model_path``, ``presets`` (list), ``micro_batch_sizes`` (list), ``overrides`` (list of
hydra overrides), ``temperature``, ``uids`` (list [B]) and the padded [B, *] tensors
``prompts``, ``prompt_mask``, ``responses``, ``response_mask``, ``old_log_probs``,
``advantages``, ``ref_log_prob``; optionally ``corrected``, a list of runs
``{"key", "preset", "old_log_probs", "rollout_is_weights", "response_mask"}`` with those tensors replaced
(results under ``key``).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _single_rank_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
    )


@functools.cache
def compose(preset: str, model_path: str, overrides: tuple[str, ...]):
    """The config ``main_gepo hetero.engine=verl`` builds for a preset; once per preset (the
    rollout-corrected runs reuse their preset's: a compose costs ~0.4 s of CPU)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        return hydra_compose(
            config_name="gepo_trainer",
            overrides=[
                searchpath,
                "+verl_preset=cpu_toy",
                f"algorithm_preset={preset}",
                f"actor_rollout_ref.model.path={model_path}",
                *overrides,
            ],
        )


def run_forward_backward(worker, data) -> dict:
    """verl's ``forward_backward_batch`` (what ``train_batch`` runs before the optimizer step):
    the loss summed over micro-batches, every parameter's gradient, the metrics aggregated with
    each one's verl aggregation type."""
    import numpy as np
    from verl.utils.metric import Metric

    engine = worker.engine
    grads = {}
    with engine.train_mode():  # zeroes the gradients on exit: read them inside
        engine.optimizer_zero_grad()
        output = engine.forward_backward_batch(data, loss_function=worker.loss_fn, forward_only=False)
        for name, param in engine.module.named_parameters():
            if param.grad is None:  # a parameter the objective does not reach
                continue
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name] = grad.detach().clone()
    metrics = {}
    for key, value in output["metrics"].items():
        values = value if isinstance(value, list) else [value]
        if isinstance(values[0], Metric):
            merged = Metric(aggregation=values[0].aggregation)
            for v in values:
                merged.append(v)
            metrics[key] = float(merged.aggregate())
        else:
            metrics[key] = float(np.mean(values))
    metrics["micro_batches"] = len(output["loss"])
    return {"loss": float(sum(output["loss"])), "grads": grads, "metrics": metrics}


def main(in_path: str, out_path: str) -> None:
    _single_rank_env()
    import numpy as np
    import torch
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from recipe.gepo.verl_engine.batch_rules import group_log_denominator
    from verl_ext.algos.worker_loss import GROUP_LOG_DENOMINATOR, bridge_loss_fn

    inp = torch.load(in_path, weights_only=False)
    batch_size = inp["prompts"].shape[0]
    worker = None
    results = {}
    # one run per preset, plus the rollout-corrected runs: their own old_log_probs (the recomputed
    # proximal policy) and rollout_is_weights (computed by verl's driver-side helper)
    runs = [(preset, preset, {}) for preset in inp["presets"]]
    runs += [(run["key"], run["preset"], run) for run in inp.get("corrected", [])]
    for key, preset, replaced in runs:
        cfg = compose(preset, inp["model_path"], tuple(inp["overrides"]))
        actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        if worker is None:  # the engine does not depend on the preset: build it once
            model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
            actor_config.model_config = model_config
            training = TrainingWorkerConfig(
                model_type="language_model",
                model_config=model_config,
                engine_config=actor_config.engine,
                optimizer_config=actor_config.optim,
                checkpoint_config=actor_config.checkpoint,
            )
            # as ActorRolloutRefWorker.init_model assigns them
            training.engine_config.use_dynamic_bsz = cfg.actor_rollout_ref.actor.use_dynamic_bsz
            training.engine_config.micro_batch_size_per_gpu = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
            training.engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
            worker = TrainingWorker(config=training)
            worker.reset()
        # HeteroActorWorker.init_model: verl's partial(ppo_loss, config=actor_config), bridged
        worker.set_loss_fn(bridge_loss_fn(partial(ppo_loss, config=actor_config)))

        # the driver: the padded batch verl's trainer holds, the exact denominators over uid groups
        prompts, responses = inp["prompts"], inp["responses"]
        attention_mask = torch.cat([inp["prompt_mask"], inp["response_mask"]], dim=1).long()
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
            # rejection sampling removed tokens from the driver's response_mask (not from attention)
            "response_mask": replaced.get("response_mask", inp["response_mask"]).long(),
            "old_log_probs": replaced.get("old_log_probs", inp["old_log_probs"]),
            "advantages": inp["advantages"],
            "ref_log_prob": inp["ref_log_prob"],
        }
        if replaced.get("rollout_is_weights") is not None:
            tensors["rollout_is_weights"] = replaced["rollout_is_weights"]
        reduction = actor_config.policy_loss.get("seq_reduction", "mean")
        tensors[GROUP_LOG_DENOMINATOR] = group_log_denominator(
            tensors["old_log_probs"], inp["response_mask"], np.array(inp["uids"], dtype=object), reduction
        )
        data = DataProto.from_dict(tensors=tensors).to_tensordict()
        data = left_right_2_no_padding(data)  # ray_trainer._update_actor
        entropy = cfg.actor_rollout_ref.actor.calculate_entropy or cfg.actor_rollout_ref.actor.entropy_coeff != 0
        tu.assign_non_tensor(
            data,
            calculate_entropy=entropy,
            global_batch_size=batch_size,
            mini_batch_size=batch_size,
            temperature=inp["temperature"],
            use_remove_padding=worker.model_config.get("use_remove_padding", False),
            use_dynamic_bsz=worker.engine_config.use_dynamic_bsz,
            max_token_len_per_gpu=worker.engine_config.max_token_len_per_gpu,
            use_fused_kernels=worker.engine_config.use_fused_kernels,
        )
        results[key] = {}
        for micro_batch_size in inp["micro_batch_sizes"]:
            # train_batch's default for this key is engine_config.micro_batch_size_per_gpu
            # (actor.ppo_micro_batch_size_per_gpu); set per call to split the same batch differently
            micro = data.clone()
            tu.assign_non_tensor(micro, micro_batch_size_per_gpu=micro_batch_size)
            results[key][micro_batch_size] = run_forward_backward(worker, micro)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
