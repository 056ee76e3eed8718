"""verl's real actor workers on the CPU, driven directly (no trainer loop): the pieces the
data-parallel and engine-agreement tests share.

- :func:`compose` -- gepo_trainer.yaml + the ``cpu_toy`` preset (or another), as ``main_gepo`` composes it.
- :func:`actor_group` -- a ``RayWorkerGroup`` of the verl engine's ``HeteroActorWorker`` (verl's
  ``DetachActorWorker`` with the project's loss bridge), role ``actor``, on ``n`` logical GPUs:
  FSDP2 over gloo, one rank per Ray actor.
- :func:`sync_run` -- a learner behind verl's real checkpoint manager (delayed or not) and an
  hf_cpu replica: the weight checksum the samplers hold after every push.
- :func:`verl_batch` -- the embedded engine's rollout groups laid out as verl's trainer hands them
  to ``update_actor`` (left/right padding, ``uid``, ``old_log_probs`` = the sampler's log-probs,
  token advantages, the driver-side ``group_log_denominator``), then
  :func:`update_actor` / :func:`log_probs` make the same calls and conversions as verl's
  ``ray_trainer`` (``left_right_2_no_padding``, the non-tensor meta keys).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.gepo.embedded.learner import collate_groups
from recipe.gepo.verl_engine import batch_rules
from verl_ext.algos.worker_loss import GROUP_LOG_DENOMINATOR
from verl_ext.hetero.records import RolloutGroup
from verl_ext.algos.config import loss_option

ROOT = Path(__file__).resolve().parents[2]


def compose(*overrides: str, preset: str = "cpu_toy") -> DictConfig:
    """The composed config of ``main_gepo --config-dir configs +verl_preset=<preset> <overrides>``."""
    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        return hydra_compose(config_name="gepo_trainer", overrides=[searchpath, f"+verl_preset={preset}", *overrides])


@contextmanager
def actor_group(cfg: DictConfig, n_ranks: int, name: str):
    """``n_ranks`` ranks of the verl engine's actor worker (FSDP2, or Megatron TP x PP x DP), models
    loaded (``init_model``); the workers and their placement group are released on exit (the
    logical GPUs are reused)."""
    import ray
    from ray.util import remove_placement_group
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from recipe.gepo.verl_engine.trainer import HeteroActorWorker

    pool = RayResourcePool(process_on_nodes=[n_ranks], use_gpu=True, name_prefix=name, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(HeteroActorWorker), config=cfg.actor_rollout_ref, role="actor")
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu", name_prefix=name)
    try:
        group.init_model()
        yield group
    finally:
        for worker in group.workers:
            ray.kill(worker)
        for pg in pool.pgs or []:
            remove_placement_group(pg)


def verl_batch(groups: list[RolloutGroup], pad_token_id: int, reduction: str):
    """verl ``DataProto`` [B = sum of group sizes] of ``groups``, with the per-sequence GEPO
    denominator computed over whole uid groups on the driver, as the verl engine's trainer does."""
    from verl import DataProto

    b = collate_groups(groups, pad_token_id)
    input_ids = torch.cat([b["prompt_ids"], b["response_ids"]], dim=1)
    attention_mask = torch.cat([b["prompt_mask"], b["response_mask"]], dim=1)
    uids = np.array([groups[int(i)].group_uid for i in b["group_index"]], dtype=object)
    data = DataProto.from_dict(
        tensors={
            "prompts": b["prompt_ids"],
            "responses": b["response_ids"],
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
            "response_mask": b["response_mask"],
            "old_log_probs": b["sampler_logprobs"],
            "rollout_log_probs": b["sampler_logprobs"],
            "advantages": b["advantages"],
        },
        non_tensors={"uid": uids},
    )
    data.batch[GROUP_LOG_DENOMINATOR] = batch_rules.group_log_denominator(
        b["sampler_logprobs"], b["response_mask"], uids, reduction
    )
    return data


def _tensordict(data, temperature: float):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, temperature=temperature)
    return td


def update_actor(group, cfg: DictConfig, data) -> dict[str, float]:
    """One ``update_actor`` call as verl's ``ray_trainer._update_actor`` makes it: the whole batch
    is one mini-batch (``ppo_epochs`` = 1, no shuffle). Returns verl's metrics, each reduced to a
    float (mean over micro-batches)."""
    from verl.utils import tensordict_utils as tu

    actor = cfg.actor_rollout_ref.actor
    td = _tensordict(data, float(cfg.actor_rollout_ref.rollout.temperature))
    tu.assign_non_tensor(
        td,
        calculate_entropy=bool(actor.entropy_coeff != 0.0),
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=len(data),
        mini_batch_size=len(data),
        epochs=1,
        seed=int(actor.data_loader_seed),
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    metrics = tu.get(group.update_actor(td), "metrics")
    return {k: float(np.mean([float(x) for x in (v if isinstance(v, list) else [v])])) for k, v in metrics.items()}


def log_probs(group, cfg: DictConfig, data) -> torch.Tensor:
    """The actor's current token log-probs [B, R] of the batch's responses (verl's
    ``compute_log_prob``), zero outside the response mask."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td = _tensordict(data, float(cfg.actor_rollout_ref.rollout.temperature))
    tu.assign_non_tensor(td, calculate_entropy=False, calculate_sum_pi_squared=False, compute_loss=False)
    out = group.compute_log_prob(td)
    lp = no_padding_2_padding(tu.get(out, "log_probs"), td).float()
    return lp * data.batch["response_mask"]


def sync_run(cfg: DictConfig, data, replicas, schedule, name: str, steps: int, n_ranks: int = 1):
    """``n_ranks`` actor ranks train ``steps`` - 1 updates on one batch behind a
    :class:`DelayedCheckpointManager` around verl's real ``CheckpointEngineManager`` (ray_mailbox)
    and hf_cpu replica; after each ``update_weights(step)``: the samplers' weight checksum and the
    learner's log-probs."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass

    from recipe.gepo.verl_engine.delayed_sync import DelayedCheckpointManager

    served, learner = [], []
    with actor_group(cfg, n_ranks, name) as group:
        inner = CheckpointEngineManager(
            config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine),
            actor_wg=group,
            replicas=replicas,
        )
        manager = DelayedCheckpointManager(inner, group, schedule)
        for step in range(steps):
            if step:
                update_actor(group, cfg, data)
            manager.update_weights(step)
            served.append(ray.get(replicas[0].servers[0].weight_checksum.remote()))
            learner.append(log_probs(group, cfg, data))
    return served, learner, manager


def reduction_of(cfg: DictConfig) -> str:
    from verl.utils.config import omega_conf_to_dataclass

    return loss_option(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), "seq_reduction")


def with_overrides(cfg: DictConfig, **values) -> DictConfig:
    """A copy of ``cfg`` with dotted ``key=value`` overrides."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(out):
        for key, value in values.items():
            OmegaConf.update(out, key, value, force_add=True)
    return out
