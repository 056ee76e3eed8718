"""The verl engine's trainer: verl 0.9.1's v1 ``separate_async`` trainer plus HeteroRL.

Importing this module registers :class:`HeteroSeparateAsyncTrainer` in verl's v1 trainer registry as
``hetero_separate_async`` (``trainer.v1.trainer_mode``; needs verl's v1 trainer, which imports
TransferQueue). It adds, each on one of verl's extension points: q is the sampler's log-prob
(``verl_engine.old_log_prob=sampler``: ``rollout_log_probs`` copied into ``old_log_probs``, without
verl's bypass mode); GEPO's exact denominators over whole uid groups, computed on the driver after
``_compute_advantage`` and handed to the loss (:class:`HeteroActorWorker`,
:func:`verl_ext.algos.worker_loss.hetero_ppo_loss`); delayed parameter sync
(:class:`~recipe.gepo.verl_engine.delayed_sync.DelayedCheckpointManager`, ``hetero.delay``); the exact
staleness bound over weight versions (:class:`HeteroReplayBuffer`); the bypass guard, at construction
and before every update; roles pinned to nodes (:mod:`.node_placement`, ``placement.json``); the
embedded engine's metric names (``hetero/*``, ``is/*``, ``reward/mean``, :func:`embedded_eval_metrics`).
Runs on GPU clusters and, with the ``cpu_toy`` preset, on the CPU: docs/scale-out.md.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

from ..run_report import EVAL_MEAN
from ..sections import HeteroConfig, VerlEngineConfig
from . import batch_rules
from .batch_rules import hetero_step_metrics, stale_group_uids
from .delayed_sync import DelayedCheckpointManager, DelayedSyncSchedule
from verl_ext.algos.worker_loss import GROUP_LOG_DENOMINATOR, bridge_loss_fn
from .node_placement import pin_pools_to_node_roles
from .pool_ingress import INGRESS_NAME, STATE_FILE, BackgroundPublisher, ExchangePublisher, PoolIngress, IngressTeller
from .launch_plan import (
    TRAINER_NAME,
    check_loss_mode_unchanged,
    check_no_forced_bypass,
    delay_unit,
    requested_loss_mode,
)
from verl_ext.verl_fixes import fix_separate_async_logger
from verl_ext.rundir import (
    METRICS_FILE,
    MetricsWriter,
    node_identity,
    set_aside_metrics,
    truncate_metrics,
    write_placement,
    write_text_atomically,
)
from verl_ext.algos.config import loss_option

fix_separate_async_logger()  # verl 0.9.1's separate_async crashes at init otherwise (any device)


TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's: the checkpoint a resume starts from


class MetricsTee:
    """verl's ``Tracking`` plus ``<run dir>/metrics.jsonl`` in the embedded engine's format
    (one ``{"step": k, <name>: float, ...}`` line per log call), so report.md / curves.png and every
    script reading runs work on verl-engine runs too. The embedded engine's names are added by the
    trainer before verl logs (``reward/mean``, ``hetero/*``, ``is/*``; ``eval/acc_mean`` and
    ``eval/<benchmark>/acc`` beside verl's ``val-core/...``, :func:`embedded_eval_metrics`); verl's
    own names are kept.

    It also completes checkpoints (:meth:`commit_after`): verl saves step k's checkpoint before it
    logs step k's metrics, so a crash in between would resume after k with k's line never
    written. The trainer points verl's tracker back at the previous checkpoint while saving, and
    the tee points it at k once k's line is written."""

    CONSOLE = {
        "reward": "reward/mean",
        "stale": "hetero/staleness_mean",
        "acc": EVAL_MEAN,
        "step_s": "timing_s/step",
    }
    """What the console's progress bar shows of a step (verl's console backend prints ~150 metrics a
    step; every one is in metrics.jsonl and any other backend)."""

    def __init__(self, tracking: Any, run_dir: str | Path, total_steps: int | None = None):
        self.tracking = tracking
        self._writer = MetricsWriter(run_dir)
        self.path = self._writer.path
        self._pending: tuple[int, Path] | None = None
        self._bar, self._shown = None, {}
        backends = getattr(tracking, "logger", None)
        if isinstance(backends, dict) and backends.pop("console", None) is not None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps or None, desc="verl engine", unit="step")

    def commit_after(self, step: int, tracker: Path) -> None:
        """Write ``step`` into ``tracker`` once that step's metrics line is written."""
        self._pending = (step, tracker)

    def log(self, data: dict, step: int, *args: Any, **kwargs: Any) -> None:
        self._writer.write(data, step)
        if self._pending is not None and self._pending[0] == step:
            write_text_atomically(self._pending[1], str(step))
            self._pending = None
        self.tracking.log(data=data, step=step, *args, **kwargs)
        if self._bar is not None:
            self._shown.update({k: data[m] for k, m in self.CONSOLE.items() if isinstance(data.get(m), (int, float))})
            self._bar.update(max(0, step - self._bar.n))
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in self._shown.items()})
            if self._bar.total is not None and self._bar.n >= self._bar.total:
                self._bar.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tracking, name)


class HeteroActorWorker(DetachActorWorker):
    """verl's actor worker (with CPU weight snapshots) whose loss carries the group denominator,
    and which publishes weight versions to remote pools' exchange (:meth:`publish_weights`)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        if "actor" in self.role:
            self.loss_fn = bridge_loss_fn(self.loss_fn)
            self.actor.set_loss_fn(self.loss_fn)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def publish_weights(self, url: str, version: int, store_options: dict) -> None:
        """Every rank gathers the HF-named weights (FSDP/Megatron collectives, as verl's checkpoint
        engine does); rank 0 copies them to CPU and publishes ``version`` to the exchange at
        ``url`` in a background thread, in order (deltas need the previous version). A failed
        publish raises at the next call."""
        per_tensor, _ = self.actor.engine.get_per_tensor_param()
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        named = {}
        for name, tensor in per_tensor:  # every rank iterates: the gather is collective
            if rank0:
                named[name] = tensor.detach().to("cpu", copy=True)
        if not rank0:
            return
        publisher = getattr(self, "_publisher", None)
        if publisher is None:
            publisher = self._publisher = BackgroundPublisher(url, store_options, on_published=IngressTeller())
        publisher.submit(version, named)


class HeteroReplayBuffer(ReplayBufferAsync):
    """verl's async replay buffer that also evicts groups generated from weights more than
    ``hetero_max_delay`` versions older than the learner (see staleness.py), and lets delayed
    weight versions come due while the learner waits for samples (``on_idle``)."""

    hetero_max_delay: int = 0
    on_idle: Any = None

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        if self.on_idle is not None and partition_id != "val":
            self.on_idle()
        return super()._wait_for_next_poll(partition_id, last_debug_time)

    def _stale_terminal_keys(self, global_steps: int, partition_id: str) -> set[str]:
        stale = super()._stale_terminal_keys(global_steps, partition_id)
        if partition_id == "val":
            return stale
        by_version = stale_group_uids(
            self.partitions[partition_id], set(self.finished_keys[partition_id]), global_steps, self.hetero_max_delay
        )
        return stale | by_version


_VAL_CORE_MEAN = re.compile(r"^val-core/(?P<source>.+)/(?P<var>acc|reward)/mean@(?P<n>\d+)$")


def embedded_eval_metrics(val_metrics: Mapping[str, Any]) -> dict[str, float]:
    """The embedded engine's evaluation names for verl 0.9.1's validation metrics.

    verl (``_val_metrics_update`` over ``metric_utils.process_validation_metrics``) logs, per
    ``data_source``, ``val-core/<data_source>/acc/mean@<n>``: the fraction of correct samples (the
    reward's 0/1 ``acc``; failed sessions count 0) averaged per prompt over its n samples, then over
    prompts, with n = ``actor_rollout_ref.rollout.val_kwargs.n`` (verl names only that largest n
    ``val-core``). When the reward reports no ``acc``, verl's core variable is ``reward`` (the
    summed score) and that one is used. This mean@n is the embedded engine's ``eval/<name>/acc``
    (``Task.evaluate``: fraction of correct responses, one sample per prompt, i.e. mean@1) for
    n = 1 and its average over n samples per prompt (= pass@1, docs/evaluation.md) for n > 1;
    ``best@k`` / ``maj@k`` / ``std@n`` are not accuracies of a sample and are left out.

    Returns ``eval/<data_source>/acc`` for each data source and ``eval/acc_mean``, their unweighted
    mean (the one source's value when there is one, as in the embedded engine); ``{}`` when
    ``val_metrics`` holds no ``val-core/.../mean@n``.

    What is evaluated differs from the embedded engine: verl's validation generates on the
    sampler pool (``hybrid_engine=false``), i.e. with the weight version the samplers hold
    (``hetero/sampler_weight_version``, behind the learner under a delay), with verl's
    ``val_kwargs`` sampling settings (verl's default: greedy) instead of ``task.eval_temperature``."""
    found: dict[str, dict[str, tuple[int, float]]] = {}
    for key, value in val_metrics.items():
        m = _VAL_CORE_MEAN.match(key)
        if m is None:
            continue
        slot = found.setdefault(m["source"], {})
        n = int(m["n"])
        if m["var"] not in slot or n > slot[m["var"]][0]:
            slot[m["var"]] = (n, float(value))
    if not found:
        return {}
    out = {f"eval/{src}/acc": (v["acc"] if "acc" in v else v["reward"])[1] for src, v in sorted(found.items())}
    out[EVAL_MEAN] = sum(out.values()) / len(out)
    return out


def _strip_actor_prefix(worker_metrics: dict) -> dict:
    """verl prefixes every worker metric with ``actor/``; the project's ``is/*`` names stay as they are."""
    return {(k[len("actor/") :] if k.startswith("actor/is/") else k): v for k, v in worker_metrics.items()}


@register_trainer(TRAINER_NAME)
class HeteroSeparateAsyncTrainer(PPOTrainerSeparateAsync):
    """verl's separate_async trainer with GEPO denominators, delayed sync and the exact bound."""

    @property
    def logger(self):
        return self._hetero_logger

    @logger.setter
    def logger(self, tracking):  # verl's fit() assigns its Tracking here
        total = getattr(self, "total_training_steps", None) or self.config.trainer.total_training_steps
        self._hetero_logger = MetricsTee(tracking, self.config.trainer.default_local_dir, total)

    def __init__(self, config):
        check_no_forced_bypass(config)
        self.hetero = HeteroConfig.from_omegaconf(config.hetero)
        self.engine_config = VerlEngineConfig.from_config(config)
        self.pools = self.hetero.transport == "fs"  # remote sampler pools feed the training batches
        self._requested_loss_mode = requested_loss_mode(config)
        self._group_aware = bool(getattr(get_policy_loss_fn(self._requested_loss_mode), "accepts_group_info", False))
        if self.engine_config.node_resources:
            pin_pools_to_node_roles()  # before verl creates any resource pool
        super().__init__(config)
        self.sync_schedule = DelayedSyncSchedule(
            self.hetero.delay.build(),
            delay_unit(self.hetero),
            max_pending=self.hetero.keep_weight_versions,
            seed=self.hetero.seed,
        )

    # ---- staleness bound -------------------------------------------------------------------
    def _build_replay_buffer(self):
        buffer = super()._build_replay_buffer()
        if type(buffer) is not ReplayBufferAsync:
            raise ValueError(
                f"hetero.engine=verl bounds staleness in its own replay buffer; a custom sampler "
                f"({type(buffer).__name__}, trainer.v1.sampler.custom_sampler) is not supported"
            )
        # same object and state, one overridden method: the exact bound over weight versions
        buffer.__class__ = HeteroReplayBuffer
        buffer.hetero_max_delay = self.hetero.max_delay
        buffer.on_idle = self._while_waiting
        return buffer

    POOL_HEALTH_EVERY_S = 1.0
    """While the learner waits for samples, how often it asks the pool ingress whether to stop."""

    def _while_waiting(self) -> None:
        """Let delayed weight versions come due; with pools, stop (the ingress's error) once no pool
        group came for ``hetero.wait_timeout_s`` while prompts wait."""
        release = getattr(getattr(self, "standalone_checkpoint_manager", None), "release_due", None)
        if release is not None:  # a DelayedCheckpointManager, maybe inside an ExchangePublisher
            release()
        ingress = getattr(self, "pool_ingress", None)
        now = time.monotonic()
        if ingress is not None and now - getattr(self, "_pool_health_at", 0.0) >= self.POOL_HEALTH_EVERY_S:
            self._pool_health_at = now
            ray.get(ingress.health.remote())

    def fit(self, agent_loop_manager):
        """verl's loop; with pools, the exchange's stop marker is written when it ends (pools stop)."""
        try:
            return super().fit(agent_loop_manager)
        finally:
            if self.pools:
                from verl_ext.hetero.protocol import TransportSpec, request_stop

                url = self.hetero.exchange_url(self.config.trainer.default_local_dir)
                request_stop(TransportSpec("fsspec", url=url).open())

    # ---- checkpoints and resume ------------------------------------------------------------
    def _save_checkpoint(self):
        """verl's save; the tracker names this step only once its metrics line is written
        (:class:`MetricsTee`): until then a resume starts from the previous checkpoint."""
        run_dir = Path(self.config.trainer.default_local_dir)
        tracker = run_dir / TRACKER_FILE
        before = tracker.read_text().strip() if tracker.is_file() else None
        super()._save_checkpoint()
        if self.pools:  # the groups trained up to here leave the exchange only now
            folder = run_dir / f"global_step_{self.global_steps}"
            ray.get(self.pool_ingress.checkpoint.remote(str(folder)))
        tee = getattr(self, "_hetero_logger", None)
        if tee is None or not tracker.is_file() or tracker.read_text().strip() != str(self.global_steps):
            return  # no tee yet, or verl did not write the tracker (async save)
        previous_intact = before is not None and (run_dir / f"global_step_{before}").is_dir()
        if before is None:
            tracker.unlink()
        elif previous_intact:
            write_text_atomically(tracker, before)
        else:
            return  # the previous checkpoint was pruned (max_*_ckpt_to_keep): this one stands now
        tee.commit_after(self.global_steps, tracker)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        run_dir = Path(self.config.trainer.default_local_dir)
        if self.global_steps > 0:  # resumed: the steps after the checkpoint are trained (and logged) again
            truncate_metrics(run_dir / METRICS_FILE, self.global_steps)
        else:  # a fresh start in a used directory (or before any checkpoint): never append to old lines
            set_aside_metrics(run_dir)

    # ---- workers and delayed sync ----------------------------------------------------------
    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        for role in (Role.Actor, Role.ActorRolloutRef, Role.ActorRollout, Role.RefPolicy):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(HeteroActorWorker)

    def _setup(self):
        super()._setup()
        self.standalone_checkpoint_manager = DelayedCheckpointManager(
            self.standalone_checkpoint_manager, self.actor_rollout_wg, self.sync_schedule
        )
        if self.pools:  # every version also goes to the exchange, undelayed (pools delay their own)
            url = self.hetero.exchange_url(self.config.trainer.default_local_dir)
            self.standalone_checkpoint_manager = ExchangePublisher(
                self.standalone_checkpoint_manager, self.actor_rollout_wg, self.hetero, url
            )
        self._record_placement()

    def on_init_end(self):
        if self.pools:  # after verl's resume: a resumed run refuses the groups it trained before
            folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
            resumed = self.global_steps > 0 and (folder / STATE_FILE).is_file()
            self.pool_ingress = PoolIngress.options(name=INGRESS_NAME).remote(self.config)
            restored = ray.get(self.pool_ingress.start.remote(str(folder) if resumed else None, self.global_steps))
            print(
                f"[hetero] sampler pools: reading {self.hetero.exchange_url(self.config.trainer.default_local_dir)}"
                + (f" (resumed: {restored} trained groups refused if sent again)" if resumed else "")
            )
        super().on_init_end()

    def _record_placement(self) -> None:
        """Which node each learner rank and sampler server runs on (hostname, address): printed
        and kept in the run directory's placement.json -- on a cluster, where the roles landed."""
        servers = [s for replica in self.standalone_server_manager.get_replicas() for s in replica.servers]
        placement = {
            "learner": ray.get([w.__ray_call__.remote(node_identity) for w in self.actor_rollout_wg.workers]),
            "samplers": ray.get([s.__ray_call__.remote(node_identity) for s in servers]),
        }
        write_placement(self.config.trainer.default_local_dir, placement)
        for role, nodes in placement.items():
            hosts = sorted({f"{n['hostname']} ({n['ip']})" for n in nodes})
            print(f"[hetero] placement: {role}: {len(nodes)} process(es) on {', '.join(hosts)}")

    # ---- q = the sampler's log-probs -------------------------------------------------------
    def _compute_old_log_prob(self, batch, metrics):
        """q = vLLM's ``rollout_log_probs`` (``old_log_prob=sampler``), or verl's recomputation.
        Only the latter logs verl's ``training/rollout_actor_probs_pearson_corr`` and
        ``training/rollout_probs_diff_*`` (its ``calculate_debug_metrics``): they compare the
        learner's recomputed log-probs with the sampler's, and under ``sampler`` the learner
        computes none before its update (its forward pass is the loss's; ``is/kl_sampler_learner``
        compares the two there)."""
        if self.engine_config.old_log_prob == "recompute":
            return super()._compute_old_log_prob(batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_log_probs"])
        data["old_log_probs"] = data.pop("rollout_log_probs")
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data)
        return batch

    # ---- GEPO denominators over whole uid groups -------------------------------------------
    def _compute_advantage(self, batch, metrics):
        batch = super()._compute_advantage(batch, metrics)
        if not self._group_aware:
            return batch
        td = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "old_log_probs", "response_mask"]
        )
        padding = [bool(tag.get("is_padding", False)) for tag in batch.tags]
        reduction = loss_option(self.config.actor_rollout_ref.actor, "seq_reduction")
        den = batch_rules.from_tensordict(td, reduction, padding=padding)
        fields = TensorDict({GROUP_LOG_DENOMINATOR: den}, batch_size=len(batch))
        batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        metrics["is/group_log_denominator_mean"] = float(den.mean())
        return batch

    # ---- evaluation ------------------------------------------------------------------------
    def _validate(self):
        """verl's validation (before training, every ``test_freq`` steps, at the end) plus the
        embedded engine's ``eval/*`` names (:func:`embedded_eval_metrics`): both of verl's paths
        (the initial validation, logged on its own, and the in-loop one) go through here."""
        val_metrics = super()._validate()
        val_metrics.update(embedded_eval_metrics(val_metrics))
        return val_metrics

    # ---- guard + metric names --------------------------------------------------------------
    def _update_actor(self, batch, metrics):
        check_loss_mode_unchanged(self._requested_loss_mode, self.config.actor_rollout_ref.actor)
        worker_metrics: dict = {}
        batch = super()._update_actor(batch, worker_metrics)
        metrics.update(_strip_actor_prefix(worker_metrics))
        if self.pools:
            slots = sorted({key.split("_")[0] for key in batch.keys})
            ray.get(self.pool_ingress.mark_trained.remote(self.global_steps, slots))
        return batch

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        if "critic/score/mean" in metrics:  # the embedded engine's name for it (report.md, curves.png)
            metrics["reward/mean"] = metrics["critic/score/mean"]
            for bound in ("min", "max"):  # the reward band of curves.png stays inside them
                if f"critic/score/{bound}" in metrics:
                    metrics[f"reward/{bound}"] = metrics[f"critic/score/{bound}"]
        if self.pools:
            metrics.update(ray.get(self.pool_ingress.metrics.remote()))
        evicted = float(metrics.get("training/off_policy/evicted_samples", 0.0))
        metrics.update(
            hetero_step_metrics(list(batch.keys), list(batch.tags), global_steps, self.hetero.max_delay, evicted)
        )
