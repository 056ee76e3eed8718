"""Learner side of the embedded engine: rollout groups -> one optimizer step.

The learner does not know which algorithm it runs: the whole objective (registered policy loss,
sampler-KL penalty, entropy bonus, KL-to-reference term, rollout correction, metrics) is
``verl_ext.algos.objective.compute_actor_loss``, the function the verl engine's worker calls too. The
learner supplies what the objective needs from the model: the log-probs, GEPO's group
denominators (over whole prompt groups, exact whatever the batch layout), the token entropies
when ``actor.entropy_coeff`` != 0, and a frozen reference model's log-probs when
``actor.use_kl_loss``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
from verl.utils.torch_functional import entropy_from_logits

from .model_placement import cpu_copy, model_device
from verl_ext.sampling import sequence_token_log_probs
from verl_ext.algos.diagnostics import sequence_sampler_learner_kl
from verl_ext.algos.importance import group_expectation_log_denominator, sequence_log_prob
from verl_ext.hetero.records import RolloutGroup
from verl_ext.algos.objective import RolloutCorrection, compute_actor_loss
from verl_ext.algos.config import loss_option


class NonFiniteStepError(RuntimeError):
    """Too many consecutive optimizer steps had a NaN/Inf loss or gradient."""


def collate_groups(groups: list[RolloutGroup], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Stack groups into one batch: prompts left-padded, responses right-padded, on the CPU (the
    learner moves it to its model's device in one go).

    Returns tensors with B = sum of group sizes: prompt_ids/prompt_mask [B, P], response_ids /
    response_mask / sampler_logprobs / advantages [B, R], rewards [B], group_index [B].
    """
    sizes = [g.group_size for g in groups]
    batch_size = sum(sizes)
    max_prompt = max(len(g.prompt_ids) for g in groups)
    max_resp = max(g.response_ids.shape[1] for g in groups)
    cpu = torch.device("cpu")
    prompt_ids = torch.full((batch_size, max_prompt), pad_token_id, dtype=torch.long, device=cpu)
    prompt_mask = torch.zeros((batch_size, max_prompt), dtype=torch.long, device=cpu)
    response_ids = torch.full((batch_size, max_resp), pad_token_id, dtype=torch.long, device=cpu)
    response_mask = torch.zeros((batch_size, max_resp), dtype=torch.long, device=cpu)
    sampler_logprobs = torch.zeros((batch_size, max_resp), dtype=torch.float32, device=cpu)
    advantages = torch.zeros((batch_size, max_resp), dtype=torch.float32, device=cpu)
    rewards = torch.zeros(batch_size, dtype=torch.float32, device=cpu)
    group_index = torch.zeros(batch_size, dtype=torch.long, device=cpu)
    row = 0
    for gi, group in enumerate(groups):
        t = group.as_torch()
        g, p, r = group.group_size, len(group.prompt_ids), group.response_ids.shape[1]
        rows = slice(row, row + g)
        prompt_ids[rows, max_prompt - p :] = t["prompt_ids"].long()
        # a sampler may ship its own prompt padding: honour its mask
        own_mask = group.prompt_mask
        prompt_mask[rows, max_prompt - p :] = 1 if own_mask is None else torch.as_tensor(own_mask, device=cpu).long()
        response_ids[rows, :r] = t["response_ids"].long()
        response_mask[rows, :r] = t["response_mask"].long()
        sampler_logprobs[rows, :r] = t["sampler_logprobs"].float()
        adv = t["advantages"].float()
        advantages[rows, :r] = adv.unsqueeze(-1).expand(-1, r) if adv.dim() == 1 else adv
        rewards[rows] = t["rewards"].float()
        group_index[rows] = gi
        row += g
    advantages = advantages * response_mask
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "sampler_logprobs": sampler_logprobs,
        "advantages": advantages,
        "rewards": rewards,
        "group_index": group_index,
    }


def group_divergence(
    log_p: torch.Tensor, log_q: torch.Tensor, mask: torch.Tensor, num_groups: int, group_index: torch.Tensor
) -> list[float]:
    """Per group, KL(sampler || learner) estimated exactly as the ``is/kl_sampler_learner`` metric
    estimates it over a batch (:func:`verl_ext.algos.diagnostics.sampler_learner_kl`: k3 per token,
    token-mean per sequence, mean over the group's sequences that have tokens; 0 for a group
    without tokens), so ``hetero.trust.max_divergence`` reads off that metric. One pass over the
    batch (it runs at every learner step).
    (B, T) x2, bool (B, T), (B,) group index -> [num_groups]."""
    seq_kl = sequence_sampler_learner_kl(log_p, log_q, mask).double()
    has_tokens = mask.bool().any(dim=-1).double()
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=seq_kl.device)
    total = zeros.clone().index_add_(0, group_index, seq_kl * has_tokens)
    count = zeros.index_add_(0, group_index, has_tokens)
    return (total / count.clamp(min=1)).tolist()


def log_probs_and_entropy(
    model,
    batch: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool,
    compute_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The learner's token log-probs [B, R] (with gradient) of ``batch`` (from :func:`collate_groups`,
    on the model's device) and, if ``with_entropy``, the entropies [B, R] of softmax(logits /
    temperature) at the same positions, from the same forward pass (verl's ``entropy_from_logits``,
    as verl's engine), both float32. ``compute_dtype``: the forward's autocast dtype (None: none)."""
    captured: dict[str, torch.Tensor] = {}
    hook = None
    if with_entropy:
        hook = model.register_forward_hook(lambda _m, _args, out: captured.__setitem__("logits", out.logits))
    try:
        log_prob = sequence_token_log_probs(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            temperature,
            compute_dtype,
        )
    finally:
        if hook is not None:
            hook.remove()
    if not with_entropy:
        return log_prob, None
    # logits at position t predict token t+1: the response is predicted by positions P-1 .. P+R-2
    prompt_len = batch["prompt_ids"].shape[1]
    response_logits = captured["logits"][:, prompt_len - 1 : -1].float() / temperature
    return log_prob, entropy_from_logits(response_logits)


class Learner:
    """Owns the trained model and its optimizer; ``train_step`` is one policy update.

    Args:
        model: the HF causal LM being trained (its parameters get updated in place).
        actor_config: verl ``ActorConfig`` (loss mode, aggregation, clip, optim, grad_clip,
            entropy_coeff, use_kl_loss / kl_loss_coef / kl_loss_type, loss_scale_factor).
        temperature: the sampling temperature (the learner's p uses the same softmax(logits / T)).
        pad_token_id: for collation.
        max_nonfinite_steps: consecutive skipped (NaN/Inf) steps after which the run stops loudly.
        rollout_correction: verl's decoupled truncated IS (``algorithm.rollout_correction``, parsed
            by :func:`verl_ext.algos.objective.rollout_correction_settings`), or None for none.
        compute_dtype: the autocast dtype of the learner's forward passes (``hetero.learner_precision``:
            bf16), or None (none). The weights, gradients and AdamW state keep the model's dtype
            (fp32 master weights); the log-softmax and the loss are fp32 either way.

    The learner runs where its model is (:mod:`recipe.gepo.embedded.model_placement` put it there): each
    step's batch is moved to the model's device; :meth:`state_dict` holds CPU copies.

    With ``actor.use_kl_loss`` the reference policy is a frozen copy of ``model`` as it is here,
    at construction (verl's reference is the initial model too): construct the learner from the
    initial weights and load a checkpoint afterwards (``load_state_dict``), as the drivers do; the
    reference is then the same on resume and is not stored in checkpoints.
    """

    def __init__(
        self,
        model,
        actor_config: Any,
        temperature: float,
        pad_token_id: int,
        max_nonfinite_steps: int = 5,
        rollout_correction: Optional[RolloutCorrection] = None,
        compute_dtype: Optional[torch.dtype] = None,
    ):
        if rollout_correction is not None and not isinstance(rollout_correction, RolloutCorrection):
            raise TypeError(
                f"rollout_correction must be a RolloutCorrection (verl_ext.algos.objective.rollout_correction_settings), "
                f"got {rollout_correction!r}"
            )
        self.model = model
        self.device = model_device(model)
        self.compute_dtype = compute_dtype
        self.actor_config = actor_config
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.max_nonfinite_steps = max_nonfinite_steps
        self.rollout_correction = rollout_correction
        optim = actor_config.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=float(optim.lr),
            betas=tuple(optim.get("betas", (0.9, 0.999))),
            weight_decay=float(optim.get("weight_decay", 0.01)),
        )
        self.grad_clip = float(actor_config.get("grad_clip", 1.0) or 0.0)
        self.with_entropy = float(actor_config.get("entropy_coeff", 0.0) or 0.0) != 0.0
        self.reference = None
        if bool(actor_config.get("use_kl_loss", False)):
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        # the whole batch is one micro-batch, so the only global normaliser verl's ppo_loss would set
        # that differs from the local one is the constant of seq-mean-token-sum-norm
        scale = actor_config.get("loss_scale_factor", None)
        info = actor_config.get("global_batch_info", None)
        if scale is not None and isinstance(info, dict):
            info["loss_scale_factor"] = scale
        self.version = 0  # optimizer steps taken = the policy version of the current weights
        self.group_divergence: list[float] = []  # of the last loss() call, one per group
        self.nonfinite_skipped = 0
        self._consecutive_nonfinite = 0

    def loss(self, groups: list[RolloutGroup]) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
        """The objective on ``groups`` for the current weights: (scalar loss with gradient,
        metrics, the collated batch)."""
        batch = {k: v.to(self.device) for k, v in collate_groups(groups, self.pad_token_id).items()}
        mask = batch["response_mask"].bool()
        reduction = loss_option(self.actor_config, "seq_reduction")
        seq_log_q = sequence_log_prob(batch["sampler_logprobs"], mask, reduction)
        group_log_denominator = group_expectation_log_denominator(seq_log_q, batch["group_index"])
        log_prob, entropy = log_probs_and_entropy(
            self.model, batch, self.temperature, self.with_entropy, self.compute_dtype
        )
        if entropy is not None:
            batch["entropy"] = entropy
        if self.reference is not None:
            with torch.no_grad():
                batch["ref_log_prob"] = sequence_token_log_probs(
                    self.reference,
                    batch["prompt_ids"],
                    batch["prompt_mask"],
                    batch["response_ids"],
                    batch["response_mask"],
                    self.temperature,
                    self.compute_dtype,
                )
        loss, metrics = self.policy_loss(log_prob, batch, group_log_denominator)
        self.group_divergence = group_divergence(
            log_prob.detach(), batch["sampler_logprobs"], mask, len(groups), batch["group_index"]
        )
        return loss, metrics, batch

    def train_step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One optimizer step on ``groups``. Returns ``actor/*``, ``is/*``, ``reward/*`` metrics.

        A step whose loss or gradient is not finite is skipped (weights untouched) and counted;
        ``max_nonfinite_steps`` in a row raise :class:`NonFiniteStepError`.
        """
        self.model.train()
        loss, metrics, batch = self.loss(groups)
        self.optimizer.zero_grad(set_to_none=True)
        finite = math.isfinite(loss.item())
        grad_norm = float("nan")
        if finite:
            loss.backward()
            params = [p for p in self.model.parameters() if p.grad is not None]
            max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.version += 1
            self._consecutive_nonfinite = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_skipped += 1
            self._consecutive_nonfinite += 1
            if self._consecutive_nonfinite >= self.max_nonfinite_steps:
                raise NonFiniteStepError(
                    f"{self._consecutive_nonfinite} consecutive steps had a non-finite loss or gradient "
                    f"(last loss={loss.item()}, grad_norm={grad_norm}); stopping instead of training on NaN"
                )
        lengths = batch["response_mask"].sum(dim=-1).float()
        metrics.update(
            {
                "actor/grad_norm": grad_norm,
                "actor/nonfinite_skipped": float(self.nonfinite_skipped),
                "reward/mean": batch["rewards"].mean().item(),
                "reward/std": batch["rewards"].std().item() if len(batch["rewards"]) > 1 else 0.0,
                "reward/min": batch["rewards"].min().item(),
                "reward/max": batch["rewards"].max().item(),
                "response_length/mean": lengths.mean().item(),
                "training/policy_version": float(self.version),
            }
        )
        return metrics

    def policy_loss(
        self, log_prob: torch.Tensor, batch: dict[str, torch.Tensor], group_log_denominator: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective of one step (:func:`verl_ext.algos.objective.compute_actor_loss`).

        Args: ``log_prob`` (B, T) learner log-probs with grad; ``batch`` from :func:`collate_groups`,
        plus ``entropy`` (B, T) and ``ref_log_prob`` (B, T) when those terms are on;
        ``group_log_denominator`` (B,) log E_q[q] of each sequence's group.
        """
        info = self.actor_config.get("global_batch_info", None)
        if self.rollout_correction is not None and self.rollout_correction.rollout_rs and isinstance(info, dict):
            # rejection sampling can empty whole sequences: verl's engine still divides the seq-mean
            # modes by the mini-batch's sequence count (its global_batch_size), so do the same
            info["global_batch_size"] = int(batch["response_mask"].shape[0])
        return compute_actor_loss(
            self.actor_config,
            log_prob,
            batch["sampler_logprobs"],
            batch["advantages"],
            batch["response_mask"].bool(),
            group_log_denominator=group_log_denominator,
            group_index=batch["group_index"],
            entropy=batch.get("entropy"),
            ref_log_prob=batch.get("ref_log_prob"),
            rollout_correction=self.rollout_correction,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            # CPU copies: a checkpoint written on a GPU loads on any machine
            "model": cpu_copy(dict(self.model.state_dict())),
            "optimizer": cpu_copy(self.optimizer.state_dict()),
            "version": self.version,
            "nonfinite_skipped": self.nonfinite_skipped,
            # the run of skipped steps goes on across a crash: max_nonfinite_steps counts them all
            "consecutive_nonfinite": self._consecutive_nonfinite,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (CPU tensors: copied to the model's device, AdamW's state
        moved to its parameters' device by torch)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.nonfinite_skipped = int(state["nonfinite_skipped"])
        self._consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))  # absent in older checkpoints
