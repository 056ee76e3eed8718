"""The composed trainer config of a soak run (hydra, the real ``gepo_trainer`` config)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "recipe" / "gepo" / "config"


def soak_config(
    run_dir: Path, seed: int, save_freq: int, wait_timeout_s: float, extra: list[str], wan_address: str = ""
):
    """Async mode, 3 samplers (one 4x slower), checkpoints every ``save_freq`` steps, resumed
    after a crash; the fs transport in ``<run_dir>/exchange``, or with ``wan_address`` the learner
    and its mailbox on the head of the WAN cluster and the samplers across the link. The run
    directory is ``<run_dir>/run``."""
    from hydra import compose, initialize_config_dir

    overrides = [
        "hetero.mode=async",
        "hetero.num_samplers=3",
        *_transport_overrides(run_dir, wan_address),
        "hetero.delay.low=0.2",
        "hetero.delay.high=2",
        "hetero.max_delay=4",
        "hetero.sampler_speed_factors=[1.0,1.0,4.0]",
        f"hetero.wait_timeout_s={wait_timeout_s}",
        f"hetero.seed={seed}",
        "trainer.total_training_steps=1000000",
        f"trainer.save_freq={save_freq}",
        "trainer.test_freq=0",
        f"trainer.default_local_dir={run_dir / 'run'}",
        "trainer.resume_mode=auto",
        "trainer.logger=[]",
        "task.eval_size=16",
        f"task.cache_dir={REPO / '.cache' / 'heterorl'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=overrides)
    if cfg.hetero.trust.sign_records and not cfg.hetero.trust.enrolment_file:
        from omegaconf import open_dict

        with open_dict(cfg):  # samplers outside the engine (the injector, --liars) are enrolled here
            cfg.hetero.trust.enrolment_file = str(run_dir / "enrolment_outside.json")
    if not cfg.actor_rollout_ref.model.path and cfg.task.name == "toy_addition":
        _use_seed0_warm_start(cfg)
    return cfg


def _transport_overrides(run_dir: Path, wan_address: str) -> list[str]:
    if wan_address:  # learner + mailbox on the head, samplers across the link
        return [
            "hetero.transport=ray",
            f"hetero.ray_address={wan_address}",
            "hetero.learner_ray_resources={learner_node: 0.01}",
            "hetero.sampler_ray_resources={sampler_node: 0.01}",
        ]
    return ["hetero.transport=fs", f"hetero.transport_url={run_dir / 'exchange'}"]


def _use_seed0_warm_start(cfg) -> None:
    """The toy warm start is cached per seed; every soak seed trains from the seed-0 one."""
    from omegaconf import open_dict

    from recipe.gepo.embedded.tasks import resolve_model_path
    from recipe.gepo.sections import TaskConfig

    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = resolve_model_path("", TaskConfig.from_omegaconf(cfg.task), 0)
