"""Samplers that lie (``scripts/soak.py --liars``): one Ray actor, a real sampler of the run's
config, that generates real groups and sends each under one of several identities, each identity
lying one way on every group it sends. The enrolled identities hold keys the learner's operator
enrolled (``hetero.trust.enrolment_file``): insiders turned bad. Two more are outsiders: one signs
with a key nobody enrolled in an enrolled sampler's name, one writes unsigned records straight
into the transport.

Lies (identity ``sampler-<60 + i>`` for the i-th kind):

- ``q_scaled``: the log-probs q times 1.5; ``q_shuffled``: q permuted over the group's tokens;
- ``q_other_version``: q re-computed under the oldest other version the weight store holds (the
  group is held back until a second version exists, so every group sent is a lie);
- ``claims_newer``: the newest published version claimed while the weights used are older (when
  none is newer: the next version, which the learner refuses as ``future_version``);
- ``reward_flip``: rewards 1 - r; ``reward_inflate``: every reward 1; both with the advantages the
  estimator gives for the lie, so the group is self-consistent;
- ``replay``: an honest sampler's group, read from the transport, sent again under a new uid;
- ``forged_signature`` (outsider): a key nobody enrolled, claiming to be ``sampler-0``;
- ``unsigned`` (outsider): no signature at all.

Every group an identity sends is a lie; the soak counts those that reached an optimizer step
(``poisoned groups trained on``, goal 0) from the uids the crew reports (:meth:`LiarCrew.report`).
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from recipe.gepo.embedded.sampler import SamplerWorker
from recipe.gepo.embedded.policy import load_policy
from recipe.gepo.embedded.rollout import sequence_advantages
from recipe.gepo.embedded.verify import group_log_probs
from verl_ext.hetero.auth import Enrolment, SamplerKey, unverified_record
from verl_ext.hetero.exchange import send_group
from verl_ext.hetero.protocol import ROLLOUT_TOPIC
from verl_ext.hetero.records import RolloutGroup

INSIDER_LIES = ("q_scaled", "q_shuffled", "q_other_version", "claims_newer", "reward_flip", "reward_inflate", "replay")
OUTSIDER_LIES = ("forged_signature", "unsigned")
LIES = INSIDER_LIES + OUTSIDER_LIES
FIRST_INDEX = 60


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
        self.turn = itertools.cycle(LIES)
        self.lied: dict[str, str] = {}  # uid -> kind, every group sent
        self.first_sent: dict[str, float] = {}  # kind -> wall time of its first group
        self.other, _ = load_policy(model_path)  # q_other_version's scorer
        self.other.eval()
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

    def send(self, group: RolloutGroup) -> None:
        kind = next(self.turn)
        sampler_id = "sampler-0" if kind == "forged_signature" else liar_id(kind)
        group.sampler_id, group.group_uid = sampler_id, f"{sampler_id}-{kind.replace('_', '')}-{group.group_uid}"
        if not self._lie(kind, group):
            return  # nothing to lie with yet: nothing sent
        key = None if kind == "unsigned" else self.keys[kind]
        send_group(self.transport, group, key=key)
        self.lied[group.group_uid] = kind
        self.first_sent.setdefault(kind, time.time())

    def _lie(self, kind: str, group: RolloutGroup) -> bool:
        mask = group.response_mask.astype(bool)
        if kind == "q_scaled":
            group.sampler_logprobs = group.sampler_logprobs * 1.5
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
            self._set_rewards(group, rewards)
        elif kind == "replay":
            return self._replay(group)
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


def start_crew(cfg, enrolment_file: Path) -> Optional[Any]:
    """The crew as a Ray actor generating for the run of ``cfg`` (Ray must be up); its keys enrolled."""
    import ray

    from recipe.gepo.embedded.async_shared import transport_spec
    from recipe.gepo.embedded.engine import EngineConfig

    engine = EngineConfig.from_omegaconf(cfg)
    crew = (
        ray.remote(num_cpus=0, max_restarts=0, max_concurrency=3)(LiarCrew)
        .options(name="soak-liar-crew")
        .remote(engine, str(cfg.actor_rollout_ref.model.path), transport_spec(engine.hetero, engine.settings))
    )
    enrol_insiders(enrolment_file, ray.get(crew.public_keys.remote(), timeout=300))
    crew.run.remote()
    return crew
