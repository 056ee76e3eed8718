"""The initial sampled accuracy of SmolLM2-135M-Instruct on the held-out easy GSM8K problems, as the
embedded engine samples it (its ``Task`` and ``sample_groups``): the reward signal the GPU lane's
``embedded_smollm2`` part starts from, for a prompt template.

    OMP_NUM_THREADS=1 python research/gpu_lane/smollm2_prompt_signal.py --template chat_1shot
    OMP_NUM_THREADS=1 python research/gpu_lane/smollm2_prompt_signal.py --template qwen3_nothink

Prints one line: accuracy (math_verify), the share of complete ``\\boxed{}`` answers, the share of
groups with reward variance. CPU by default (slow: docs/gpu.md gives a run's time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EASY = {"max_steps": 2, "max_answer": 100, "max_question_chars": 200}  # configs/verl_preset/cpu_smollm2_math.yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", default="chat_1shot", help="task.template (verl_ext/data/templates.py)")
    parser.add_argument("--problems", type=int, default=16, help="the first N easy GSM8K test problems")
    parser.add_argument("--group", type=int, default=4, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", default=".cache/heterorl")
    args = parser.parse_args(argv)

    from recipe.gepo.embedded.policy import load_policy, sample_groups
    from recipe.gepo.embedded.tasks import Task
    from recipe.gepo.sections import TaskConfig
    from verl_ext.data.smollm2 import prepare_smollm2
    from verl_ext.rewards.dispatch import score_batch

    model, tokenizer = load_policy(str(prepare_smollm2(args.cache_dir)))
    model.to(torch.device(args.device)).eval()
    task = Task(
        TaskConfig(
            name="math",
            dataset="gsm8k",
            dataset_options={**EASY, "split": "train"},
            eval_dataset="gsm8k",
            eval_dataset_options={**EASY, "split": "test"},
            eval_size=args.problems,
            template=args.template,
        ),
        seed=0,
        tokenizer=tokenizer,
    )
    items, texts = task.eval_items, []
    t0 = time.time()
    for start in range(0, len(items), 4):
        chunk = [it["prompt"] for it in items[start : start + 4]]
        texts += sample_groups(
            model, tokenizer, chunk, args.group, args.temperature, args.max_new_tokens, seed=start
        ).texts
    seconds = time.time() - t0
    golds = [it["answer"] for it in items for _ in range(args.group)]
    results = score_batch(task.data_source, texts, golds, boxed_weight=0.1)
    acc = np.array([r["acc"] for r in results]).reshape(len(items), args.group)
    boxed = float(np.mean([r["format_boxed"] for r in results]))
    print(
        f"template={args.template}: {len(items)} held-out easy GSM8K test problems x {args.group}, "
        f"T={args.temperature}, <= {args.max_new_tokens} new tokens, {args.device}: accuracy {acc.mean():.4f} "
        f"({int(acc.sum())}/{acc.size}), boxed {boxed:.3f}, groups with reward variance {(acc.std(1) > 0).mean():.3f}, "
        f"{seconds:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
