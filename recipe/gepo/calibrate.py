"""Measure how far honest bf16 samplers of *this* run's model are from the learner's re-score, and
write the bounds that follow (``hetero.trust.bounds_file``).

    python -m recipe.gepo.calibrate --out bounds.json [--groups 128] [--prompts 16] [the run's overrides...]

The table's bf16 bounds (``verl_ext.trust.bounds.TOLERANCES``) are SmolLM2-135M's honest spread, too
wide or too narrow for another model. Under the run's config (model, task, temperature, lengths,
group size, ``hetero.device``, ``hetero.sampler_precision``, ``hetero.weights_bf16``), version 0's
weights go through the weight store's message; an honest bf16 sampler on ``hetero.device`` draws
``--groups`` groups with the engine's rollout code (Gumbel-max under ``checkable_sampling``), the
gate's scorer re-scores each as :class:`~verl_ext.trust.verifier.GroupVerifier` does, and
:func:`~verl_ext.trust.bounds.calibrate` sets the bounds (its rule written into the file, with the
model, scorer precision and temperature, which a run must match, and the honest sample's statistics).
Other kernels (vLLM's) or a model that moved far need their own: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from verl_ext.trust.config import TABLE_BOUNDS

CONFIG_DIR = Path(__file__).resolve().parent / "config"


def compose_engine(overrides: list[str]):
    """The run's validated :class:`~recipe.gepo.embedded.engine_config.EngineConfig` for ``overrides``."""
    from hydra import compose, initialize_config_dir

    from .embedded.engine_config import EngineConfig

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        # measuring needs no bounds: the table's stand in for the ones a bf16 scorer's run must name
        cfg = compose(config_name="gepo_trainer", overrides=["trainer.logger=[]", *overrides])
        if not cfg.hetero.trust.bounds_file:
            cfg.hetero.trust.bounds_file = TABLE_BOUNDS
    return EngineConfig.from_omegaconf(cfg)


def honest_mismatches(
    engine, groups: int, prompts: int, precision: str = "bf16", progress: bool = True
) -> tuple[list, Optional[list]]:
    """(:class:`~verl_ext.trust.bounds.Mismatch` of ``groups`` honest groups drawn by a sampler
    in ``precision`` with the engine's rollout code from version 0's weight-store message, and
    re-scored by the run's gate scorer (one full forward a group); with ``checkable_sampling``, each
    group's checked tokens' noised margins (:func:`~verl_ext.trust.gumbel.noised_margins`, float64
    [tokens]), else None)."""
    import torch
    from tqdm import tqdm

    from .embedded.model_placement import Placement
    from .embedded.policy import load_policy
    from .embedded.rollout_groups import RolloutSettings, generate_groups
    from .embedded.tasks import Task, resolve_model_path
    from verl_ext.trust.verifier import group_log_probs, group_scores
    from verl_ext.trust.gumbel import noised_margins
    from verl_ext.trust.bounds import group_mismatch
    from verl_ext.hetero.weights import deserialize_state_dict, serialize_state_dict

    hetero, s = engine.hetero, engine.settings
    task = Task(engine.task, hetero.seed)
    path = resolve_model_path(s.model_path, engine.task, hetero.seed)
    learner, _ = load_policy(path)
    message = serialize_state_dict(learner.state_dict(), 0, "bf16" if hetero.weights_bf16 else None)
    weights = deserialize_state_dict(message)[1]
    placement = Placement.of(hetero)
    scorer, tokenizer = placement.load_sampler(path)  # as GroupVerifier loads it
    sampler, _ = dataclasses.replace(placement, sampler_precision=precision).load_sampler(path)
    for model in (scorer, sampler):
        model.load_state_dict(weights, strict=True)
        model.eval()
    settings = RolloutSettings(s.group_size, s.temperature, s.max_new_tokens)
    checkable = hetero.trust.checkable_sampling
    stats, margins = [], []
    batches = -(-groups // prompts)
    for index in tqdm(range(batches), desc="calibrate", unit="batch", disable=not progress):
        n = min(prompts, groups - index * prompts)
        drawn = generate_groups(
            sampler,
            tokenizer,
            task.train_items(n, stream=97, index=index),  # a stream no sampler of a run uses
            task.score,
            settings,
            engine.algorithm,
            policy_version=0,
            sampler_id="calibration",
            seed=index,
            uid_prefix=f"calibration-{index}",
            checkable=checkable,
        )
        with torch.no_grad():
            for group in drawn:
                if checkable:  # the token check's forward: log-probs and the logits it re-derives tokens from
                    rescored, logits = group_scores(scorer, group, s.temperature)
                    margins.append(
                        noised_margins(
                            logits, group.response_ids, group.response_mask, s.temperature, group.sampling_seed
                        ).numpy()
                    )
                else:
                    rescored = group_log_probs(scorer, group, s.temperature)
                stats.append(group_mismatch(group.sampler_logprobs, rescored, group.response_mask))
    return stats, (margins if checkable else None)


def honest_summary(stats: list) -> dict:
    """The honest sample's statistics a bounds file records (largest and median of each)."""
    columns = {
        "token_max": [m.token_max for m in stats],
        "group_mean_abs": [m.mean_abs for m in stats],
        "group_kl": [m.kl for m in stats],
        "group_abs_mean_signed": [abs(m.mean_signed) for m in stats],
    }
    out = {f"{name}_largest": float(np.max(v)) for name, v in columns.items()}
    out.update({f"{name}_median": float(np.median(v)) for name, v in columns.items()})
    out["tokens"] = int(sum(m.tokens for m in stats))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the bounds file to write (hetero.trust.bounds_file)")
    parser.add_argument("--groups", type=int, default=128, help="honest groups to measure (at least 16)")
    parser.add_argument("--prompts", type=int, default=16, help="groups drawn per batch")
    parser.add_argument(
        "--horizon", type=int, default=10_000, help="checked groups per honest sampler the CUSUM limits are set for"
    )
    parser.add_argument("overrides", nargs="*", help="the run's hydra overrides (key=value)")
    args = parser.parse_args(argv)
    if args.groups < 16 or args.prompts < 1 or args.horizon < 1:
        parser.error(
            f"--groups {args.groups} (>= 16), --prompts {args.prompts} (>= 1), --horizon {args.horizon} (>= 1)"
        )
    out = Path(args.out)
    if not out.parent.is_dir():
        parser.error(f"--out {args.out}: no folder {out.parent}")

    from verl_ext.trust.bounds import TOLERANCES, bounds_file_payload, calibrate
    from verl_ext.torch_threads import set_torch_threads

    from .embedded.engine_config import model_identity

    set_torch_threads(1)
    # the run's config, without a bounds file of its own (this measures one)
    try:
        engine = compose_engine([*args.overrides, "hetero.trust.bounds_file="])
    except Exception as err:  # noqa: BLE001 -- a refused override: one line naming it
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        from .main_gepo import DEBUG_ENV, hydra_refusal

        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        if isinstance(err, (HydraException, OmegaConfBaseException)):
            parser.exit(2, f"error: {hydra_refusal(err, argv=args.overrides)}\n")
        if isinstance(err, (ValueError, FileNotFoundError)):  # ConfigError is a ValueError
            parser.exit(2, f"error: {err}\n")
        raise
    stats, margins = honest_mismatches(engine, args.groups, args.prompts)
    tolerance = calibrate(stats, horizon=args.horizon, token_margins=margins)
    hetero, s = engine.hetero, engine.settings
    measured = {
        "model": model_identity(engine),
        "scorer_precision": hetero.sampler_precision,
        "temperature": s.temperature,
        "sampler_precision": "bf16",
        "device": hetero.device,
        "weights_bf16": hetero.weights_bf16,
        "groups": len(stats),
        "group_size": s.group_size,
        "max_new_tokens": s.max_new_tokens,
        "horizon": args.horizon,
        "checkable_sampling": hetero.trust.checkable_sampling,
        "honest": honest_summary(stats),
        "command": "python -m recipe.gepo.calibrate " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
    }
    out.write_text(json.dumps(bounds_file_payload("bf16", tolerance, measured), indent=2) + "\n")
    table = TOLERANCES["bf16"]
    print(
        f"{len(stats)} honest bf16 groups ({measured['honest']['tokens']} tokens) of {measured['model']}, "
        f"re-scored in {hetero.sampler_precision} on {hetero.device}"
    )
    print(f"{'bound':<16}{'table (SmolLM2)':>18}{'calibrated':>14}")
    for field in dataclasses.fields(tolerance):
        mine, theirs = getattr(tolerance, field.name), getattr(table, field.name)
        print(
            f"{field.name:<16}{'-' if theirs is None else f'{theirs:.3g}':>18}{'-' if mine is None else f'{mine:.3g}':>14}"
        )
    print(f"wrote {out}: pass hetero.trust.bounds_file={out}")


if __name__ == "__main__":
    main()
