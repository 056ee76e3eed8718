"""verl_ext.trust.assignment: the prompt streams of sampler ids and the assigned Gumbel seeds."""

import pytest

from verl_ext.hetero.records import SEED_LIMIT
from verl_ext.hetero.seeding import MAX_SAMPLERS, sampler_stream
from verl_ext.trust.assignment import assigned_seed, gumbel_key, prompt_stream


def test_numbered_samplers_and_pools_keep_their_streams_and_other_ids_get_their_own():
    assert [prompt_stream(f"sampler-{i}") for i in (0, 5, 63)] == [sampler_stream(i) for i in (0, 5, 63)]
    assert prompt_stream("pool-2") == 3
    others = ["honest", "sampler-64", "sampler-07", "sampler-x", "pool-", "sampler-٣"]
    streams = [prompt_stream(s) for s in others]
    assert all(stream > MAX_SAMPLERS for stream in streams) and len(set(streams)) == len(others)
    assert prompt_stream("honest") == prompt_stream("honest")


def test_the_seed_key_is_fixed_by_the_secret_and_is_not_it():
    assert gumbel_key(b"a" * 32) == gumbel_key(b"a" * 32) != gumbel_key(b"b" * 32)
    assert gumbel_key(b"a" * 32) != b"a" * 32 and len(gumbel_key(b"a" * 32)) == 32


@pytest.mark.parametrize("change", ["key", "sampler", "batch", "slot", "version"])
def test_an_assigned_seed_depends_on_each_of_its_five_inputs(change):
    base = dict(key=b"k" * 32, sampler_id="sampler-1", batch=3, slot=1, version=7)
    moved = dict(base)
    moved[{"key": "key", "sampler": "sampler_id"}.get(change, change)] = {
        "key": b"j" * 32, "sampler": "sampler-2", "batch": 4, "slot": 0, "version": 8,
    }[change]  # fmt: skip
    seed = assigned_seed(**base)
    assert seed == assigned_seed(**base) and 0 <= seed < SEED_LIMIT
    assert assigned_seed(**moved) != seed
