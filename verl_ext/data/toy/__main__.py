"""``python -m verl_ext.data.toy --cache-dir DIR [--digits 3] [--steps N] [--seed 0] [--answer-format short] [--train]``:
find the pinned warm start (shipped with the package, or in the cache) or train it, and print its folder,
accuracy, time and weights' sha256; ``--train`` trains even where the package ships one (this CPU's build)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from verl_ext.data.toy.checkpoints import DEFAULT_WARM_START_STEPS, WARM_START_INFO, warm_start
from verl_ext.data.toy.problems import ANSWER_FORMATS


def main(argv: list[str] | None = None) -> int:
    defaults = ", ".join(f"{k} {v}" for k, v in DEFAULT_WARM_START_STEPS.items())
    parser = argparse.ArgumentParser(prog="python -m verl_ext.data.toy", description="toy addition warm start")
    parser.add_argument("--cache-dir", required=True, help="folder for cached checkpoints")
    parser.add_argument("--digits", type=int, default=3, help="operand digits")
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default per format: {defaults})")
    parser.add_argument("--seed", type=int, default=0, help="seed of init, data and evaluation")
    parser.add_argument("--answer-format", default="short", choices=ANSWER_FORMATS, help="short sums or scratchpad")
    parser.add_argument(
        "--train",
        action="store_true",
        help="train (or take from the cache) this machine's build even where the package ships one",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    path = warm_start(
        args.cache_dir,
        args.digits,
        steps=args.steps,
        seed=args.seed,
        answer_format=args.answer_format,
        use_shipped=not args.train,
    )
    info = json.loads((path / WARM_START_INFO).read_text())
    print(
        f"{path}\naccuracy {info['accuracy']:.3f}, {info['steps']} steps, training {info['seconds']:.1f} s wall / "
        f"{info['cpu_seconds']:.1f} s CPU; this call {time.monotonic() - t0:.1f} s"
    )
    print(f"weights sha256 {info['weights_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
