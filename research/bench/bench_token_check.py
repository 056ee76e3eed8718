"""What ``hetero.trust.checkable_sampling`` costs the learner per checked group, on this CPU: the
re-scoring forward (paid anyway for the log-q check) against the token check on its logits (the
seed's Gumbel noise for every response token, V draws each, and the comparison), and what it costs
the sampler (Gumbel-max generation against ordinary sampling).

    python -m research.bench.bench_token_check [--model PATH] [--group-size 8] [--tokens 64] [--groups 3]

Without ``--model``: the tiny toy model of the tests (its warm start). Prints one line per part, in
CPU seconds of this thread (whatever else shares the cores) and per group.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF folder; empty: the toy warm start")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="max new tokens a response")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the sampler's")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from recipe.gepo.embedded.policy import load_policy, sample_groups
    from verl_ext.trust.verifier import group_scores
    from verl_ext.trust.gumbel import TIE_MARGINS, check_scores, group_seed
    from verl_ext.hetero.records import RolloutGroup

    path = args.model
    if not path:
        from verl_ext.data.toy.checkpoints import warm_start

        path = str(warm_start(".cache/heterorl", digits=1, steps=50, n_eval=32, batch_size=32, warmup_steps=5))
    learner, tokenizer = load_policy(path)
    sampler, _ = load_policy(path)
    if args.precision == "bf16":
        sampler = sampler.to(torch.bfloat16)
    learner.eval(), sampler.eval()
    prompts = [f"What is {i} + {i + 3}? Answer:" for i in range(args.groups)]
    seeds = [group_seed(0, i) for i in range(args.groups)]
    t = {"sample": 0.0, "gumbel_sample": 0.0, "forward": 0.0, "check": 0.0}
    tokens = mismatches = near = 0
    for i, prompt in enumerate(prompts):
        t0 = time.thread_time()
        sample_groups(sampler, tokenizer, [prompt], args.group_size, 1.0, args.tokens, seed=i)
        t1 = time.thread_time()
        batch = sample_groups(
            sampler, tokenizer, [prompt], args.group_size, 1.0, args.tokens, seed=i, gumbel_seeds=[seeds[i]]
        )
        t2 = time.thread_time()
        keep = batch.prompt_mask[0].bool()
        group = RolloutGroup(
            f"g{i}",
            batch.prompt_ids[0][keep].numpy(),
            batch.response_ids.numpy(),
            batch.response_mask.numpy().astype(np.int8),
            batch.sampler_logprobs.numpy(),
            np.zeros(args.group_size, np.float32),
            np.zeros(args.group_size, np.float32),
            0,
            "s",
        )
        t3 = time.thread_time()
        _, logits = group_scores(learner, group, 1.0)
        t4 = time.thread_time()
        found = check_scores(
            logits, group.response_ids, group.response_mask, 1.0, seeds[i], TIE_MARGINS[args.precision]
        )
        t5 = time.thread_time()
        t["sample"] += t1 - t0
        t["gumbel_sample"] += t2 - t1
        t["forward"] += t4 - t3
        t["check"] += t5 - t4
        tokens, mismatches, near = tokens + found.tokens, mismatches + found.mismatches, near + found.near_ties
    n = args.groups
    print(
        f"model {path} (vocab {learner.config.vocab_size}), {args.precision} sampler, G={args.group_size}, "
        f"{tokens / n:.0f} response tokens a group; CPU s a group:"
    )
    print(f"  sampler: ordinary sampling {t['sample'] / n:.3f}, seeded Gumbel-max {t['gumbel_sample'] / n:.3f}")
    print(
        f"  learner: re-scoring forward {t['forward'] / n:.3f}, token check on its logits {t['check'] / n:.3f} "
        f"(+{100 * t['check'] / max(t['forward'], 1e-9):.0f}%)"
    )
    print(f"  tokens checked {tokens}, near ties {near}, mismatches {mismatches}")


if __name__ == "__main__":
    main()
