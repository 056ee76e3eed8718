"""Soak test of async mode: train the toy model with 3 samplers over the fs transport for a
bounded time while a separate thread injects faults at random, then account for every rollout
group by uid.

    python -m research.soak                 # 10 minutes, seed 0
    python -m research.soak --minutes 1 --seed 3 --run-dir /tmp/soak

Faults (one every ``--fault-every`` seconds on average, kind drawn at random):

- ``sampler_kill``: ``ray.kill`` a sampler actor by name (mid-generation or mid-upload); the
  engine must restart it and the restarted sampler must rejoin.
- ``rollout_{half_written,truncated,corrupt}``, ``weights_{half_written,truncated,corrupt}``:
  files written straight into the exchange folder (``<exchange>/<topic>/<key>.msg`` + the
  ``<key>.ok`` commit marker, see ``verl_ext/hetero/transport.py``): a temporary or an
  uncommitted payload, a committed payload shorter than its marker says, a payload whose bytes
  do not match the marker's SHA-256. They must never be loaded.
- ``duplicate_message``: a committed sampler message sent again byte for byte;
  ``duplicate_other_key``: the same payload under another key (uid mismatch).
- ``future_version``: a group stamped with a policy version the learner has not reached.
- ``bad_<reason>``: NaN / positive log-probs, wrong group size, an empty response, a NaN reward,
  rewards outside [0, 1] -- sent with ``verl_ext.hetero.exchange.send_group``; each must be
  rejected with that named reason.
- ``clock_skew_rollout``: a valid group sent by a transport whose clock is minutes off;
  ``clock_skew_weights``: the newest weights re-sent with a skewed sender clock (samplers read
  weights through a sender-timebase ``DelayChannel``).
- ``learner_crash`` (at most ``--learner-crashes``, only once a checkpoint exists):
  ``ray.kill`` the learner; the soak kills what the crashed run left behind and resumes from the
  checkpoint (``trainer.resume_mode=auto``).

One sampler runs 4x slower than the others (``hetero.sampler_speed_factors=[1,1,4]``). The
protections of ``hetero.trust`` run at their defaults (signed records, checks, quarantine); the
injector is an enrolled sampler (``<run dir>/enrolment.json``), so its bad groups meet validation.

``--liars``: samplers that lie join the run (``research/soak/liars.py``: q scaled, shuffled
or of another version, a newer version claimed, rewards flipped or inflated, an honest group
replayed under a new uid, q slightly scaled or at another temperature, tokens drawn from other
weights or from a truncated distribution with q true to them, a near copy of an honest group, a
version claimed the moment it is published -- each from an enrolled identity of its own -- and a
forged signature and unsigned records from outsiders), with an honest bf16 sampler among the fp32
ones, and ``hetero.trust.checkable_sampling`` on (the token lies need it). The summary adds ``poisoned groups trained on: N`` (lying
groups that reached an optimizer step; goal 0) and the seconds from each liar's first group to its
quarantine. ``honest groups rejected: N`` (honest samplers' groups refused by the signature check
or the trust gate, or purged by a quarantine; goal 0) is printed by every soak.

``--wan`` (opt-in; needs root / CAP_NET_ADMIN, refused clearly without it): the samplers run on
the sampler node of research/testbeds/wan/cluster.py (a Ray worker in its own network namespace behind a
rate-limited veth pair, ``--wan-rate-mbit``), the learner and the Ray transport's mailbox on the
head, so weights and rollouts cross the link (``hetero.transport=ray``, ``hetero.ray_address``,
``hetero.{learner,sampler}_ray_resources``). The file-level faults (``rollout_*``, ``weights_*``)
need the fs transport and are left out; three network faults join the others:

- ``link_cut``: nothing crosses the link for ``--wan-cut-s`` seconds (``link.py cut``/``heal``);
- ``link_slow``: the link's rate drops 100x for ``--wan-cut-s`` seconds (``link.py set-rate``);
- ``worker_gone``: the sampler node's Ray processes end and its namespace and veth pair are
  deleted for 20 s (``cluster.py worker-gone``), then rebuilt and a new node joins. The head's
  address lives on the link's bridge, so the head's own connections survive the gap.

After each, if the head has declared the sampler node dead (a cut longer than Ray's health
check), the node is started again as an operator's supervisor would (recorded in the fault). A
network fault survives when the learner trains at least ``max_delay + 1`` more versions after it.
The cluster is torn down at the end (``cluster.py down``).

At the end: every group a sampler committed to the exchange (seen by a watcher thread that
scans the rollouts folder every 50 ms, plus every sampler uid in the learner's ledger) must be
consumed, dropped with a reason, rejected with a reason, still buffered, or still in the
transport; a uid committed twice with different content counts as a lost group (one of the two
cannot be used); consumed groups must match the per-step ``hetero/consumed`` metrics (nothing
consumed twice). Exit status 1 if any group was lost, anything was consumed twice, an honest group was
rejected, a poisoned group was trained on, or the run failed; 0 otherwise.

The harness itself, by concern (config, faults, injector, watchers, the WAN link, the run, the
checks after it, the report), is the package ``research/soak/``.
"""

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
