"""The verl engine's trainer is in verl's v1 trainer registry, refuses a bypass config at
construction, and its replay buffer (verl's own, one method overridden) enforces the exact bound."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

from recipe.gepo.verl_engine import trainer as hetero_trainer
from recipe.gepo.verl_engine.launch_plan import TRAINER_NAME, ForcedLossModeError

ROOT = Path(__file__).resolve().parents[3]


def test_registered_in_verls_trainer_registry():
    cls = get_trainer_cls(TRAINER_NAME)
    assert cls is hetero_trainer.HeteroSeparateAsyncTrainer
    assert issubclass(cls, PPOTrainerSeparateAsync)
    assert get_trainer_cls("separate_async") is PPOTrainerSeparateAsync  # verl's own stay


def test_trainer_refuses_a_bypass_config_before_touching_anything():
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=["algorithm.rollout_correction.bypass_mode=true"])
    with pytest.raises(ForcedLossModeError, match="bypass_mode"):
        hetero_trainer.HeteroSeparateAsyncTrainer(cfg)


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_replay_buffer_bound_is_exact_over_weight_versions(strategy):
    buf = ReplayBufferAsync(
        trainer_mode="separate_async",
        trainer_config={},
        max_off_policy_threshold=9,
        max_off_policy_strategy=strategy,
        sampler_kwargs={},
    )
    buf.__class__ = hetero_trainer.HeteroReplayBuffer
    buf.hetero_max_delay = 8
    # the state verl's _sync_metadata_from_transfer_queue would fill: three finished groups, all
    # submitted at step 20 (so verl's own submission-step check sees nothing stale)
    for uid, version in (("fresh", 19), ("edge", 11), ("old", 10)):
        buf.prompt_global_steps["train"][uid] = 20
        buf.finished_keys["train"].add(uid)
        for i in range(2):
            buf.partitions["train"][f"{uid}_0_{i}"] = {"min_global_steps": version + i}
    stale, _dapo, _failed, _counts = buf._terminal_eviction_reasons(20, "train")
    assert stale == {"old"}  # learner version 19: 19-11 = 8 is admissible, 19-10 = 9 is not
    assert buf._sampleable_terminal_keys("train", (stale, set(), set(), {})) == {"fresh", "edge"}
    assert buf._stale_terminal_keys(20, "val") == set()
