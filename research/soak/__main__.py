"""Soak test of async mode: train the toy model with 3 samplers (one 4x slower) over the fs transport
for a bounded time while a thread injects faults at random, then account for every rollout group by uid.

    python -m research.soak                 # 10 minutes, seed 0
    python -m research.soak --minutes 1 --seed 3 --run-dir /tmp/soak
    python -m research.soak --liars         # samplers that lie join the run (liars.py)
    sudo .venv/bin/python -m research.soak --wan   # samplers across a real rate-limited link

Every group a sampler committed must be consumed, dropped or rejected with a reason, buffered, or
still in the transport, and consumed at most once (the ``hetero/consumed`` metrics). Exit status 1
if any group was lost or consumed twice, an honest group was rejected, poisoned groups were trained
on beyond their lie's bound, or the run failed; 2 for what it refuses before touching anything (``--wan`` without the
network privileges, an unbounded link cut, no checkpoints); 0 otherwise. The fault kinds, the
liars, the network faults and the runs' results: docs/reliability.md. The harness, by concern, is
this package (``research/soak/``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m research.soak ...")
from .report import report  # noqa: E402
from .wan_link import WanLink  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    wan = WanLink(args.wan_rate_mbit, args.wan_cut_s) if args.wan else None
    if wan is not None:
        refusal = wan.refusal()
        if refusal:
            print(f"soak --wan: {refusal}", file=sys.stderr)
            return 2
        wan.up()
    try:
        from .run import soak  # imports Ray: after wan.up() set the cluster's auth environment

        result = soak(
            args.minutes,
            args.seed,
            args.run_dir,
            args.fault_every,
            args.learner_crashes,
            args.save_freq,
            overrides=args.overrides,
            wan=wan,
            liars=args.liars,
        )
    finally:
        if wan is not None:
            wan.down()
    report(result)
    return 0 if result.ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m research.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="fault schedule and run seed")
    parser.add_argument("--run-dir", type=Path, default=None, help="default /tmp/heterorl-soak-<seed>-<time>")
    parser.add_argument("--fault-every", type=float, default=5.0, help="mean seconds between faults (default 5)")
    parser.add_argument("--learner-crashes", type=int, default=2, help="learner kills, after a checkpoint (default 2)")
    parser.add_argument("--save-freq", type=int, default=5, help="checkpoint every k steps (default 5)")
    parser.add_argument(
        "--liars",
        action="store_true",
        help="lying samplers join the run (research/soak/liars.py); the summary counts poisoned groups trained on",
    )
    parser.add_argument(
        "--wan",
        action="store_true",
        help="samplers across the real rate-limited link of research/testbeds/wan (needs CAP_NET_ADMIN)",
    )
    parser.add_argument("--wan-rate-mbit", type=float, default=100.0, help="--wan: link rate (default 100)")
    parser.add_argument(
        "--wan-cut-s",
        type=float,
        default=20.0,
        help="--wan: a link cut / slow spell lasts this to 1.5x this many seconds (default 20)",
    )
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides, e.g. hetero.max_delay=2")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.minutes > 0:
        parser.error(f"--minutes={args.minutes} must be > 0")
    if not args.fault_every > 0:
        parser.error(f"--fault-every={args.fault_every} must be > 0")
    if args.save_freq < 1:
        # the accounting reads the ledger of a checkpoint (the live learner is gone when the time
        # limit ends the run), and without checkpoints the learner deletes consumed groups at once
        parser.error(
            f"--save-freq={args.save_freq} must be >= 1: the soak accounts for every group from a checkpoint's ledger"
        )
    if args.wan and not 0 < args.wan_cut_s <= 120:
        parser.error(f"--wan-cut-s={args.wan_cut_s} must be in (0, 120] (bounded faults only)")


if __name__ == "__main__":
    sys.exit(main())
