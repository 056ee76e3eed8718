"""Samplers that lie (``python -m research.soak --liars``): one Ray actor (:class:`LiarCrew`), a real
sampler of the run's config, that generates real groups under several identities (``sampler-<60 + i>``,
:func:`liar_id`), each lying one way (:data:`LIES`) on every group it sends; each insider lie is told again
by a patient liar (:data:`PATIENT_LIES`), honest through its probation first. The insiders (:data:`INSIDER_LIES`) hold keys the learner's operator enrolled
(``hetero.trust.enrolment_file``); the two outsiders (:data:`OUTSIDER_LIES`) sign with a key nobody
enrolled, or write unsigned records straight into the transport. The token lies (:data:`TOKEN_LIES`)
join only under ``hetero.trust.checkable_sampling`` (``--liars`` turns it on); a redraw that gives the
honest tokens back is no lie and is not sent. The lies themselves are :mod:`.lies`'s, shared with
the detection table of ``research/bench/bench_trust.py``; what became of them: docs/reliability.md.

The soak counts the lying groups that reached an optimizer step (``poisoned groups trained on``,
within each lie's bound: ``checks.poison_bound``) from the uids the crew reports (:meth:`LiarCrew.report`). Beside the crew,
:class:`HonestBf16Sampler` (``sampler-50``, uids ``s50-bf16-b<batch>-<i>``) is an honest sampler in
bf16 among the run's fp32 ones, enrolled like the crew: its groups count as honest.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from recipe.gepo.embedded.sampler import SamplerWorker
from recipe.gepo.embedded.policy import load_policy
from verl_ext.algos.advantages import sequence_advantages
from verl_ext.trust.verifier import group_log_probs
from . import lies
from verl_ext.trust.signing import Enrolment, SamplerKey, unverified_record
from verl_ext.hetero.exchange import send_group
from verl_ext.hetero.protocol import ROLLOUT_TOPIC
from verl_ext.hetero.records import RolloutGroup
from verl_ext.trust.assignment import assigned_seed

IMPATIENT_LIES = (
    "q_scaled",  # log q x 1.5
    "q_shuffled",  # log q permuted over the group's tokens
    # q re-computed under the oldest other version the weight store holds (held back until one exists)
    "q_other_version",
    # the newest published version claimed, older weights used (none newer: the next, a future_version)
    "claims_newer",
    "reward_flip",  # rewards 1 - r, with the advantages the estimator gives for them (self-consistent)
    "reward_inflate",  # every reward 1, likewise
    "replay",  # an honest sampler's group, read from the transport, sent again under a new uid
    "q_scaled_slightly",  # log q x SLIGHT_SCALE: within one group's bounds, left to the per-sampler CUSUM
    "q_temperature",  # the group's tokens (drawn at the run's temperature), q at LIE_TEMPERATURE_FACTOR of it
    # the tokens drawn again (the group's own Gumbel-max seed) by the crew's weights moved by
    # +-OTHER_WEIGHTS_STEP, or from the top-TRUNCATED_TOP_K tokens of each step; q true to them
    "other_weights",
    "truncated",
    "near_copy",  # an honest group >= NEAR_COPY_AGE_S old, rows rotated, one log q moved by 1e-5
    "version_bump",  # log q x 1.5, claiming a version the moment the learner publishes it
    "malformed",  # a response token id equal to the vocabulary size (no embedding row): it must not crash anything
)
PATIENT_PREFIX = "patient_"
PATIENT_LIES = tuple(PATIENT_PREFIX + kind for kind in IMPATIENT_LIES if kind != "malformed")
"""Each lie again, told by a liar honest for its first PATIENT_HONEST_GROUPS groups (past its probation)."""
INSIDER_LIES = IMPATIENT_LIES + PATIENT_LIES
PATIENT_HONEST_GROUPS = 6
"""A patient liar's honest groups before its first lie: past the default probation of 4 checked groups."""
TOKEN_LIES = ("other_weights", "truncated")
"""Lies only checkable sampling's token check can catch: the crew tells them only when it is on."""
SLIGHT_SCALE, LIE_TEMPERATURE_FACTOR, OTHER_WEIGHTS_STEP, TRUNCATED_TOP_K = 1.05, 0.95, 1e-3, 2
"""The sizes of ``q_scaled_slightly``, ``q_temperature``, ``other_weights`` and ``truncated``."""
NEAR_COPY_AGE_S = 5.0
"""``near_copy`` copies only an honest group the crew saw in the transport this long ago."""
VERSION_BUMP_WAIT_S = 3.0
"""``version_bump`` waits at most this long for the learner to publish a version (else sends nothing)."""
OUTSIDER_LIES = ("forged_signature", "unsigned")
"""A key nobody enrolled, claiming to be ``sampler-0``; no signature at all."""
LIES = INSIDER_LIES + OUTSIDER_LIES
FIRST_INDEX = 60


def lie_of(kind: str) -> str:
    """The lie a liar tells (a patient one's, once past its probation)."""
    return kind.removeprefix(PATIENT_PREFIX)


def liar_id(kind: str) -> str:
    return f"sampler-{FIRST_INDEX + LIES.index(kind)}"


def enrol_insiders(enrolment_file: Path, public_keys: dict[str, str]) -> None:
    """Enrol the insiders' public keys (kind -> hex) in ``enrolment_file``, as an operator would;
    the outsiders' keys are never enrolled."""
    enrolment = Enrolment.load(enrolment_file)
    for kind in INSIDER_LIES:
        enrolment.enrol(liar_id(kind), public_keys[kind])
    enrolment.save(enrolment_file)


class LiarCrew(SamplerWorker):
    """A sampler whose groups go out under the lying identities in turn (see module docstring)."""

    def __init__(self, engine: Any, model_path: str, spec: Any):
        super().__init__(FIRST_INDEX - 1, engine, model_path, spec, speed_factor=1.0, uid_namespace="liars")
        # keys made here, as every sampler makes its own; the forger's claims sampler-0's name
        self.keys = {
            kind: SamplerKey.generate("sampler-0" if kind == "forged_signature" else liar_id(kind)) for kind in LIES
        }
        checkable = engine.hetero.trust.checkable_sampling
        self.turn = itertools.cycle([kind for kind in LIES if checkable or lie_of(kind) not in TOKEN_LIES])
        self.lied: dict[str, str] = {}  # uid -> kind, every lying group sent
        self.honest_sent: dict[str, int] = {}  # patient liar -> honest groups sent before its lies
        self.identity_batches: dict[str, int] = {}  # lying identity -> its last batch index
        self._batch_kind = ""  # the lie of the batch being sent
        self.first_sent: dict[str, float] = {}  # kind -> wall time of its first group
        self.other, _ = load_policy(model_path)  # q_other_version's scorer
        self.other.eval()
        self.drawer, _ = load_policy(model_path)  # other_weights' and truncated's draws (hooks stay off self.model)
        self.drawer.eval()
        self.first_seen: dict[str, float] = {}  # near_copy: honest key -> when the crew first saw it
        self.bump_seen: Optional[int] = None  # version_bump: the newest version seen at its last turn
        self._halt = threading.Event()

    # the crew keeps lying across the learner's restarts until the soak halts it
    def stopped(self) -> bool:
        return self._halt.is_set()

    def halt(self) -> None:
        self._halt.set()

    def public_keys(self) -> dict[str, str]:
        return {kind: key.public_hex() for kind, key in self.keys.items()}

    def report(self) -> dict[str, Any]:
        return {"lied": dict(self.lied), "first_sent": dict(self.first_sent)}

    def generate_batch(self, batch_index: int) -> list[RolloutGroup]:
        """A batch of the next lying identity in turn, of the prompts and seeds the learner assigns
        that identity (its own batches, counted from 0): the lie, not the assignment, is what each
        identity's groups are refused for. Uids ``<id>-<lie>-liars-b<its batch>-<slot>``."""
        kind = self._batch_kind = next(self.turn)
        sampler_id = "sampler-0" if kind == "forged_signature" else liar_id(kind)
        batch = self.identity_batches[sampler_id] = self.identity_batches.get(sampler_id, -1) + 1
        return self.assigned_groups(
            sampler_id, batch, f"{sampler_id}-{kind.replace('_', '')}-liars-b{batch}", batch_index
        )

    def send(self, group: RolloutGroup) -> None:
        kind = self._batch_kind
        patient = kind in PATIENT_LIES and self.honest_sent.get(kind, 0) < PATIENT_HONEST_GROUPS
        if patient:
            self.honest_sent[kind] = self.honest_sent.get(kind, 0) + 1  # sent as drawn: not a lie
        elif not self._lie(lie_of(kind), group):
            return  # nothing to lie with yet: nothing sent
        elif group.sampling_seed is not None and self.gumbel_key is not None:
            # a lie about the version keeps its seed the one assigned for the version it claims (else
            # the assignment, not the re-score, would refuse it)
            group.sampling_seed = assigned_seed(
                self.gumbel_key, group.sampler_id, group.batch_index, group.batch_slot, group.policy_version
            )
        key = None if kind == "unsigned" else self.keys[kind]
        send_group(self.transport, group, key=key)
        if patient:
            return
        self.lied[group.group_uid] = kind
        self.first_sent.setdefault(kind, time.time())

    def _lie(self, kind: str, group: RolloutGroup) -> bool:
        mask = group.response_mask.astype(bool)
        if kind == "q_scaled":
            group.sampler_logprobs = group.sampler_logprobs * 1.5
        elif kind == "malformed":
            ids = group.response_ids.copy()
            ids[0, 0] = self.model.config.vocab_size  # one past the embedding's last row
            group.response_ids = ids
        elif kind == "q_shuffled":
            values = group.sampler_logprobs[mask]
            group.sampler_logprobs[mask] = values[np.random.default_rng(len(self.lied)).permutation(len(values))]
        elif kind == "q_other_version":
            return self._q_of_other_version(group)
        elif kind == "claims_newer":
            newest = self.published.latest_version()
            group.policy_version = (
                newest if newest is not None and newest > group.policy_version else group.policy_version + 1
            )
        elif kind in ("reward_flip", "reward_inflate"):
            rewards = 1.0 - group.rewards if kind == "reward_flip" else np.ones_like(group.rewards)
            if np.array_equal(rewards, group.rewards):
                return False  # every response already earned 1: "inflated" it is the truth, no lie to send
            self._set_rewards(group, rewards)
        elif kind == "replay":
            return self._replay(group)
        elif kind == "q_scaled_slightly":
            group.sampler_logprobs = lies.scaled_q(group, SLIGHT_SCALE).sampler_logprobs
        elif kind == "q_temperature":
            told = lies.q_at_temperature(group, self.model, self.settings.temperature * LIE_TEMPERATURE_FACTOR)
            group.sampler_logprobs = told.sampler_logprobs
        elif kind in TOKEN_LIES:
            return self._redraw(group, kind)
        elif kind == "near_copy":
            return self._near_copy(group)
        elif kind == "version_bump":
            return self._at_version_bump(group)
        elif kind in OUTSIDER_LIES:
            group.rewards = np.ones_like(group.rewards)  # what they send does not matter: it must not get in
        return True

    def _set_rewards(self, group: RolloutGroup, rewards: np.ndarray) -> None:
        group.rewards = np.asarray(rewards, np.float32)
        mask = torch.as_tensor(group.response_mask).long()
        group.advantages = sequence_advantages(
            torch.from_numpy(group.rewards), mask, [group.group_uid] * len(rewards), self.algorithm_config
        ).numpy()

    def _q_of_other_version(self, group: RolloutGroup) -> bool:
        others = [v for v in self.published.versions() if v != group.policy_version]
        if not others:
            return False
        try:
            self.other.load_state_dict(self.published.get(min(others)))
        except (KeyError, ValueError):
            return False  # pruned meanwhile
        q = group_log_probs(self.other, group, self.settings.temperature)
        group.sampler_logprobs = (q * group.response_mask).astype(np.float32)
        return True

    def _redraw(self, group: RolloutGroup, kind: str) -> bool:
        """``other_weights`` / ``truncated``: the group's tokens drawn again (its own seed), q true to
        them. False (nothing sent) when the redraw gives the honest tokens back: that group is no lie
        (on the toy model, +-1e-3 on every weight changes ~40% of groups, top-2 ~25%)."""
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        if kind == "other_weights":
            generator = torch.Generator().manual_seed(len(self.lied))
            for v in state.values():
                if v.is_floating_point():
                    v.add_(OTHER_WEIGHTS_STEP * torch.sign(torch.randn(v.shape, generator=generator)))
        self.drawer.load_state_dict(state)
        truncation = {"top_k": TRUNCATED_TOP_K} if kind == "truncated" else {"top_k": 0}
        with lies.truncated(self.drawer, **truncation):
            told = lies.redrawn(
                group,
                self.drawer,
                self.model,
                self.tokenizer,
                self.task.score,
                self.settings.temperature,
                self.settings.max_new_tokens,
                self.algorithm_config,
            )
        if np.array_equal(told.response_ids, group.response_ids) and np.array_equal(
            told.response_mask, group.response_mask
        ):
            return False
        for name in ("response_ids", "response_mask", "sampler_logprobs", "rewards", "advantages", "extra"):
            setattr(group, name, getattr(told, name))
        return True

    def _honest_keys(self) -> list[str]:
        return [k for k in self.transport.keys(ROLLOUT_TOPIC) if k.startswith("s") and k[1:2].isdigit()]

    def _near_copy(self, group: RolloutGroup) -> bool:
        now = time.time()
        keys = self._honest_keys()
        self.first_seen = {key: self.first_seen.get(key, now) for key in keys}  # (gone keys forgotten)
        for key in reversed(keys):
            if now - self.first_seen[key] < NEAR_COPY_AGE_S:
                continue
            try:
                original = RolloutGroup.from_bytes(unverified_record(self.transport.get(ROLLOUT_TOPIC, key)))
            except (KeyError, ValueError):
                continue
            copy = lies.near_copy(original, group.group_uid, group.sampler_id)
            for field in dataclasses.fields(RolloutGroup):
                if field.name not in ("group_uid", "sampler_id", "created_at"):
                    setattr(group, field.name, getattr(copy, field.name))
            return True
        return False

    def _at_version_bump(self, group: RolloutGroup) -> bool:
        """Wait for the learner to publish a version newer than the last one seen, claim it at once
        (before the learner's gate may hold its weights), with q x 1.5."""
        deadline = time.time() + VERSION_BUMP_WAIT_S
        seen = self.bump_seen if self.bump_seen is not None else self.published.latest_version()
        while time.time() < deadline and not self.stopped():
            newest = self.published.latest_version()
            if newest is not None and (seen is None or newest > seen):
                self.bump_seen = newest
                group.policy_version = newest
                group.sampler_logprobs = lies.scaled_q(group, 1.5).sampler_logprobs
                return True
            time.sleep(0.005)
        self.bump_seen = self.published.latest_version()
        return False

    def _replay(self, group: RolloutGroup) -> bool:
        honest = [k for k in self.transport.keys(ROLLOUT_TOPIC) if k.startswith("s") and k[1:2].isdigit()]
        for key in honest[-5:]:
            try:
                original = RolloutGroup.from_bytes(unverified_record(self.transport.get(ROLLOUT_TOPIC, key)))
            except (KeyError, ValueError):
                continue
            for name in (
                "prompt_ids",
                "prompt_mask",
                "response_ids",
                "response_mask",
                "sampler_logprobs",
                "rewards",
                "advantages",
                "policy_version",
            ):
                setattr(group, name, getattr(original, name))
            return True
        return False


class HonestBf16Sampler(SamplerWorker):
    """An honest sampler in bf16 among the run's samplers (module docstring): the engine's sampler
    with ``hetero.sampler_precision=bf16``; it keeps sampling across the learner's restarts until
    the soak halts it."""

    INDEX = 50

    def __init__(self, engine: Any, model_path: str, spec: Any):
        bf16 = dataclasses.replace(engine, hetero=dataclasses.replace(engine.hetero, sampler_precision="bf16"))
        # 2x slower than the reference: it runs the whole soak, never killed, and would outpace the others
        super().__init__(self.INDEX, bf16, model_path, spec, speed_factor=2.0, uid_namespace=f"s{self.INDEX}-bf16")
        self._halt = threading.Event()

    def stopped(self) -> bool:
        return self._halt.is_set()

    def halt(self) -> None:
        self._halt.set()

    def precision(self) -> str:
        return str(next(self.model.parameters()).dtype)


def start_honest_bf16(cfg, enrolment_file: Path) -> Any:
    """:class:`HonestBf16Sampler` as a Ray actor sampling for the run of ``cfg`` (Ray must be up),
    its key enrolled in ``enrolment_file``."""
    import ray

    from recipe.gepo.embedded.async_shared import transport_spec
    from recipe.gepo.embedded.engine_config import EngineConfig

    engine = EngineConfig.from_omegaconf(cfg)
    sampler = (
        ray.remote(num_cpus=0, max_restarts=0, max_concurrency=3)(HonestBf16Sampler)
        .options(name="soak-honest-bf16")
        .remote(engine, str(cfg.actor_rollout_ref.model.path), transport_spec(engine.hetero, engine.settings))
    )
    public = ray.get(sampler.public_key.remote(), timeout=300)
    if public is not None:
        enrolment = Enrolment.load(enrolment_file)
        enrolment.enrol(f"sampler-{HonestBf16Sampler.INDEX}", public)
        enrolment.save(enrolment_file)
    sampler.run.remote()
    return sampler


def start_crew(cfg, enrolment_file: Path) -> Optional[Any]:
    """The crew as a Ray actor generating for the run of ``cfg`` (Ray must be up); its keys enrolled."""
    import ray

    from recipe.gepo.embedded.async_shared import transport_spec
    from recipe.gepo.embedded.engine_config import EngineConfig

    engine = EngineConfig.from_omegaconf(cfg)
    crew = (
        ray.remote(num_cpus=0, max_restarts=0, max_concurrency=3)(LiarCrew)
        .options(name="soak-liar-crew")
        .remote(engine, str(cfg.actor_rollout_ref.model.path), transport_spec(engine.hetero, engine.settings))
    )
    enrol_insiders(enrolment_file, ray.get(crew.public_keys.remote(), timeout=300))
    crew.run.remote()
    return crew
