"""The cpu_smollm2_math preset (SmolLM2-135M-Instruct on easy GSM8K through verl's trainer on the
CPU): it composes on cpu_toy, passes the verl engine's validation, and main_gepo's task resolution
gives it the built-in model and the task's parquet pair -- the same model rule as the embedded
engine. No model is converted here (the slow checks are in tests/data/test_smollm2.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from recipe.gepo.verl_engine.launch_plan import validate
from recipe.gepo.verl_engine.runner import resolve_task_files
from verl_ext.data import smollm2

ROOT = Path(__file__).resolve().parents[3]


def compose_config(*overrides):
    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        return compose(config_name="gepo_trainer", overrides=[searchpath, *overrides])


@pytest.fixture(scope="module")
def preset():
    return compose_config("+verl_preset=cpu_smollm2_math", "hetero.engine=verl")


def test_the_preset_is_cpu_toy_with_a_real_model_and_math_data(preset):
    toy = compose_config("+verl_preset=cpu_toy", "hetero.engine=verl")
    v = validate(preset)
    assert v.rollout.name == "hf_cpu" and v.actor.strategy == "fsdp2" and v.rollout.n == 4
    # every CPU setting comes from cpu_toy (its defaults list), unchanged
    for key in (
        "ray_kwargs",
        "transfer_queue",
        "trainer.device",
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.actor.fsdp_config",
        "actor_rollout_ref.rollout.checkpoint_engine",
        "actor_rollout_ref.model.override_config",
        "reward.custom_reward_function.path",
    ):
        assert OmegaConf.select(preset, key) == OmegaConf.select(toy, key), key
    task = preset.task
    assert (task.name, task.model, task.dataset, task.template) == ("math", smollm2.MODEL_NAME, "gsm8k", "chat_1shot")
    assert dict(task.dataset_options) == {
        "split": "train",
        "max_steps": 2,
        "max_answer": 100,
        "max_question_chars": 200,
    }
    assert dict(task.eval_dataset_options) == {**task.dataset_options, "split": "test"}
    assert preset.data.train_batch_size == 4 and preset.data.max_response_length == 160
    assert preset.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4  # one whole group of G=4
    assert preset.reward.custom_reward_function.reward_kwargs.boxed_weight == 0.1
    assert preset.verl_engine.preset == "cpu_smollm2_math" and preset.actor_rollout_ref.model.path == ""


def test_task_resolution_writes_the_gsm8k_pair_and_a_given_model_path_wins(preset, tmp_path):
    cfg = preset.copy()
    with open_dict(cfg):
        cfg.task.cache_dir = str(tmp_path / "cache")
        cfg.actor_rollout_ref.model.path = str(tmp_path)  # no conversion: an explicit folder wins over task.model
        cfg.trainer.default_local_dir = str(tmp_path / "run")
    out = resolve_task_files(cfg)
    assert out.actor_rollout_ref.model.path == str(tmp_path.resolve())
    train, val = Path(out.data.train_files), Path(out.data.val_files)
    assert train.is_relative_to(tmp_path / "cache" / "verl_math") and train.parent == val.parent
    assert pq.read_metadata(train).num_rows == 880 and pq.read_metadata(val).num_rows == 64
    assert pq.read_table(val).to_pylist()[0]["extra_info"]["id"].startswith("gsm8k/test/")
    assert preset.data.train_files == ""  # the input is not modified


def test_both_engines_resolve_task_model_to_the_converted_smollm2(preset, tmp_path, monkeypatch):
    """``task.model=smollm2-135m-instruct`` with an empty model path: the cached conversion under
    task.cache_dir, through the one rule both engines call (verl_ext.data.task_model.resolve_task_model)."""
    from recipe.gepo.embedded.tasks import resolve_model_path
    from recipe.gepo.sections import TaskConfig

    folder = tmp_path / "smollm2-135m-instruct-abc"
    folder.mkdir()
    asked = []
    monkeypatch.setattr(smollm2, "prepare_smollm2", lambda cache_dir: asked.append(cache_dir) or folder)
    cfg = preset.copy()
    with open_dict(cfg):
        cfg.task.cache_dir = str(tmp_path)
        cfg.trainer.default_local_dir = str(tmp_path / "run")
    verl_model = resolve_task_files(cfg).actor_rollout_ref.model.path
    local_model = resolve_model_path("", TaskConfig.from_omegaconf(cfg.task), seed=0)
    assert verl_model == str(folder.resolve()) and local_model == str(folder) and asked == [str(tmp_path)] * 2


def test_a_missing_dataset_path_fails_validation_naming_the_key(tmp_path):
    missing = tmp_path / "nope.jsonl"
    cfg = compose_config(
        "+verl_preset=cpu_smollm2_math", "hetero.engine=verl", "task.dataset=aime24", f"task.dataset_path={missing}"
    )
    with pytest.raises(ValueError, match=f"task.dataset_path=.*{missing}"):
        validate(cfg)
