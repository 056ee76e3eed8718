"""Helpers shared by the embedded-engine tests (config composition, metrics files)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

CONFIG_DIR = Path(__file__).resolve().parents[3] / "recipe" / "gepo" / "config"

# the smallest run the engine accepts that still has groups, staleness and evaluation
TINY = [
    "task.name=toy_addition",
    "task.digits=1",
    "task.eval_size=16",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=4",
    "trainer.logger=[]",
    "trainer.resume_mode=disable",
    "hetero.export_hf=none",  # the HF export at the end has its own tests (test_export.py)
]


def compose_cfg(overrides: list[str]) -> DictConfig:
    """``gepo_trainer.yaml`` composed with hydra's compose API, as the CLI would."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=overrides)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_lines(lines: list[dict]) -> list[dict]:
    """Metric lines of learner steps (step >= 1; step 0 is the initial evaluation)."""
    return [line for line in lines if line["step"] >= 1]


# names every embedded-engine run logs at every learner step, whatever the mode (the
# report and the plots read them)
STEP_METRICS = (
    "hetero/staleness_mean",
    "hetero/staleness_max",
    "hetero/dropped",
    "is/weight_var",
    "is/kl_sampler_learner",
    "actor/loss",
    "actor/grad_norm",
    "reward/mean",
    "perf/step_s",
    "perf/sampler_tokens_per_s",
    "perf/learner_idle_frac",
    "perf/train_s",
    "perf/publish_s",
    "perf/wall_s",
)


def wait_until(predicate, what: str, timeout_s: float = 60.0, poll_s: float = 0.02) -> None:
    """Poll ``predicate`` until it is true; AssertionError naming ``what`` after ``timeout_s`` (a bound
    on a wait that ends as soon as it holds: generous, so a loaded machine does not fail it)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)
