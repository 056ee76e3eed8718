"""Forward + backward time of every policy loss, as a ratio to verl's vanilla loss in the same run.

    python -m scripts.bench.bench_losses [--batch 256] [--length 4096] [--repeats 10] [--out docs/bench_losses.md]

Every loss the project registers (``verl_ext.algos.registry.HETERORL_LOSS_MODES``) and every verl
loss a preset of ``recipe/gepo/config/algorithm_preset`` uses (tests/algos/test_bench_losses.py
keeps the list complete); verl's other registered losses, which no preset uses, are not timed.

Each loss is called exactly as verl's ``ppo_loss`` calls it (registry lookup, keyword arguments,
an ``ActorConfig`` from the recipe's presets), on float32 tensors with a realistic mask (response
lengths uniform in [T/4, T]). Times are medians over ``--repeats`` after two warm-up calls; losses
are interleaved round-robin so drift on a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "gepo" / "config"
# (row label, preset, loss mode); the first row is the baseline of the ratios
LOSSES = [
    ("vanilla (GRPO)", "grpo", "vanilla"),
    ("gepo", "gepo", "gepo"),
    ("eqp", "gepo", "eqp"),
    ("gepo_adaptive", "gepo", "gepo_adaptive"),
    ("gepo_tr", "gepo_tr", "gepo_tr"),
    ("gepo_tc", "gepo_tc", "gepo_tc"),
    # the same loss mode, but the ESS-scaled band computes the batch's ESS first
    ("gepo_tc (ESS bound)", "gepo_tc_ess", "gepo_tc"),
    ("gspo", "gspo", "gspo"),
    ("geo_mean (GMPO)", "gmpo", "geo_mean"),
    ("cispo", "cispo", "cispo"),
    ("topr", "topr", "topr"),
    ("delta_l", "delta_l", "delta_l"),
    ("m2po", "m2po", "m2po"),
    ("vespo", "vespo", "vespo"),
]


def actor_config(preset: str, loss_mode: str, group_size: int):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(
            config_name="gepo_trainer",
            overrides=[
                f"algorithm_preset={preset}",
                f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
                f"actor_rollout_ref.rollout.n={group_size}",
            ],
        )
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def make_batch(batch: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 3
    new = old + 0.05 * torch.randn(batch, length, generator=gen)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(batch, 1, generator=gen).expand(-1, length).contiguous()
    return old, new, adv, mask


def time_once(fn, config, old, new, adv, mask) -> float:
    log_prob = new.clone().requires_grad_(True)
    start = time.perf_counter()
    loss, _ = fn(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
    )
    loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256, help="sequences B")
    parser.add_argument("--length", type=int, default=4096, help="response tokens T")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt G")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1 (a median of timed calls)")
    if args.group_size < 1 or args.batch % args.group_size:
        parser.error(
            f"--batch {args.batch} --group-size {args.group_size}: the group losses need whole prompt "
            "groups, so the batch must be a positive multiple of the group size"
        )

    old, new, adv, mask = make_batch(args.batch, args.length)
    entries = [
        (label, get_policy_loss_fn(mode), actor_config(preset, mode, args.group_size)) for label, preset, mode in LOSSES
    ]
    times: dict[str, list[float]] = {label: [] for label, _, _ in entries}
    for round_ in range(args.repeats + 2):
        for label, fn, cfg in entries:
            elapsed = time_once(fn, cfg, old, new, adv, mask)
            if round_ >= 2:
                times[label].append(elapsed)

    base = statistics.median(times[LOSSES[0][0]])
    lines = [
        f"B={args.batch}, T={args.length}, G={args.group_size}, float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
        f"median of {args.repeats} forward+backward calls",
        "",
        "| loss | median ms | ratio to vanilla |",
        "|---|---:|---:|",
    ]
    for label, _, _ in entries:
        med = statistics.median(times[label])
        lines.append(f"| {label} | {med * 1e3:.1f} | {med / base:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
