"""Re-deriving what a sampler claims about one group: :class:`GroupVerifier`.

- **rewards** (``check_rewards``): the responses decoded and scored by the caller's task against
  its own copy of the prompt's answer; group-local advantages (grpo, Dr.GRPO) recomputed with
  verl's estimator, BNPO's checked up to the batch's scale.
- **log-probs**: the tokens re-scored under the weights of the version the group claims (the
  weight store's message of that version, kept by :class:`KeptVersions`), compared with the
  reported q within the bounds of the declared precision (:mod:`verl_ext.trust.bounds`).
- **tokens** (``checkable_sampling``): each token re-derived from the same forward's logits and
  the group's Gumbel-max seed (:mod:`verl_ext.trust.gumbel`).

A check returns None (passed) or ``(reason, detail)``; :meth:`GroupVerifier.run` gathers them into
a :class:`CheckResult` for :meth:`~verl_ext.trust.gate.TrustGate.finish`. The caller supplies the
scoring model (an HF causal LM, loaded where it wants) and the task; no Ray, no engine import.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np
import torch

from verl_ext.algos.advantages import bnpo_group_mismatch, sequence_advantages
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.weights import deserialize_state_dict
from verl_ext.sampling import forward_logits, sequence_token_log_probs, token_log_probs
from verl_ext.trust.gumbel import TokenCheck, check_scores
from verl_ext.trust.bounds import (
    Mismatch,
    Tolerance,
    TrustBounds,
    group_mismatch,
    precision_of,
    precision_refusal,
    single_group_failure,
)

GROUP_LOCAL_ESTIMATORS = ("grpo",)
"""verl advantage estimators whose advantages depend on the group alone (recomputable per group)."""

REWARD_TOLERANCE = 1e-6
ADVANTAGE_TOLERANCE = 1e-4  # float32 arithmetic of the same estimator in another process


@dataclass
class CheckResult:
    """What :meth:`GroupVerifier.run` found for one group, wherever it ran (the learner's thread,
    or a checker process); :meth:`~verl_ext.trust.gate.TrustGate.finish` turns it into a verdict.

    ``rewards_failure`` / ``logprobs_failure``: ``(reason, detail)`` or None (passed, or not
    asked); ``mismatch``: the re-scored group's :class:`Mismatch` (None when not re-scored);
    ``held``: the claimed version's weights were at hand (False: not re-scored, and the gate
    decides: left to the buffer when stale, else refused); ``cpu_s``: the checks' CPU seconds
    (thread time, in ``pid``); ``tokens``: the token check's counts for this group;
    ``scorer_precision``: the re-scoring model's precision (whose bounds apply); ``fetch_s``: the
    wall seconds a checker process spent fetching the claimed version's weights for it (0 when it
    held them, and in the learner's thread)."""

    rewards_failure: Optional[tuple[str, str]] = None
    logprobs_failure: Optional[tuple[str, str]] = None
    mismatch: Optional[Mismatch] = None
    held: bool = True
    cpu_s: float = 0.0
    tokens: dict[str, int] = field(default_factory=dict)
    pid: int = 0
    scorer_precision: str = "fp32"
    fetch_s: float = 0.0


class KeptVersions:
    """The weights of the newest ``keep`` published versions, by version: the weight store's
    message (:meth:`WeightStore.publish` returns it; no copy), or whatever stands for it (the
    learner's handle to it in Ray's object store). Thread-safe: the learner's
    thread remembers, the gate's thread asks."""

    def __init__(self, keep: int):
        self.keep = int(keep)
        self.versions: OrderedDict[int, Any] = OrderedDict()
        self.newest: Optional[int] = None  # the newest version remembered
        self._remembered = threading.Condition(threading.Lock())

    def remember(self, version: int, weights: Any) -> None:
        with self._remembered:
            self.versions[int(version)] = weights
            self.newest = int(version) if self.newest is None else max(self.newest, int(version))
            while len(self.versions) > self.keep:
                self.versions.popitem(last=False)
            self._remembered.notify_all()

    def get(self, version: int) -> Any:
        """The version's weights, or None when not held."""
        with self._remembered:
            return self.versions.get(int(version))

    def holds(self, version: int) -> bool:
        with self._remembered:
            return int(version) in self.versions

    def may_come(self, version: int) -> bool:
        """Not held, and not older than the newest held: the learner may still publish it (a
        version older than the newest will not come: pruned, or from before a resume)."""
        version = int(version)
        with self._remembered:
            return version not in self.versions and (self.newest is None or self.newest < version)

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Whether ``version`` is held, waiting up to ``timeout_s`` for it while it may still come."""
        version = int(version)
        with self._remembered:
            self._remembered.wait_for(
                lambda: version in self.versions or (self.newest or -1) > version, timeout=timeout_s
            )
            return version in self.versions


def distinct_responses(group: RolloutGroup) -> tuple[np.ndarray, np.ndarray]:
    """(the row of each distinct response, its tokens and mask, at its first appearance: int64 [D];
    each of the group's rows' index among those: int64 [G]). A group's responses often coincide (a
    confident model, a short answer: 3 distinct of 8 on the toy), and a row's log-probs depend on
    its own tokens alone, so a re-score runs its forward on the D distinct rows and gives each row
    its copy's (the forward's cost grows with the rows: 4.0 against 6.0 ms at 3 of 8 on the toy)."""
    rows: dict[bytes, int] = {}
    firsts: list[int] = []
    row_of: list[int] = []
    for i, (tokens, keep) in enumerate(zip(np.asarray(group.response_ids), np.asarray(group.response_mask))):
        j = rows.setdefault(tokens.tobytes() + keep.tobytes(), len(rows))
        if j == len(firsts):
            firsts.append(i)
        row_of.append(j)
    return np.asarray(firsts, np.int64), np.asarray(row_of, np.int64)


@torch.no_grad()
def group_log_probs(model: torch.nn.Module, group: RolloutGroup, temperature: float) -> np.ndarray:
    """float32 (G, R): log-probs of the group's response tokens under ``model`` (one forward pass
    over its distinct responses, :func:`distinct_responses`; padding positions as the model gives
    them: mask them with ``group.response_mask``)."""
    firsts, row_of = distinct_responses(group)
    d = len(firsts)
    prompt_mask = group.prompt_mask if group.prompt_mask is not None else np.ones_like(group.prompt_ids)
    device = next(model.parameters()).device  # the group's tokens go where the scorer is

    def ids(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, device=device).long()

    logprobs = sequence_token_log_probs(
        model,
        ids(group.prompt_ids).expand(d, -1),
        ids(prompt_mask).expand(d, -1),
        ids(np.asarray(group.response_ids)[firsts]),
        ids(np.asarray(group.response_mask)[firsts]),
        temperature,
    )
    return logprobs.float().cpu().numpy()[row_of]


@torch.no_grad()
def group_scores(model: torch.nn.Module, group: RolloutGroup, temperature: float) -> tuple[np.ndarray, torch.Tensor]:
    """One forward pass: the log-probs :func:`group_log_probs` gives and the logits [G, R, V] they
    come from (those predicting each response token: the token check re-derives the tokens from them;
    the forward over the distinct responses, as :func:`group_log_probs`)."""
    firsts, row_of = distinct_responses(group)
    d = len(firsts)
    prompt_mask = group.prompt_mask if group.prompt_mask is not None else np.ones_like(group.prompt_ids)
    device = next(model.parameters()).device

    def ids(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, device=device).long()

    responses = ids(np.asarray(group.response_ids)[firsts])
    input_ids = torch.cat([ids(group.prompt_ids).expand(d, -1), responses], dim=1)
    attention_mask = torch.cat([ids(prompt_mask).expand(d, -1), ids(np.asarray(group.response_mask)[firsts])], dim=1)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # as sequence_token_log_probs
    logits = forward_logits(model, input_ids, attention_mask, position_ids)[:, len(group.prompt_ids) - 1 : -1]
    logprobs = token_log_probs(logits, responses, temperature).float().cpu().numpy()
    return logprobs[row_of], logits.index_select(0, torch.as_tensor(row_of, device=logits.device))


def _check_error(err: Exception) -> tuple[str, str]:
    """The failure of a check that raised: a record that makes a check raise fails it, and never
    stops the process that checks."""
    return "check_error", f"the check raised {type(err).__name__}: {str(err)[:300]}"


class RewardTask(Protocol):
    """What the rewards check needs of a task: the answer it holds for a prompt, and its reward.
    A task that also has ``assigned_prompt(sampler_id, batch, slot) -> item | None`` (the learner's
    copy of each sampler's batches) holds every group to the prompt of its slot instead."""

    def answer_for(self, prompt: str) -> Optional[str]: ...

    def score(self, response: str, item: dict) -> float: ...


class GroupVerifier:
    """Re-derives a group's claims (see the module docstring). Thread-safe: one re-score at a time.

    Args:
        scorer: the policy's architecture in the precision of the samplers it checks (its weights
            are overwritten per claimed version); None: rewards only.
        tokenizer: the policy's tokenizer (decodes responses for the rewards check; None without it).
        task: the caller's task (:class:`RewardTask`): prompts' answers and the reward.
        temperature: the sampling temperature (q is softmax(logits / T)).
        algorithm_config: verl's ``algorithm`` config (the advantage estimator).
        keep_versions: versions held for re-scoring (``max_delay + 1``: every version a group
            inside the bound can claim).
        bounds: the bounds of the checks (:meth:`TrustConfig.bounds`).
        check_rewards: recompute rewards and advantages.
        checkable_sampling: a re-scored group with a ``sampling_seed`` also has its tokens checked.
    """

    def __init__(
        self,
        scorer: Optional[torch.nn.Module],
        tokenizer: Any,
        task: Optional[RewardTask],
        temperature: float,
        algorithm_config: Any,
        keep_versions: int,
        bounds: TrustBounds,
        check_rewards: bool,
        checkable_sampling: bool = False,
    ):
        if tokenizer is None and check_rewards:
            raise ValueError("GroupVerifier with check_rewards needs the policy's tokenizer (to decode responses)")
        self.scorer, self.tokenizer = scorer, tokenizer
        self.scorer_precision = "fp32"
        if scorer is not None:
            scorer.eval()
            if getattr(scorer, "config", None) is not None:
                scorer.config.use_cache = False  # one full forward per re-score: no KV cache to build
            self.scorer_precision = precision_of(scorer)
        self.task, self.temperature, self.algorithm_config = task, float(temperature), algorithm_config
        self.keep_versions = int(keep_versions)
        self.bounds, self.check_rewards = bounds, bool(check_rewards)
        self.checkable_sampling = bool(checkable_sampling)
        self.check_assignment = True  # a task's assigned prompts (off only in research benches: see TrustGate)
        self.token_counts: Counter[str] = Counter()  # tokens checked / near ties / mismatches, all groups
        estimator = algorithm_config.get("adv_estimator", "grpo")
        estimator = getattr(estimator, "value", estimator)
        self.check_advantages = estimator in GROUP_LOCAL_ESTIMATORS
        self.check_advantage_shape = estimator == "bnpo"  # batch-dependent: up to its scale
        self.kept = KeptVersions(self.keep_versions)  # version -> the weight store's message
        self._loaded: Optional[int] = None
        self._lock = threading.Lock()  # the scorer: one re-score at a time
        # (rewards, response mask) bytes -> the group-local estimator's advantages [G]: see _group_advantages
        self._advantages: dict[tuple[bytes, tuple[int, ...], bytes], np.ndarray] = {}
        # name -> the scorer's own tensor
        self._scorer_tensors = self.scorer.state_dict(keep_vars=True) if self.scorer is not None else {}

    def remember(self, version: int, message: bytes) -> None:
        """Keep a published version's message (:meth:`WeightStore.publish` returns it; no copy)."""
        self.kept.remember(version, message)

    def holds(self, version: int) -> bool:
        return self.kept.holds(version)

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Whether ``version`` is held, waiting up to ``timeout_s`` for it while it may still come:
        the learner lets the buffer accept version v before :meth:`remember` has v (it publishes
        v's weights in between), so a group claiming v can arrive first. A version older than the
        newest held is not waited for (it will not come: pruned, or before a resume)."""
        return self.kept.wait_for(version, timeout_s)

    def run(self, group: RolloutGroup, rewards: bool, logprobs: bool, lost: bool = False) -> CheckResult:
        """The checks due for one group, timed in CPU seconds of the calling thread: its rewards
        (``rewards`` and ``check_rewards``), and, when ``logprobs``, its q under the claimed
        version (skipped after a failed rewards check unless ``lost``: a lost version's group is
        judged by its re-score). ``held`` is False when the version is not held here."""
        t0 = time.thread_time()
        tokens_before = Counter(self.token_counts)
        result = CheckResult(pid=os.getpid(), scorer_precision=self.scorer_precision)
        if rewards and self.check_rewards:
            try:
                result.rewards_failure = self.check_group_rewards(group)
            except Exception as err:  # noqa: BLE001 - any bytes a sampler sends must be survivable
                result.rewards_failure = _check_error(err)
        if logprobs and (lost or result.rewards_failure is None):
            try:
                result.logprobs_failure, result.mismatch = self.measure_logprobs(group)
            except Exception as err:  # noqa: BLE001 - any bytes a sampler sends must be survivable
                result.logprobs_failure = _check_error(err)
            # (None, None) only when the version is not held: every re-score yields its mismatch
            # or a failure
            result.held = result.logprobs_failure is not None or result.mismatch is not None
        result.tokens = dict(self.token_counts - tokens_before)
        result.cpu_s = time.thread_time() - t0
        return result

    # ---------------------------------------------------------------- checks
    def check(self, group: RolloutGroup, logprobs: bool) -> Optional[tuple[str, str]]:
        """The group's rewards (when ``check_rewards``) and, when ``logprobs``, its q under the
        claimed version. None = passed (a version the verifier does not hold is not re-scored
        here: :meth:`TrustGate.admit` waits for it or refuses the group before asking)."""
        if self.check_rewards:
            failure = self.check_group_rewards(group)
            if failure is not None:
                return failure
        if logprobs:
            return self.check_logprobs(group)
        return None

    def _prompt_text(self, group: RolloutGroup) -> Optional[str]:
        """The prompt as the task wrote it, or None when its tokens are not the encoding of a text."""
        mask = group.prompt_mask if group.prompt_mask is not None else np.ones_like(group.prompt_ids)
        ids = [int(t) for t, keep in zip(group.prompt_ids, mask) if keep]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        bos = self.tokenizer.bos_token
        if bos and text.startswith(bos) and ids and ids[0] == self.tokenizer.bos_token_id:
            text = text[len(bos) :]
        return text if self.tokenizer(text)["input_ids"] == ids else None

    def _answer(self, group: RolloutGroup, prompt: Optional[str]) -> tuple[Optional[str], Optional[tuple[str, str]]]:
        """(the answer the group's rewards are scored against, or the failure that there is none):
        the assigned prompt's, when the task assigns them; else the answer of any training prompt."""
        assigned = getattr(self.task, "assigned_prompt", None) if self.check_assignment else None
        if assigned is None:
            answer = None if prompt is None else self.task.answer_for(prompt)
            if answer is None:
                return None, ("unknown_prompt", f"prompt {prompt!r} is not one of the task's training prompts")
            return answer, None
        if group.batch_index is None or group.batch_slot is None:
            return None, ("unassigned", "the record names no batch_index and batch_slot: its prompt was not assigned")
        item = assigned(str(group.sampler_id), int(group.batch_index), int(group.batch_slot))
        if item is None or prompt != item["prompt"]:
            wanted = "no prompt" if item is None else repr(item["prompt"])[:200]
            return None, (
                "prompt_not_assigned",
                f"prompt {str(prompt)[:200]!r} is not what slot {group.batch_slot} of batch {group.batch_index} "
                f"of {group.sampler_id} was assigned ({wanted})",
            )
        return item["answer"], None

    def check_group_rewards(self, group: RolloutGroup) -> Optional[tuple[str, str]]:
        prompt = self._prompt_text(group)
        answer, failure = self._answer(group, prompt)
        if failure is not None:
            return failure
        # host work (decoding, the group's advantages): on the CPU whatever torch's default device
        mask = torch.as_tensor(group.response_mask, device="cpu").long()
        responses = torch.where(
            mask.bool(),
            torch.as_tensor(group.response_ids, device="cpu"),
            torch.full_like(mask, self.tokenizer.pad_token_id),
        )
        # a group's responses often coincide (a confident model, a short answer): each distinct row of
        # tokens is decoded and scored once, and its reward given to every row that has it
        distinct: dict[tuple[int, ...], int] = {}  # a row's tokens -> its index among the distinct rows
        row_of = [distinct.setdefault(tuple(row), len(distinct)) for row in responses.tolist()]
        texts = self.tokenizer.batch_decode([list(row) for row in distinct], skip_special_tokens=True)
        scores = np.asarray([self.task.score(text, {"prompt": prompt, "answer": answer}) for text in texts], np.float32)
        rewards = scores[row_of]
        reported = np.asarray(group.rewards, np.float32)
        if reported.shape != rewards.shape or np.abs(reported - rewards).max() > REWARD_TOLERANCE:
            return "bad_rewards", f"reported {reported.tolist()}, recomputed {rewards.tolist()}"
        if not (self.check_advantages or self.check_advantage_shape):
            return None
        reported_adv = np.asarray(group.advantages, np.float32)
        if reported_adv.ndim == 2:  # per-token advantages: the sequence's mean, as the sampler's estimator gives
            reported_adv = (reported_adv * group.response_mask).sum(-1) / np.maximum(group.response_mask.sum(-1), 1)
        if self.check_advantage_shape:
            wrong = bnpo_group_mismatch(rewards, reported_adv, tolerance=ADVANTAGE_TOLERANCE)
            if wrong is not None:
                return "bad_advantages", f"{wrong}: rewards {rewards.tolist()}, advantages {reported_adv.tolist()}"
            return None
        advantages = self._group_advantages(rewards, mask, group.group_uid)
        if reported_adv.shape != advantages.shape or np.abs(reported_adv - advantages).max() > ADVANTAGE_TOLERANCE:
            return "bad_advantages", f"reported {reported_adv.tolist()}, recomputed {advantages.tolist()}"
        return None

    ADVANTAGE_CACHE_SIZE = 4096
    """Most (rewards, mask) pairs whose recomputed advantages :meth:`_group_advantages` keeps."""

    def _group_advantages(self, rewards: np.ndarray, mask: torch.Tensor, uid: str) -> np.ndarray:
        """float32 [G]: verl's group-local estimator (:func:`sequence_advantages`) on one group's
        ``rewards`` [G] and response ``mask`` [G, R], all rows under one uid. Its result depends on
        those inputs alone, and a run sees the same few again and again (the toy's 0/1 rewards over
        responses of one length), so it is kept by their exact bytes (the oldest of
        :attr:`ADVANTAGE_CACHE_SIZE` dropped first): verl's estimator costs more than the rest of
        the rewards check on the toy (0.44 ms a group, ``bench_trust components``)."""
        key = (rewards.tobytes(), tuple(mask.shape), mask.numpy().tobytes())
        advantages = self._advantages.get(key)
        if advantages is None:
            uids = [uid] * len(rewards)
            advantages = sequence_advantages(torch.from_numpy(rewards), mask, uids, self.algorithm_config).numpy()
            self._advantages[key] = advantages
            while len(self._advantages) > self.ADVANTAGE_CACHE_SIZE:
                self._advantages.pop(next(iter(self._advantages)), None)
        return advantages

    def rescore(self, group: RolloutGroup, with_logits: bool = False):
        """float32 (G, R): the group's token log-probs under the claimed version's weights, or None
        when that version is not held; ``with_logits``: (log-probs, logits) of :func:`group_scores`."""
        if self.scorer is None:
            raise RuntimeError("this GroupVerifier checks rewards only: it has no model to re-score with")
        with self._lock:
            if not self._load(int(group.policy_version)):
                return None
            with torch.inference_mode():  # the scorer is never trained: no autograd bookkeeping at all
                if with_logits:
                    return group_scores(self.scorer, group, self.temperature)
                return group_log_probs(self.scorer, group, self.temperature)

    def _load(self, version: int) -> bool:
        """The scorer holds ``version``'s weights (decoded from its message when it did not); False
        when the version is not held. Call with the lock held."""
        message = self.kept.get(version)
        if message is None:
            return False
        if self._loaded != version:
            _, weights = deserialize_state_dict(message)
            self._copy_weights(weights)
            self._loaded = version
        return True

    def _copy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The scorer's tensors overwritten in place with ``weights``: what ``load_state_dict``
        (strict) does when every name and shape matches, as a published version's do, without its
        walk over every module (half of loading a version on the toy, whose checks mostly need a
        version the scorer does not hold yet); anything else goes through ``load_state_dict``,
        which says what does not match."""
        tensors = self._scorer_tensors
        if weights.keys() != tensors.keys() or any(weights[k].shape != tensors[k].shape for k in tensors):
            self.scorer.load_state_dict(weights, strict=True)
            return
        with torch.no_grad():
            for name, tensor in weights.items():
                tensors[name].copy_(tensor)

    def bounds_precision(self, precision: str) -> str:
        """Whose bounds a sampler declaring ``precision`` gets from this verifier's scorer."""
        return self.bounds.bounds_precision(self.scorer_precision, precision)

    def tolerance(self, precision: str) -> Tolerance:
        """The bounds for a sampler declaring ``precision`` (:class:`TrustBounds`)."""
        return self.bounds.tolerance(self.scorer_precision, precision)

    def measure_logprobs(self, group: RolloutGroup) -> tuple[Optional[tuple[str, str]], Optional[Mismatch]]:
        """(failure or None, the group's :class:`Mismatch`): q re-scored under the claimed version
        against the per-group bounds of the precision the group declares. (None, None) when the
        version is not held."""
        check_tokens = self.checkable_sampling and group.sampling_seed is not None
        scored = self.rescore(group, with_logits=check_tokens)
        if scored is None:
            return None, None
        rescored, logits = scored if check_tokens else (scored, None)
        reported = np.asarray(group.sampler_logprobs, np.float32)
        if reported.shape != rescored.shape:
            return ("bad_logprobs", f"log-probs of shape {reported.shape}, responses {rescored.shape}"), None
        precision = group.sampler_precision
        refusal = precision_refusal(precision)
        if refusal is not None:
            return refusal, None
        mismatch = group_mismatch(reported, rescored, group.response_mask)
        over = single_group_failure(mismatch, self.tolerance(precision), self.bounds_precision(precision))
        if over is not None:
            return ("bad_logprobs", f"log q reported against re-scored under v{group.policy_version}: {over}"), mismatch
        if logits is not None:
            return self.token_failure(group, logits, precision), mismatch
        return None, mismatch

    def tie_margin(self, precision: str) -> float:
        """The near-tie margin of the token check for a sampler declaring ``precision``."""
        return self.bounds.tie_margin(self.scorer_precision, precision)

    def token_failure(self, group: RolloutGroup, logits: torch.Tensor, precision: str) -> Optional[tuple[str, str]]:
        """The token check (``checkable_sampling``): each token re-derived from ``logits`` and the
        noise of the group's seed, up to the precision's near-tie margin; a token further below
        the noised best fails the group (``token_mismatch``)."""
        margin = self.tie_margin(precision)
        found: TokenCheck = check_scores(
            logits, group.response_ids, group.response_mask, self.temperature, int(group.sampling_seed), margin
        )
        self.token_counts.update(
            tokens_checked=found.tokens, token_near_ties=found.near_ties, token_mismatches=found.mismatches
        )
        if found.mismatches == 0:
            return None
        return "token_mismatch", (
            f"{found.mismatches} of {found.tokens} tokens are not what seed "
            f"{group.sampling_seed}'s noise selects under v{group.policy_version} (worst "
            f"noised margin {found.worst_margin:.3g} > {margin:g}, {precision}'s near-tie "
            f"allowance)"
        )

    def check_logprobs(self, group: RolloutGroup) -> Optional[tuple[str, str]]:
        return self.measure_logprobs(group)[0]
