"""Prompts given back to the pools (recipe/gepo/verl_engine/prompt_reissue.py): a real buffer
drops groups as stale as the learner moves on, and their prompts go to the pool that filled the most
slots, at most ``limit`` times each; the re-issue records are what pools read (reissues_for)."""

import uuid

import numpy as np

from recipe.gepo.verl_engine.pool_groups import group_prompt
from recipe.gepo.verl_engine.prompt_reissue import StalePrompts
from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.protocol import REISSUE_TOPIC, Reissue, TransportSpec, reissues_for
from verl_ext.hetero.records import RecordSpec

from tests.hetero.factories import build_group


def _books(limit):
    transport = TransportSpec("fsspec", url=f"memory://reissue-{uuid.uuid4().hex}").open()
    buffer = RolloutBuffer(max_delay=1, spec=RecordSpec(group_size=4))
    books = StalePrompts(limit)
    buffer.on_stale = books.dropped
    return transport, buffer, books


def test_stale_groups_give_their_prompts_to_the_pool_that_fills_most_slots():
    transport, buffer, books = _books(limit=2)
    for _ in range(3):
        books.filled("pool-32")  # the fast pool
    books.filled("pool-33")
    slow = [build_group(f"r33-b0-{i}", version=0, sampler="pool-33", seed=i) for i in range(3)]
    for group in slow:
        assert buffer.add(group)
    buffer.set_learner_version(2)  # version 0 is past the bound now
    assert books.give_back(transport) == 3
    given = reissues_for(transport, "pool-32")
    assert [key for key, _ in given] == sorted(f"pool-32.{g.group_uid}" for g in slow)
    assert {tuple(r.prompt_ids) for _, r in given} == {group_prompt(g) for g in slow}
    assert all(r.tries == 1 for _, r in given) and reissues_for(transport, "pool-33") == []
    # quarantined pools get none
    buffer.add(build_group("r33-b1-0", version=0, sampler="pool-33", seed=9))
    books.give_back(transport, quarantined=["pool-32"])
    assert [key for key, _ in reissues_for(transport, "pool-33")] == ["pool-33.r33-b1-0"]


def test_a_prompt_is_given_back_at_most_limit_times_then_reported_never_admitted():
    transport, buffer, books = _books(limit=2)
    version = 0
    for attempt in range(3):  # the same prompt goes stale three times
        buffer.add(build_group(f"g{attempt}", version=version, seed=7))
        version += 2
        buffer.set_learner_version(version)
        books.give_back(transport)
    tries = sorted(r.tries for _, r in reissues_for(transport, "s0"))
    assert tries == [1, 2]  # the third time: given up
    metrics = books.metrics()
    assert metrics["pool/prompts_reissued"] == 2 and metrics["pool/prompts_never_admitted"] == 1
    assert metrics["pool/prompts_dropped_stale"] == 1
    books.trained([group_prompt(build_group("g-late", version=0, seed=7))])  # trained after all
    assert books.metrics()["pool/prompts_never_admitted"] == 0
    assert books.metrics()["pool/prompts_stale_then_trained"] == 1


def test_a_trained_prompt_is_not_given_back_and_limit_zero_gives_nothing_back():
    transport, buffer, books = _books(limit=2)
    group = build_group("g0", version=0, seed=3)
    books.trained([group_prompt(group)])
    buffer.add(group)
    buffer.set_learner_version(2)
    assert books.give_back(transport) == 0
    transport, buffer, off = _books(limit=0)
    buffer.add(build_group("g1", version=0, seed=4))
    buffer.set_learner_version(2)
    assert off.give_back(transport) == 0 and transport.keys(REISSUE_TOPIC) == []
    assert off.metrics()["pool/prompts_never_admitted"] == 1  # counted, never given back


def test_malformed_reissue_records_are_deleted_not_served():
    transport = TransportSpec("fsspec", url=f"memory://reissue-{uuid.uuid4().hex}").open()
    transport.put(REISSUE_TOPIC, "pool-32.a", Reissue(prompt_ids=[1, 2, 3], tries=1).to_bytes())
    for key, raw in {
        "b": b"not json",
        "c": b'{"prompt_ids": "abc", "tries": 1}',
        "d": b'{"prompt_ids": 5, "tries": 1}',
    }.items():
        transport.put(REISSUE_TOPIC, f"pool-32.{key}", raw)
    assert [(k, r.prompt_ids) for k, r in reissues_for(transport, "pool-32")] == [("pool-32.a", [1, 2, 3])]
    assert transport.keys(REISSUE_TOPIC) == ["pool-32.a"]
    assert np.array_equal(np.array(reissues_for(transport, "pool-32")[0][1].prompt_ids), [1, 2, 3])


def test_the_option_sets_the_learners_limit_and_is_refused_without_pools():
    import pytest

    from recipe.gepo.remote_sampler import compose_config
    from recipe.gepo.sections import HeteroConfig

    def hetero(*overrides):
        base = ["+verl_preset=cpu_toy", "hetero.engine=verl", *overrides]
        return HeteroConfig.from_omegaconf(compose_config(base).hetero)

    assert StalePrompts.of(hetero("hetero.transport=fs")).limit == 2  # the default
    assert StalePrompts.of(hetero("hetero.transport=fs", "hetero.reissue_stale_prompts=0")).limit == 0
    with pytest.raises(ValueError, match=r"hetero.reissue_stale_prompts=5 is read with sampler pools only"):
        hetero("hetero.reissue_stale_prompts=5")
    with pytest.raises(ValueError, match=r"hetero.reissue_stale_prompts=-1 must be >= 0"):
        hetero("hetero.transport=fs", "hetero.reissue_stale_prompts=-1")
