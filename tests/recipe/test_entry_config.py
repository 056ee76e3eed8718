"""The entry's config: every typed field of the task: and hetero: sections is
written out, with a comment, in gepo_trainer.yaml (overridable without ``+``); the verl engine
without a cluster preset fails with one paragraph naming the missing key, not omegaconf's
traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.gepo.sections import DelayConfig, HeteroConfig
from recipe.gepo.sections import TaskConfig
from recipe.gepo.main_gepo import MissingValueError, missing_values, run

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "recipe" / "gepo" / "config"
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "verl_preset").glob("*.yaml"))
SECTIONS = [("task", TaskConfig), ("hetero", HeteroConfig), ("hetero.delay", DelayConfig)]


def compose_cfg(*overrides: str, presets: bool = False):
    """``gepo_trainer.yaml`` composed by hydra as the CLI would (``presets``: with ``--config-dir configs``)."""
    extra = [f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"] if presets else []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=[*extra, *overrides])


def yaml_keys() -> dict[str, tuple[str, str]]:
    """Dotted key -> (its line, the line above it) for every mapping key in gepo_trainer.yaml."""
    out, stack, previous = {}, [], ""
    for line in (CONFIG_DIR / "gepo_trainer.yaml").read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_][\w]*):", line)
        if m:
            indent = len(m.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, m.group(2))]
            out[".".join(k for _, k in stack)] = (line, previous)
        if line.strip():
            previous = line
    return out


@pytest.mark.parametrize("section, cls", SECTIONS, ids=[s for s, _ in SECTIONS])
def test_every_dataclass_field_is_in_the_yaml_with_a_comment(section, cls):
    node = OmegaConf.select(compose_cfg(), section)
    missing = [f.name for f in fields(cls) if f.name not in node]
    assert not missing, f"{section}: fields of {cls.__name__} missing from gepo_trainer.yaml: {missing}"
    unknown = sorted(set(node) - {f.name for f in fields(cls)})
    assert not unknown, f"{section}: keys in gepo_trainer.yaml that {cls.__name__} does not have: {unknown}"
    keys = yaml_keys()
    uncommented = [
        f.name
        for f in fields(cls)
        if "#" not in keys[f"{section}.{f.name}"][0] and not keys[f"{section}.{f.name}"][1].lstrip().startswith("#")
    ]
    assert not uncommented, f"{section}: keys without a comment in gepo_trainer.yaml: {uncommented}"


def test_task_fields_override_without_plus():
    cfg = compose_cfg("task.answer_format=scratchpad", "task.diagnostics_every=4", "task.diagnostics_samples=8")
    task = TaskConfig.from_omegaconf(cfg.task)
    assert (task.answer_format, task.diagnostics_every, task.diagnostics_samples) == ("scratchpad", 4, 8)
    assert TaskConfig.from_omegaconf(compose_cfg().task) == TaskConfig()  # the YAML's values are the defaults


def test_verl_engine_without_preset_names_the_missing_key_and_the_presets():
    cfg = compose_cfg("hetero.engine=verl", "hetero.dry_run=true")
    with pytest.raises(MissingValueError) as info:
        run(cfg)
    message = str(info.value)
    assert "actor_rollout_ref.rollout.name" in message
    assert "--config-dir configs +verl_preset=<name>" in message
    assert PRESETS and all(name in message for name in PRESETS)
    # verl's reward-model rollout is also '???', but under reward.reward_model.enable=false: never read
    assert "reward.reward_model" not in message
    assert "\n" not in message  # one paragraph


def test_missing_values_are_found_generically_and_a_preset_passes(capsys):
    preset = ["+verl_preset=qwen3_1p7b_fsdp", "hetero.engine=verl", "hetero.dry_run=true"]
    cfg = compose_cfg(*preset, presets=True)
    assert missing_values(cfg) == []
    assert "HeteroRL verl engine plan" in run(cfg)["plan"]  # the check lets a complete config through
    cfg = compose_cfg(*preset, "actor_rollout_ref.model.path=???", presets=True)
    with pytest.raises(MissingValueError, match=r"actor_rollout_ref\.model\.path"):
        run(cfg)


@pytest.mark.slow  # ~15 s of imports in a fresh interpreter on shared cores
def test_cli_without_preset_prints_one_paragraph_not_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.gepo.main_gepo", "hetero.engine=verl", "hetero.dry_run=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "actor_rollout_ref.rollout.name" in proc.stderr
    assert "Traceback" not in proc.stderr and "MissingMandatoryValue" not in proc.stderr


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"name": "math", "model": "llama-7b"}, "task.model='llama-7b'; expected '' .*'smollm2-135m-instruct'"),
        ({"model": "smollm2-135m-instruct"}, "applies to task.name=math only"),
        ({"dataset": "gsm8k"}, r"task.dataset='gsm8k' applies to task.name=math only \(task.name=toy_addition\)"),
        ({"template": "chat"}, "task.template='chat' applies to task.name=math only"),
        ({"name": "math", "digits": 4}, r"task.digits=4 applies to task.name=toy_addition only \(task.name=math\)"),
        ({"name": "math", "warm_start_steps": 5}, "task.warm_start_steps=5 applies to task.name=toy_addition only"),
        (
            {"name": "math", "answer_format": "scratchpad"},
            "task.answer_format='scratchpad' applies to task.name=toy_addition",
        ),
        ({"name": "math", "dataset_options": ["split", "train"]}, "task.dataset_options=.* must be a mapping"),
        ({"name": "math", "eval_dataset_options": "test"}, "task.eval_dataset_options=.* must be a mapping"),
    ],
)
def test_math_task_fields_are_checked_naming_the_value(fields, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(**fields)


def test_dataset_options_reach_the_embedded_engines_task_and_chat_templates_render_with_its_tokenizer():
    """task.dataset_options / task.eval_dataset_options select the problems in the embedded engine
    too; task.template=chat / chat_1shot (the model's own chat template) render with the model's
    tokenizer, as verl applies it (refused without one); the other templates ignore the tokenizer."""
    from recipe.gepo.embedded.tasks import Task
    from verl_ext.data.templates import render_prompt
    from verl_ext.data.toy.model import build_tokenizer

    easy = {"split": "train", "max_steps": 2, "max_answer": 100, "max_question_chars": 200}
    task = Task(
        TaskConfig(
            name="math",
            dataset="gsm8k",
            dataset_options=easy,
            eval_dataset="gsm8k",
            eval_dataset_options={**easy, "split": "test"},
            eval_size=3,
        ),
        seed=0,
    )
    assert len(task._train_pool) == 880 and len(task.eval_items) == 3
    assert TaskConfig.from_omegaconf({"name": "math", "dataset_options": None}).dataset_options == {}  # YAML null
    with pytest.raises(
        ValueError, match="task.template='chat' renders with the model's own chat template: the task needs"
    ):
        Task(TaskConfig(name="math", dataset="gsm8k", template="chat", eval_dataset="gsm8k", eval_size=1), seed=0)
    chatml = build_tokenizer()  # character-level; SmolLM2's ChatML template (its default system prompt)
    chatml.chat_template = (
        "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{{ '<|im_start|>assistant\n' }}"
    )
    one_shot = Task(
        TaskConfig(
            name="math",
            dataset="gsm8k",
            dataset_options=easy,
            eval_dataset="gsm8k",
            eval_dataset_options={**easy, "split": "test"},
            eval_size=3,
            template="chat_1shot",
        ),
        seed=0,
        tokenizer=chatml,
    )
    problem = "Ann has 2 cats and 3 dogs. How many pets?"
    assert one_shot.eval_items[0]["prompt"].startswith(
        "<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>user\n"
    )
    assert [p["prompt"] for p in one_shot._train_pool[:2]] != [p["prompt"] for p in task._train_pool[:2]]
    assert one_shot._train_pool[0]["prompt"].count("\\boxed{5}") == 1  # the worked example
    assert render_prompt(problem, "chat_1shot", chatml).endswith(
        "Problem: " + problem + "\nSolution:<|im_end|>\n<|im_start|>assistant\n"
    )
    ignored = Task(
        TaskConfig(
            name="math",
            dataset="gsm8k",
            dataset_options=easy,
            eval_dataset="gsm8k",
            eval_dataset_options={**easy, "split": "test"},
            eval_size=3,
        ),
        seed=0,
        tokenizer=chatml,
    )
    assert ignored.eval_items == task.eval_items  # qwen3_nothink renders without the tokenizer, as before


def test_a_given_model_path_with_warm_start_steps_is_refused(tmp_path):
    """task.warm_start_steps makes the toy warm start; a given model folder is trained as is."""
    from verl_ext.data.task_model import resolve_task_model

    (tmp_path / "model").mkdir()
    with pytest.raises(
        ValueError, match=r"task.warm_start_steps=3 sets the toy warm start's steps, but actor_rollout_ref.model.path="
    ):
        resolve_task_model(str(tmp_path / "model"), TaskConfig(warm_start_steps=3), seed=0)
    assert resolve_task_model(str(tmp_path / "model"), TaskConfig(), seed=0) == str(tmp_path / "model")


@pytest.mark.parametrize(
    "estimator, needs", [("gae", "values"), ("remax", "reward_baselines"), ("optimal_token_baseline", "old_log_probs")]
)
def test_an_estimator_the_embedded_engine_cannot_feed_fails_at_start(estimator, needs):
    """verl's registry has estimators that need a critic's values, reward baselines or recomputed
    log-probs; the embedded engine refuses them at start, naming the inputs (not a TypeError at step 1)."""
    from recipe.gepo.embedded.engine_config import check_registered
    from verl_ext.algos.advantages import unfed_advantage_inputs

    with pytest.raises(ValueError, match=rf"algorithm.adv_estimator='{estimator}' needs \[.*'{needs}'"):
        check_registered("gepo", estimator)
    for usable in ("grpo", "bnpo", "rloo", "reinforce_plus_plus"):
        assert unfed_advantage_inputs(usable) == []
        check_registered("gepo", usable)
