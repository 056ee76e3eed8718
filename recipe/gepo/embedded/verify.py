"""The learner's checks of what a sampler claims about a group, and the gate every arriving
group passes on its way into the buffer: signatures, re-scored log-probs, recomputed rewards.

A group carries claims the learner would otherwise take on trust: the log-probs q it sampled with
(GEPO's denominator is built from them), the policy version those came from, its rewards and its
advantages. :class:`GroupVerifier` re-derives them on the learner:

- **log-probs**: the group's tokens re-scored under the weights of the version the group claims,
  exactly as the samplers received them (the weight store's message of that version: the wire
  dtype's rounding included; the learner keeps the messages of the ``max_delay + 1`` versions a
  group within the bound can claim, and decodes one only when a check needs it), compared with the reported
  q within the bounds of the precision the group declares (``sampler_precision``: the largest
  |Δ| a token, fp32's being ``hetero.trust.logprob_tolerance``, the mean |Δ| and the mismatch KL a
  token; bf16's measured on the run's own model when ``hetero.trust.bounds_file`` names a
  calibration, :mod:`recipe.gepo.calibrate`), and summed per sampler over its checked groups (:class:`~verl_ext.hetero.precision.MismatchCusum`,
  so a small lie repeated adds up; :mod:`verl_ext.hetero.precision`). This catches q that is scaled,
  shuffled, copied from another version or reported at another temperature, and a claimed version
  other than the one used. Cost: one forward pass of the group
  (~11 ms for G=8 x 16 tokens on the toy model, one core), paid for ``verify_fraction`` of groups.
- **tokens** (``checkable_sampling``): a re-scored group carries the seed of its Gumbel-max draw;
  the same forward's logits and that seed's noise re-derive which token each position had to
  take (:func:`verl_ext.hetero.gumbel.check_scores`), near ties within the declared precision's
  margin allowed (``token_mismatch`` otherwise: a sampler on other weights, at another temperature
  or truncating, even with q true to its tokens). Cost: the noise, V draws a token (SmolLM2 on
  the CPU: +9% on the re-score). A group without a seed is refused (``unseeded``, without blame).
- **rewards** (``check_rewards``): the responses decoded from their tokens and scored by the
  learner's own task against the learner's own copy of the prompt's answer (a prompt the task
  does not have fails: ``unknown_prompt``); the advantages recomputed from those rewards with
  verl's estimator when it is group-local (grpo / Dr.GRPO); BNPO normalises over the sampler's
  whole batch, so its advantages are checked up to that batch's scale (one positive multiple of
  the group's reward deviations, within BNPO's clamp: ``bnpo_group_mismatch``).

A check returns ``None`` (passed), or ``(reason, detail)``: reason one of ``bad_logprobs``,
``token_mismatch``, ``bad_rewards``, ``bad_advantages``, ``unknown_prompt``; the caller turns it into a rejection and a
failed check in the :class:`~verl_ext.hetero.trust.TrustLedger`.

:class:`TrustGate` is what async mode's inbox asks about every decoded, well-formed group
(:class:`~verl_ext.hetero.exchange.GroupGate`): the sampler's enrolment (signatures are checked by
the inbox against it), quarantine and the divergence bound, replays of accepted content under a
new uid (``replayed``), the verifier's checks, and the ledger's verdict, which may purge the
buffer.

A learner resumed after a crash republishes the version numbers its crashed predecessor had
already published after the checkpoint, with other weights; a sampler that loaded one of those
*lost* versions sends honest groups whose q matches no weights the learner has. Groups claiming a
lost version are therefore always re-scored and, when they do not match the new weights of that
number, refused as ``lost_version`` without counting against their sampler (they come from a
branch of the run that no longer exists; nothing a liar gains: the group does not get in).

No group is admitted unchecked in place of a check that is due. The learner lets the buffer accept
version v before it hands v's weights to the gate (it publishes them in between), so a group
claiming v can arrive first: the gate waits for v's weights (:attr:`TrustGate.VERSION_WAIT_S` at
most) and checks the group against them. A group whose check is due and whose version's weights
the learner does not hold (they did not come in time, or are from before a resume) is refused as
``unverifiable_version``, without blame: an honest sampler's group can be in that place too (one
already past the staleness bound is left to the buffer, which drops it unused).

Where the checks run: :meth:`TrustGate.admit` is the gate in one call (the books, then the
verifier's checks in the calling thread, then the verdict); tests and ``bench_trust detection``
use it so, and so does an async run's learner with ``hetero.trust.check_process=false``. By default
an async run's learner splits it: :meth:`TrustGate.begin` (refusals, the draw, replays: cheap, in
the learner's poll thread), the checks in a checker process on the system cores (:mod:`.checker`:
a :class:`GroupVerifier` of its own), and :meth:`TrustGate.finish` (the ledger, the CUSUM, quarantine) when the verdict is back.
A group awaiting its verdict is out of the buffer and counts against its sampler's quota, so the
rules above hold unchanged; one difference in timing: a copy of a group still awaiting its verdict
is refused as ``replayed`` at once (in the one-call gate the first copy has its verdict by then).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from .placement import Placement
from .policy import forward_logits, load_policy, sequence_token_log_probs
from .rollout import sequence_advantages
from .tasks import Task
from verl_ext.algos.advantages import bnpo_group_mismatch
from verl_ext.hetero.auth import Enrolment
from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.gumbel import TokenCheck, check_scores
from verl_ext.hetero.precision import (
    Mismatch,
    MismatchCusum,
    Tolerance,
    TrustBounds,
    group_mismatch,
    precision_of,
    precision_refusal,
    single_group_failure,
)
from verl_ext.hetero.records import RecordRejected, RolloutGroup
from verl_ext.hetero.staleness import is_stale
from verl_ext.hetero.weights import deserialize_state_dict
from verl_ext.sampling import token_log_probs

GROUP_LOCAL_ESTIMATORS = ("grpo",)
"""verl advantage estimators whose advantages depend on the group alone (recomputable per group)."""

REWARD_TOLERANCE = 1e-6
ADVANTAGE_TOLERANCE = 1e-4  # float32 arithmetic of the same estimator in another process


@dataclass
class CheckResult:
    """What :meth:`GroupVerifier.run` found for one group, wherever it ran (the learner's thread,
    or a checker process: :mod:`.checker`); :meth:`TrustGate.finish` turns it into a verdict.

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
    learner's handle to it in Ray's object store, :mod:`.checker`). Thread-safe: the learner's
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


class GroupVerifier:
    """Re-derives a group's claims on the learner (see module docstring).

    Args:
        model_path: the policy's HF folder (a second copy is loaded for re-scoring); None: no
            scorer, the rewards checked only (``tokenizer`` then gives the task's encoding).
        task: the learner's task (prompts' answers, the reward).
        temperature: the sampling temperature (q is softmax(logits / T)).
        algorithm_config: verl's ``algorithm`` config (the advantage estimator).
        keep_versions: versions held for re-scoring (``max_delay + 1``: every version a group
            inside the bound can claim).
        bounds: the bounds of the checks (``hetero.trust.logprob_tolerance``, ``bounds_file``:
            :meth:`TrustConfig.bounds <recipe.gepo.sections.TrustConfig.bounds>`).
        check_rewards: ``hetero.trust.check_rewards``.
        placement: the run's device and precisions: the re-scoring model is a sampler's (on
            ``hetero.device``, in ``hetero.sampler_precision``), since it recomputes a sampler's
            q; None: fp32 on the CPU.
        checkable_sampling: ``hetero.trust.checkable_sampling``: a re-scored group with a
            ``sampling_seed`` also has its tokens re-derived from the same forward's logits.
        tokenizer: with ``model_path`` None, the policy's tokenizer.
    """

    def __init__(
        self,
        model_path: Optional[str],
        task: Task,
        temperature: float,
        algorithm_config: Any,
        keep_versions: int,
        bounds: TrustBounds,
        check_rewards: bool,
        placement: Optional[Placement] = None,
        checkable_sampling: bool = False,
        tokenizer: Any = None,
    ):
        if model_path is None:
            if tokenizer is None:
                raise ValueError("GroupVerifier without a model (rewards only) needs the policy's tokenizer")
            self.scorer, self.tokenizer, self.scorer_precision = None, tokenizer, "fp32"
        else:
            if placement is not None:
                self.scorer, self.tokenizer = placement.load_sampler(model_path)
            else:
                self.scorer, self.tokenizer = load_policy(model_path)
            self.scorer.eval()
            self.scorer.config.use_cache = False  # one full forward per re-score: no KV cache to build
            self.scorer_precision = precision_of(self.scorer)
        self.task, self.temperature, self.algorithm_config = task, float(temperature), algorithm_config
        self.keep_versions = int(keep_versions)
        self.bounds, self.check_rewards = bounds, bool(check_rewards)
        self.checkable_sampling = bool(checkable_sampling)
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
            result.rewards_failure = self.check_group_rewards(group)
        if logprobs and (lost or result.rewards_failure is None):
            result.logprobs_failure, result.mismatch = self.measure_logprobs(group)
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

    def check_group_rewards(self, group: RolloutGroup) -> Optional[tuple[str, str]]:
        prompt = self._prompt_text(group)
        answer = None if prompt is None else self.task.answer_for(prompt)
        if answer is None:
            return "unknown_prompt", f"prompt {prompt!r} is not one of the task's training prompts"
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


def content_digest(group: RolloutGroup) -> str:
    """What makes a group the same group whatever its uid, row order or reported numbers: its
    prompt's tokens and the multiset of its responses' tokens (padding left out). The log-probs,
    rewards, version and row order are not part of it, so a copy with its rows rotated, its q
    nudged or another version claimed is still a copy. Two honest groups coincide only by drawing
    the very same G responses for the same prompt (a confident model on a short answer does; such
    a group's responses all score alike, so its group advantages carry little or nothing)."""
    h = hashlib.blake2b(digest_size=16)
    prompt = np.asarray(group.prompt_ids, np.int64)
    if group.prompt_mask is not None:
        prompt = prompt[np.asarray(group.prompt_mask).astype(bool)]
    h.update(len(prompt).to_bytes(4, "little") + np.ascontiguousarray(prompt).tobytes())
    mask = np.asarray(group.response_mask).astype(bool)
    rows = sorted(
        np.ascontiguousarray(np.asarray(ids, np.int64)[keep]).tobytes() for ids, keep in zip(group.response_ids, mask)
    )
    for row in rows:
        h.update(len(row).to_bytes(4, "little") + row)
    return h.hexdigest()


@dataclass
class Admission:
    """A group between :meth:`TrustGate.begin` and :meth:`TrustGate.finish`: what the gate decided
    before any check. ``rescore``: its q is re-scored (probation or the fraction's draw); ``lost``:
    it claims a version lost in a learner crash (re-scored whatever ``rescore`` says); ``replayed``:
    its content was seen before (only a lost version's group gets this far so: the re-score
    decides which refusal it gets); ``checks``: any check is configured (the rewards' included)."""

    group: RolloutGroup
    digest: str
    rescore: bool
    lost: bool
    replayed: bool
    checks: bool

    @property
    def version(self) -> int:
        return int(self.group.policy_version)

    @property
    def wants_weights(self) -> bool:
        """Its claimed version's weights are needed (a re-score is due)."""
        return self.rescore or self.lost


class TrustGate:
    """``hetero.trust`` on the learner: every decoded, well-formed group passes :meth:`admit`
    before it may enter the buffer (see the module docstring).

    Threads: the inbox's poller calls :meth:`admit` (or :meth:`begin` and :meth:`finish`) /
    :meth:`accepted`, the learner's thread :meth:`trained` / :meth:`remember` / :meth:`metrics`,
    Ray's control thread :meth:`enrol`; the books are behind one lock, the re-scoring runs outside it.

    ``local_checks``: build the :class:`GroupVerifier` here (a second model copy) for
    :meth:`admit`; False when the checks run elsewhere (:mod:`.checker`) and only
    :meth:`begin` / :meth:`finish` are used.
    """

    VERSION_WAIT_S = 30.0
    """How long :meth:`admit` waits for the weights of a version the buffer already accepts (the
    learner publishes them between the two): the time one weight publication takes, with room.
    Only a group claiming the newest version waits, and only in that gap."""

    def __init__(self, engine: Any, model_path: str, task: Task, buffer: RolloutBuffer, local_checks: bool = True):
        hetero, trust = engine.hetero, engine.hetero.trust
        self.config, self.buffer = trust, buffer
        self.enrolment = Enrolment() if trust.sign_records else None
        self._enrolment_stamp: Optional[tuple[float, int]] = None
        self.ledger = trust.ledger(hetero.seed)
        self._lock = threading.Lock()
        # content digest of every accepted group and every group passed over -> the sampler whose
        # passed check it earned ("" when none: unchecked, passed over, or its credit withdrawn)
        self._contents: dict[str, str] = {}
        self.passed_over_counts: Counter[str] = Counter()  # sampler -> groups dropped unchecked over its quota
        self.lost_versions: set[int] = set()  # version numbers a crashed learner published past its checkpoint
        self.check_cpu_s = 0.0  # CPU seconds of the verifier's checks, wherever they ran
        self.learner_check_cpu_s = 0.0  # ... of those, in this process (the learner's, in a run)
        self.token_counts: Counter[str] = Counter()  # the token check's counts, all checked groups
        self.version_wait_s = self.VERSION_WAIT_S
        self.cusum = MismatchCusum()  # per sampler: small lies in q, summed over its checked groups
        self.bounds = trust.bounds()  # the per-group bounds and the CUSUMs' (a calibration's, if given)
        self.checking = trust.verify_fraction > 0 or trust.check_rewards  # any check at all
        self.rescoring = trust.verify_fraction > 0
        # digest -> whether a copy arrived: groups between begin and finish (awaiting their verdict)
        self._awaiting: dict[str, bool] = {}
        self.verifier: Optional[GroupVerifier] = None
        if self.checking and local_checks:
            self.verifier = GroupVerifier(
                model_path,
                task,
                engine.settings.temperature,
                engine.algorithm,
                keep_versions=hetero.max_delay + 1,
                bounds=self.bounds,  # the same bounds the gate sums with
                check_rewards=trust.check_rewards,
                placement=Placement.of(hetero),
                checkable_sampling=trust.checkable_sampling,
            )

    # ---------------------------------------------------------------- enrolment
    def enrol(self, sampler_id: str, public_hex: Optional[str]) -> None:
        """Accept records signed by this key in this sampler's name (a sampler the learner launched)."""
        if self.enrolment is not None and public_hex is not None:
            self.enrolment.enrol(sampler_id, public_hex)

    def reload_enrolment(self) -> None:
        """``enrolment_file``: add its keys and revocations when the file has changed."""
        path = self.config.enrolment_file
        if self.enrolment is None or not path:
            return
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return
        stamp = (stat.st_mtime, stat.st_size)
        if stamp != self._enrolment_stamp:
            self.enrolment.update(Enrolment.load(path))
            self._enrolment_stamp = stamp

    # ---------------------------------------------------------------- the gate
    def lose_versions(self, versions) -> None:
        """Version numbers whose earlier weights are gone (see the module docstring)."""
        with self._lock:
            self.lost_versions |= {int(v) for v in versions}

    def remember(self, version: int, message: bytes) -> None:
        """A published version's message (the weight store's), for re-scoring groups that claim it."""
        if self.verifier is not None and self.rescoring:
            self.verifier.remember(version, message)

    def admit(self, group: RolloutGroup) -> bool:
        """Refuse (:class:`RecordRejected`, reason named) or let ``group`` through: True when a
        passed re-score vouched for it. Nothing of the group is remembered here: the caller hands
        the verdict to :meth:`accepted` once the buffer has taken the group (a group the buffer
        refuses leaves no trace, and its uid may be re-sent and judged afresh).

        The gate in one call: :meth:`begin`, the checks in this thread (waiting for a version the
        buffer already accepts, :attr:`version_wait_s` at most), :meth:`finish`."""
        if self.checking and self.verifier is None:
            raise RuntimeError("this gate's checks run elsewhere (local_checks=False): use begin() and finish()")
        admission = self.begin(group)
        result = CheckResult(held=False)
        if self.verifier is not None:
            if admission.wants_weights:
                # the buffer takes version v before the learner hands v's weights here: wait for them
                self.verifier.wait_for(admission.version, self.version_wait_s)
            result = self.verifier.run(
                group, rewards=admission.checks, logprobs=admission.wants_weights, lost=admission.lost
            )
        return self.finish(admission, result)

    def begin(self, group: RolloutGroup) -> Admission:
        """The gate's part before any check (cheap: the books only): refuse a quarantined or
        divergent sampler, an unknown precision, a missing seed, or a replay (without blame);
        draw whether q is re-scored. Returns what the checks must do for :meth:`finish`."""
        sampler, uid = str(group.sampler_id), group.group_uid
        version = int(group.policy_version)
        with self._lock:
            refusal = self.ledger.refusal(sampler)
            if refusal is not None:
                self.ledger.refused(refusal)
                raise RecordRejected("sampler_id", refusal, f"sampler is {refusal}", sampler_id=sampler, group_uid=uid)
            if self.checking and self.rescoring:
                # the tolerance of a re-score depends on it: refused on every group, checked or not
                unknown = precision_refusal(group.sampler_precision)
                if unknown is not None:
                    self.ledger.refused(unknown[0])
                    raise RecordRejected("sampler_precision", *unknown, sampler_id=sampler, group_uid=uid)
                seed = group.sampling_seed
                if self.config.checkable_sampling and (
                    not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
                ):
                    # the token check needs it: refused on every group, checked or not (no blame:
                    # a sampler not configured for it, not a lie shown)
                    self.ledger.refused("unseeded")
                    raise RecordRejected(
                        "sampling_seed",
                        "unseeded",
                        f"sampling_seed={seed!r}: "
                        "hetero.trust.checkable_sampling needs each group's Gumbel-max seed "
                        "(an integer) in its signed record",
                        sampler_id=sampler,
                        group_uid=uid,
                    )
            rescore = self.ledger.should_check(sampler) and self.rescoring
            digest = content_digest(group)
            if digest in self._awaiting:
                # a copy of a group still awaiting its verdict: the same tokens twice, as below;
                # the first earns no credit by its check
                self._awaiting[digest] = True
                replayed = True
            else:
                replayed = digest in self._contents
                if replayed and self._contents[digest]:
                    # the same tokens twice: one of the two copied, and which cannot be told (the
                    # first to arrive may be the copy). The credit the first earned by its check is
                    # withdrawn, so a copier that front-runs an honest sampler gains no trust by it;
                    # no blame
                    self.ledger.withdraw_credit(self._contents[digest])
                    self._contents[digest] = ""
            lost = self.checking and version in self.lost_versions
            if replayed and not lost:
                raise self._replayed(group)
            if not replayed:
                self._awaiting[digest] = False
        return Admission(group, digest, rescore=rescore, lost=lost, replayed=replayed, checks=self.checking)

    @staticmethod
    def _replayed(group: RolloutGroup) -> RecordRejected:
        # Old content under a new uid: refused, but without blame. Two honest samplers (or one,
        # twice) can draw the very same responses at the same version -- a confident model on
        # a short answer does -- and their log-probs are then identical too, so a coincidence
        # looks exactly like a replay; the refusal alone takes away all a replay could gain.
        return RecordRejected(
            "record",
            "replayed",
            "this group's content (its prompt and its responses' tokens, in any order) was received before",
            sampler_id=str(group.sampler_id),
            group_uid=group.group_uid,
        )

    def finish(self, admission: Admission, result: CheckResult) -> bool:
        """The verdict on a begun group from its checks' ``result`` (:meth:`GroupVerifier.run`,
        here or in a checker process): refuse it (:class:`RecordRejected`) or return whether a
        passed re-score vouched for it, as :meth:`admit` does. A sampler quarantined while the
        group awaited its verdict has it refused too."""
        group = admission.group
        sampler, uid, version = str(group.sampler_id), group.group_uid, admission.version
        credited = False
        try:
            with self._lock:
                self.check_cpu_s += result.cpu_s
                if result.pid == os.getpid():
                    self.learner_check_cpu_s += result.cpu_s
                self.token_counts.update(result.tokens)
                refusal = self.ledger.refusal(sampler)
                if refusal is not None:  # quarantined (or divergent) while this group was checked
                    self.ledger.refused(refusal)
                    raise RecordRejected(
                        "sampler_id", refusal, f"sampler is {refusal}", sampler_id=sampler, group_uid=uid
                    )
            if admission.lost:
                # made with the crashed learner's weights of that number, or with ours? Only a
                # re-score tells; a version we do not hold yet (or any more) cannot be told, so it
                # is refused too
                lost = (
                    result.logprobs_failure
                    if result.held
                    else ("lost_version", "the learner does not hold its own weights of that number to tell")
                )
                if lost is not None:  # not a lie either way: refused without blame
                    raise RecordRejected(
                        "policy_version",
                        "lost_version",
                        f"version {group.policy_version} was republished after a learner resume; {lost[1]}",
                        sampler_id=sampler,
                        group_uid=uid,
                    )
            if admission.replayed:
                raise self._replayed(group)
            rescore, failure, mismatch = admission.rescore, None, None
            if self.checking:
                if (
                    rescore
                    and not result.held
                    and is_stale(self.buffer.learner_version, version, self.buffer.max_delay)
                ):
                    rescore = False  # past the bound: the buffer drops it on arrival, no one trains on it
                if rescore and not result.held:
                    # a check is due and cannot be made (the weights did not come in time, or are
                    # gone: a version from before a resume): never admitted unchecked in its place;
                    # refused without blame, since an honest sampler's group can be in that place too
                    raise RecordRejected(
                        "policy_version",
                        "unverifiable_version",
                        f"a check is due and the learner does "
                        f"not hold version {version}'s weights (waited {self.version_wait_s:g} s)",
                        sampler_id=sampler,
                        group_uid=uid,
                    )
                failure = result.rewards_failure
                if failure is None and rescore:
                    failure, mismatch = result.logprobs_failure, result.mismatch
            with self._lock:
                if failure is None and mismatch is not None:
                    precision = str(group.sampler_precision)
                    checked = result.tokens.get("tokens_checked", 0)  # the token check's counts, if it ran
                    repeated = self.cusum.add(
                        sampler,
                        mismatch,
                        self.bounds.tolerance(result.scorer_precision, precision),
                        self.bounds.bounds_precision(result.scorer_precision, precision),
                        near_ties=(checked, result.tokens.get("token_near_ties", 0)) if checked else None,
                    )
                    if repeated is not None:
                        failure = ("bad_logprobs", repeated)
                if failure is None:
                    if rescore:
                        self.ledger.record(sampler, uid, passed=True)
                        credited = True
                    return rescore
                reason, detail = failure
                # a quarantine drops the sampler's unchecked groups still buffered (the buffer's lock
                # inside the gate's: the buffer never calls the gate); only those count as purged
                self.ledger.record(
                    sampler,
                    uid,
                    passed=False,
                    reason=reason,
                    detail=detail,
                    drop=lambda uids: self.buffer.purge(uids, "quarantined"),
                )
            raise RecordRejected("record", reason, detail, sampler_id=sampler, group_uid=uid)
        finally:
            if not admission.replayed:
                with self._lock:
                    if self._awaiting.pop(admission.digest, False):
                        # a copy arrived while this group awaited its verdict (and was refused as
                        # replayed): what its check earned is withdrawn, its content is known
                        if credited:
                            self.ledger.withdraw_credit(sampler)
                        self._contents[admission.digest] = ""

    def accepted(self, group: RolloutGroup, vouched: bool = False) -> None:
        """``group`` entered the buffer; ``vouched``: :meth:`admit`'s verdict on it (a group no
        check vouched for is purged if its sampler is quarantined before a check passes)."""
        with self._lock:
            digest = content_digest(group)
            # already known: a copy came while it awaited its verdict, and its credit was withdrawn
            self._contents[digest] = "" if digest in self._contents else (str(group.sampler_id) if vouched else "")
            if not vouched:
                self.ledger.accepted(str(group.sampler_id), group.group_uid)

    def passed_over(self, group: RolloutGroup) -> None:
        """A group the inbox dropped unchecked (over its sampler's quota): its content is known
        from now on, so a copy under another uid is refused as ``replayed`` (else a replaying
        sampler could pass off an honest group the learner never used as its own)."""
        with self._lock:
            self._contents.setdefault(content_digest(group), "")
            self.passed_over_counts[str(group.sampler_id)] += 1

    def trained(self, groups: list[RolloutGroup], divergence: list[float]) -> None:
        """After a step: each consumed group's measured divergence (the per-sampler bound)."""
        with self._lock:
            for group, value in zip(groups, divergence):
                self.ledger.observe_divergence(str(group.sampler_id), value)

    # ---------------------------------------------------------------- reporting
    def drain_events(self) -> list[dict]:
        with self._lock:
            return self.ledger.drain_events()

    def metrics(self) -> dict[str, float]:
        """The ledger's ``trust/*``, ``trust/<sampler id>/passed_over`` (its groups dropped unchecked
        over its quota: who floods), ``perf/trust_check_cpu_s_total`` (CPU seconds spent checking,
        wherever) and ``perf/trust_check_learner_cpu_s_total`` (the part in this process)."""
        with self._lock:
            passed = {f"trust/{sampler}/passed_over": float(n) for sampler, n in self.passed_over_counts.items()}
            cusum = {f"trust/{sampler}/mismatch_cusum": value for sampler, value in self.cusum.sums.items()}
            tokens = (
                {f"trust/{k}": float(v) for k, v in self.token_counts.items()}
                if self.rescoring and self.config.checkable_sampling
                else {}
            )
            return {
                **self.ledger.metrics(),
                **passed,
                **cusum,
                **tokens,
                "perf/trust_check_cpu_s_total": self.check_cpu_s,
                "perf/trust_check_learner_cpu_s_total": self.learner_check_cpu_s,
            }

    def state_dict(self) -> dict:
        with self._lock:
            return {
                "ledger": self.ledger.state_dict(),
                "contents": dict(sorted(self._contents.items())),
                "lost_versions": sorted(self.lost_versions),
                "passed_over": dict(self.passed_over_counts),
                "cusum": self.cusum.state_dict(),
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.ledger.load_state_dict(state["ledger"])
            contents = state["contents"]  # a list before checks earned credit per content
            self._contents = dict(contents) if isinstance(contents, dict) else dict.fromkeys(contents, "")
            self.lost_versions = set(state.get("lost_versions", []))
            self.passed_over_counts = Counter(state.get("passed_over", {}))
            self.cusum.load_state_dict(state.get("cusum", {}))
