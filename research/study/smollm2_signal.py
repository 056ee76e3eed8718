"""Does SmolLM2-135M-Instruct get a learning signal on easy GSM8K? Reward statistics per candidate
task (prompt filter x prompt template x temperature), measured with the plain HF model, no verl.

    OMP_NUM_THREADS=1 python -m research.study.smollm2_signal [--prompts 16] [--group 4] [--only NAME ...]

For each candidate, G responses to each of the same N training prompts are sampled exactly as the
``hf_cpu`` sampler does (``verl_ext.sampling.sample_continuations``, left-padded batches, eos
``<|im_end|>``) and scored by the reward the ``cpu_smollm2_math`` preset trains with (the dispatch's
math reward: math_verify accuracy + ``--boxed-weight`` x "has a complete \\boxed{}"). GRPO-style
advantages are zero for a group whose G rewards are all equal, so the column that matters is
``var>0``: the fraction of groups with non-zero reward variance (``acc var>0``: from accuracy alone).

Prints one markdown table row per candidate, with the machine's load average. The model folder is
the cached conversion (``python -m verl_ext.data.smollm2``; made on first use).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

#: the GSM8K difficulty filter the cpu_smollm2_math preset trains on (verl_ext.data.datasets)
EASY = {"max_steps": 2, "max_answer": 100, "max_question_chars": 200}


@dataclass(frozen=True)
class Candidate:
    name: str
    template: str
    temperature: float
    filters: dict = field(default_factory=dict)


CANDIDATES = (
    Candidate("all / chat / T=1.0", "chat", 1.0),
    Candidate("easy / chat / T=1.0", "chat", 1.0, EASY),
    Candidate("easy / chat_1shot / T=1.0", "chat_1shot", 1.0, EASY),
    Candidate("easy / chat_1shot / T=0.7", "chat_1shot", 0.7, EASY),
    Candidate("easy / chat_1shot / T=0.5", "chat_1shot", 0.5, EASY),
)


def measure(
    model,
    tokenizer,
    cand: Candidate,
    n_prompts: int,
    group: int,
    max_new_tokens: int,
    boxed_weight: float,
    batch: int,
    seed: int,
) -> dict:
    from verl_ext.data.datasets import load_benchmark
    from verl_ext.data.templates import render_prompt
    from verl_ext.rewards.dispatch import score_batch
    from verl_ext.sampling import sample_continuations

    pool = load_benchmark("gsm8k", split="train", **cand.filters)
    picks = np.random.default_rng(seed).choice(len(pool), size=n_prompts, replace=False)
    items = [pool[i] for i in picks]
    prompts = [
        tokenizer(render_prompt(it["problem"], cand.template, tokenizer), add_special_tokens=False)["input_ids"]
        for it in items
    ]
    flat = [p for p in prompts for _ in range(group)]
    eos = [tokenizer.eos_token_id]
    t0 = time.monotonic()
    outs = []
    for start in range(0, len(flat), batch):
        outs += sample_continuations(
            model,
            flat[start : start + batch],
            max_new_tokens,
            eos,
            tokenizer.pad_token_id,
            temperature=cand.temperature,
            generator_seed=seed + start,
        )
    seconds = time.monotonic() - t0
    texts = [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    golds = [it["answer"] for it in items for _ in range(group)]
    results = score_batch("gsm8k", texts, golds, boxed_weight=boxed_weight)
    reward = np.array([r["score"] for r in results]).reshape(n_prompts, group)
    acc = np.array([r["acc"] for r in results]).reshape(n_prompts, group)
    boxed = np.array([r["format_boxed"] for r in results])
    return {
        "pool": len(pool),
        "prompt_tokens_max": max(len(p) for p in prompts),
        "reward_mean": reward.mean(),
        "acc_mean": acc.mean(),
        "boxed": boxed.mean(),
        "var_groups": float((reward.std(axis=1) > 0).mean()),
        "acc_var_groups": float((acc.std(axis=1) > 0).mean()),
        "resp_tokens_mean": float(np.mean([len(o.token_ids) for o in outs])),
        "truncated": float(np.mean([not o.finished for o in outs])),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per candidate")
    parser.add_argument("--group", type=int, default=4, help="responses per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="the preset's data.max_response_length")
    parser.add_argument("--boxed-weight", type=float, default=0.1, help="the preset's reward_kwargs.boxed_weight")
    parser.add_argument("--batch", type=int, default=16, help="sequences per generate call")
    parser.add_argument("--seed", type=int, default=0, help="prompt choice and sampling seed")
    parser.add_argument("--cache-dir", default=".cache/heterorl", help="task.cache_dir (the converted model)")
    parser.add_argument("--only", nargs="*", default=None, help="candidate names to run (default: all)")
    args = parser.parse_args(argv)
    names = [c.name for c in CANDIDATES]
    if args.only and set(args.only) - set(names):
        parser.error(f"unknown candidate(s) {sorted(set(args.only) - set(names))}; known: {names}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_ext.data.smollm2 import prepare_smollm2

    folder = prepare_smollm2(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    print(
        f"model {folder}, torch threads {torch.get_num_threads()}, {args.prompts} prompts x G={args.group}, "
        f"{args.max_new_tokens} new tokens, reward = acc + {args.boxed_weight} x boxed\n"
    )
    print(
        "| candidate (filter / template / T) | pool | prompt tok max | reward mean | acc | boxed | var>0 | "
        "acc var>0 | resp tok | truncated | s | load avg before -> after |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for cand in CANDIDATES:
        if args.only and cand.name not in args.only:
            continue
        before = os.getloadavg()[0]
        r = measure(
            model,
            tokenizer,
            cand,
            args.prompts,
            args.group,
            args.max_new_tokens,
            args.boxed_weight,
            args.batch,
            args.seed,
        )
        after = os.getloadavg()[0]
        print(
            f"| {cand.name} | {r['pool']} | {r['prompt_tokens_max']} | {r['reward_mean']:.3f} | {r['acc_mean']:.3f} | "
            f"{r['boxed']:.2f} | {r['var_groups']:.2f} | {r['acc_var_groups']:.2f} | {r['resp_tokens_mean']:.0f} | "
            f"{r['truncated']:.2f} | {r['seconds']:.0f} | {before:.2f} -> {after:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
