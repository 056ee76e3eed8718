"""``make demo``: GEPO on the toy addition task, async mode, two samplers behind log-normal delays.

    python -m recipe.gepo.demo [hydra overrides ...]     (make demo ARGS="...")

Warm-starts the toy model (cached after the first time), trains it with GEPO in async mode --
one learner and two sampler actors on Ray, weights reaching each sampler after a log-normal
delay (seconds), a max tolerable staleness of 4 versions -- and prints held-out accuracy before
and after, staleness, dropped groups, IS-weight variance and the learner's idle fraction.
Any override (``algorithm_preset=grpo``, ``hetero.mode=replay``, ...) is applied on top. Under
``hetero.mode=replay`` the demo leaves out its async-only settings (two samplers and their speed
factors: replay has one in-process sampler) and its delays count learner steps, not seconds.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

CONFIG_DIR = Path(__file__).resolve().parent / "config"
DEMO_OVERRIDES = [
    "algorithm_preset=gepo",
    "hetero.mode=async",
    "hetero.num_samplers=2",
    "hetero.delay.dist=lognormal",
    "hetero.delay.low=0.2",
    "hetero.delay.high=3.0",
    "hetero.max_delay=4",
    "hetero.sampler_speed_factors=[2.0,3.0]",
    "trainer.total_training_steps=150",
    "trainer.test_freq=25",
    "trainer.save_freq=150",
    "trainer.resume_mode=disable",
    "trainer.default_local_dir=runs/demo",
    "task.eval_size=512",
]
ASYNC_ONLY = ("hetero.num_samplers=", "hetero.sampler_speed_factors=")
"""The demo's settings that replay mode refuses (it has one in-process sampler)."""


def demo_config(argv: list[str]):
    """The demo's overrides, then ``argv``'s, composed; the async-only ones left out in replay mode."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=DEMO_OVERRIDES + list(argv))
        if cfg.hetero.mode == "replay":
            mine = [o for o in DEMO_OVERRIDES if not o.startswith(ASYNC_ONLY)]
            cfg = compose(config_name="gepo_trainer", overrides=mine + list(argv))
    return cfg


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def main(argv: list[str]) -> int:
    from .main_gepo import run
    from .run_report import load_metrics, summarize

    cfg = demo_config(argv)
    start = time.time()
    run(cfg)
    run_dir = Path(str(cfg.trainer.default_local_dir))
    s = summarize(run_dir)
    metrics = load_metrics(run_dir)
    weight_var = metrics.get("is/weight_var")

    def dropped(reason: str) -> str:
        column = metrics.get(f"hetero/dropped/{reason}")
        return _fmt(float(column.sum()) if column is not None else 0.0, ".0f")

    rows = [
        ("algorithm (loss mode)", str(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)),
        ("mode / samplers", f"{cfg.hetero.mode} / {cfg.hetero.num_samplers if cfg.hetero.mode == 'async' else 1}"),
        ("learner steps", str(s["last_step"])),
        ("held-out accuracy before", _fmt(s["eval_first"])),
        ("held-out accuracy after", _fmt(s["eval_last"])),
        ("staleness mean / max (versions)", f"{_fmt(s['staleness_mean'], '.2f')} / {_fmt(s['staleness_max'], '.0f')}"),
        ("max tolerable staleness", str(cfg.hetero.max_delay)),
        ("dropped groups (stale / over quota)", f"{dropped('stale')} / {dropped('over_quota')}"),
        (
            "IS-weight variance (mean over steps)",
            _fmt(float(weight_var.mean()) if weight_var is not None else None, ".4f"),
        ),
        ("learner idle fraction (mean)", _fmt(s["learner_idle_frac_mean"], ".2f")),
        ("wall time (s, incl. warm start)", f"{time.time() - start:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nHeteroRL demo")
    print("-" * (width + 14))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("-" * (width + 14))
    print(f"metrics: {run_dir / 'metrics.jsonl'}   report: {run_dir / 'report.md'}   curves: {run_dir / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
