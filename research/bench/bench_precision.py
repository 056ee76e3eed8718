"""Honest log-prob spreads per sampler precision, and what the learner's tolerance makes of them.

    python -m research.bench.bench_precision [--model toy|smollm2] [--batches 8] [--prompts 16] [--out FILE]

A sampler draws groups with the model in fp32 and in bf16 (the weights cast, log q from float32
logits: ``verl_ext.sampling.generate``, as vLLM computes them); the learner re-scores the same tokens
in fp32 (``verl_ext.trust.verifier.group_log_probs``) with the weights it holds: fp32 as published,
or rounded to bf16 (``hetero.weights_bf16``). Per group: the largest and the mean |Δ log q| a token
and the mismatch KL (k3) a token (``verl_ext.trust.bounds.group_mismatch``). Beside the honest
samplers, liars on the bf16 sampler's own draws (q at temperature 0.7 for tokens drawn at 1.0, q
with a constant bias per token): for each, the share of groups the precision's per-group bounds
refuse and the checked groups until the per-sampler CUSUM fails it (``verl_ext.trust.bounds.TOLERANCES``
cites these numbers). One torch thread; ``nice`` it on a shared machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .bench_trust import SMOLLM2_TASK

REPO = Path(__file__).resolve().parents[2]

MODELS = {
    "toy": [],
    "smollm2": [
        *SMOLLM2_TASK,
        "data.max_response_length=32",
    ],
}
BIASES = (0.01, 0.03, 0.06, 0.1)


def detection(stats, precision: str) -> tuple[float, str]:
    """(share of groups the per-group bounds refuse, checked groups until the first failure of a
    sampler sending these groups in order: per-group bound or CUSUM; '-' when none fails)."""
    from verl_ext.trust.bounds import TOLERANCES, MismatchCusum, single_group_failure

    tol = TOLERANCES[precision]
    refused = sum(single_group_failure(m, tol, precision) is not None for m in stats) / len(stats)
    cusum = MismatchCusum()
    for i, m in enumerate(stats, start=1):
        if single_group_failure(m, tol, precision) is not None or cusum.add("s", m, tol, precision) is not None:
            return refused, str(i)
    return refused, "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="toy")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import torch
    from hydra import compose, initialize_config_dir

    from recipe.gepo.embedded.engine_config import EngineConfig
    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from verl_ext.trust.verifier import group_log_probs
    from verl_ext.trust.bounds import group_mismatch

    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(REPO / "recipe/gepo/config"), version_base=None):
        cfg = compose(
            config_name="gepo_trainer", overrides=["hetero.mode=async", "trainer.logger=[]", *MODELS[args.model]]
        )
    engine = EngineConfig.from_omegaconf(cfg)
    task = Task(engine.task, 0)
    path = resolve_model_path(engine.settings.model_path, engine.task, 0)
    fp32, tokenizer = load_policy(path)
    fp32.eval()
    bf16, _ = load_policy(path)
    bf16 = bf16.to(torch.bfloat16).eval()
    rounded, _ = load_policy(path)  # the learner's scorer on the bf16 wire
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in fp32.state_dict().items()})
    rounded.eval()
    s = engine.settings
    settings = RolloutSettings(s.group_size, 1.0, s.max_new_tokens)

    rows: dict[str, list] = {}

    def add(name, group, reported, scorer):
        rescored = group_log_probs(scorer, group, 1.0)
        rows.setdefault(name, []).append(group_mismatch(reported, rescored, group.response_mask))

    tokens = 0
    for b in range(args.batches):
        items = task.train_items(args.prompts, stream=5, index=b)
        for label, sampler in (("fp32", fp32), ("bf16", bf16)):
            groups = generate_groups(
                sampler,
                tokenizer,
                items,
                task.score,
                settings,
                engine.algorithm,
                policy_version=0,
                sampler_id=label,
                seed=b,
                uid_prefix=f"{label}-{b}",
            )
            for g in groups:
                add(f"honest {label}, learner fp32 weights", g, g.sampler_logprobs, fp32)
                if label == "bf16":
                    add(f"honest {label}, learner bf16-rounded weights", g, g.sampler_logprobs, rounded)
                    tokens += int(g.response_mask.sum())
                    add("liar bf16: q at T=0.7, drawn at 1.0", g, group_log_probs(bf16, g, 0.7), rounded)
                    for bias in BIASES:
                        add(f"liar bf16: q + {bias:g} a token", g, g.sampler_logprobs + bias, rounded)
                    add("liar bf16: q x 1.05", g, g.sampler_logprobs * 1.05, rounded)
                    noise = np.random.default_rng([b, len(rows)]).normal(0.0, 0.1, g.sampler_logprobs.shape)
                    add("liar bf16: q + N(0, 0.1^2) a token", g, g.sampler_logprobs + noise.astype(np.float32), rounded)
        print(f"[bench_precision] batch {b + 1}/{args.batches}", flush=True)

    lines = [
        f"{args.model}: {args.batches} x {args.prompts} groups of G={s.group_size}, {tokens} bf16 response tokens, "
        f"temperature 1.0, learner re-scoring in fp32, one torch thread",
        "",
        "| sampler | learner | max a token | median of group max | largest group mean | median group mean "
        "| largest group KL | largest / median group \\|mean signed Δ\\| | refused per group (as bf16) "
        "| checked groups to failure (as bf16) | refused per group (as fp32) | to failure (as fp32) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, stats in rows.items():
        sampler, learner = name.split(", learner ") if ", learner " in name else (name, "bf16-rounded weights")
        r16, n16 = detection(stats, "bf16")
        r32, n32 = detection(stats, "fp32")
        lines.append(
            f"| {sampler} | {learner} | {max(m.token_max for m in stats):.2g} "
            f"| {np.median([m.token_max for m in stats]):.2g} | {max(m.mean_abs for m in stats):.2g} "
            f"| {np.median([m.mean_abs for m in stats]):.2g} | {max(m.kl for m in stats):.2g} "
            f"| {max(abs(m.mean_signed) for m in stats):.2g} / {np.median([abs(m.mean_signed) for m in stats]):.2g} "
            f"| {100 * r16:.0f}% | {n16} | {100 * r32:.0f}% | {n32} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
