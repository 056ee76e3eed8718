"""Lying sampler pools for the verl engine: the real pool program (recipe/gepo/pool.py: verl's rollout
servers and agent loop) whose groups go out under lying identities in turn (``pool-60`` on), each telling
one lie of :data:`POOL_LIES` on every group it sends (a patient one honest for its first
``PATIENT_HONEST_GROUPS``), beside an honest pool (``pool-32``), into one verl-engine learner.

    python -m research.soak.pool_liars --steps 16 --out runs/pool_liars

Judged from the learner's audit (``pool_trained.jsonl``), its events.jsonl and log, and the liar's own
record of what it sent: ``poisoned groups trained on`` (lying groups in the audit), ``honest groups
rejected`` (the honest pool named in a refusal for a trust reason, or quarantined), each liar's
quarantine, and none trained twice. The lies are :mod:`.lies`'s and :mod:`.liars`' kinds.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from . import lies
from .checks import TRUST_REASONS
from .liars import PATIENT_HONEST_GROUPS, PATIENT_PREFIX, SLIGHT_SCALE, lie_of

ROOT = Path(__file__).resolve().parents[2]
HONEST_INDEX, LIAR_INDEX = 32, 60
POOL_LIES = (
    "q_scaled",
    "q_scaled_slightly",
    "reward_flip",
    "reward_inflate",
    "replay",
    "near_copy",
    "malformed",
    "patient_q_scaled",
    "patient_reward_flip",
    "forged_signature",
    "unsigned",
)
"""The lies a pool can tell without a model of its own (the embedded soak's crew has more)."""
COPIES = ("replay", "near_copy")
"""The lies that send another pool's group (read from the exchange for them only)."""
OUTSIDERS = ("forged_signature", "unsigned")
"""A key nobody enrolled; no signature at all."""


def liar_id(kind: str) -> str:
    return f"pool-{LIAR_INDEX + 1 + POOL_LIES.index(kind)}"


def lied(kind: str, group: Any, honest: Optional[Any], vocab_size: int) -> Optional[Any]:
    """``group`` with lie ``kind`` told (``honest``: another pool's group, for the copies); None when
    the lie cannot be told yet (no honest group to copy)."""
    lie = lie_of(kind)
    if lie == "q_scaled":
        return lies.scaled_q(group, 1.5)
    if lie == "q_scaled_slightly":
        return lies.scaled_q(group, SLIGHT_SCALE)
    if lie == "reward_flip":
        return dataclasses.replace(group, rewards=(1.0 - group.rewards).astype(np.float32))
    if lie == "reward_inflate":
        return dataclasses.replace(group, rewards=np.ones_like(group.rewards))
    if lie in COPIES:
        if honest is None:
            return None
        if lie == "near_copy":
            return lies.near_copy(honest, group.group_uid, group.sampler_id)
        return dataclasses.replace(honest, group_uid=group.group_uid, sampler_id=group.sampler_id)
    if lie == "malformed":
        ids = np.array(group.response_ids, copy=True)
        ids[0, 0] = vocab_size  # no embedding row: it must not crash anything
        return dataclasses.replace(group, response_ids=ids)
    return group  # forged_signature, unsigned: honest content, the lie is in the envelope


def make_liar_pool(keys_dir: Path, record: Path):
    """The builder ``recipe.gepo.pool.run_pool`` calls: a :class:`~recipe.gepo.pool.Pool` whose
    groups go out under the lying identities in turn, each recorded in ``record`` (JSON lines)."""
    from recipe.gepo.pool import Pool
    from verl_ext.hetero.exchange import send_group
    from verl_ext.hetero.protocol import ROLLOUT_TOPIC
    from verl_ext.hetero.records import RolloutGroup
    from verl_ext.trust.signing import SamplerKey, unverified_record

    class LiarPool(Pool):
        turns = itertools.cycle(POOL_LIES)
        told: Counter = Counter()

        def honest_group(self) -> Optional[RolloutGroup]:
            for uid in sorted(self.transport.keys(ROLLOUT_TOPIC), reverse=True):
                if uid.startswith(f"r{HONEST_INDEX}-"):
                    try:
                        return RolloutGroup.from_bytes(unverified_record(self.transport.get(ROLLOUT_TOPIC, uid)))
                    except (KeyError, ValueError):
                        continue
            return None

        def send(self, group: RolloutGroup) -> None:
            kind = next(self.turns)
            identity = liar_id(kind)
            group = dataclasses.replace(group, sampler_id=identity)
            honest_now = kind.startswith(PATIENT_PREFIX) and self.told[kind] < PATIENT_HONEST_GROUPS
            honest = self.honest_group() if lie_of(kind) in COPIES and not honest_now else None
            out = group if honest_now else lied(kind, group, honest, self.vocab_size)
            if out is None:
                return
            key = None if kind == "unsigned" else SamplerKey.load(keys_dir / f"{identity}.key")
            send_group(self.transport, out, key=key)
            self.told[kind] += 1
            with record.open("a") as f:
                f.write(json.dumps({"uid": out.group_uid, "kind": kind, "lie": not honest_now}) + "\n")

    def build(settings, index, key, speed_factor):
        pool = LiarPool(settings, index, key, speed_factor)
        from verl.utils import hf_tokenizer

        pool.vocab_size = len(hf_tokenizer(settings.actor_rollout_ref.model.path))
        return pool

    return build


def make_keys(out: Path, env: dict) -> tuple[Path, Path]:
    """Keys of the honest pool and of every liar identity under ``out/keys``; the enrolment file
    with the insiders' (an operator enrolled them), not the outsiders'."""
    keys, enrolment = out / "keys", out / "enrolment.json"
    keys.mkdir(parents=True, exist_ok=True)
    ids = [f"pool-{HONEST_INDEX}", f"pool-{LIAR_INDEX}", *(liar_id(k) for k in POOL_LIES if k != "unsigned")]
    for sampler in ids:
        public = subprocess.run(
            [sys.executable, "-m", "verl_ext.trust.signing", "keygen", str(keys / f"{sampler}.key"), sampler],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        if sampler != liar_id("forged_signature"):
            subprocess.run([sys.executable, "-m", "verl_ext.trust.signing", "enrol", str(enrolment), sampler, public],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    return keys, enrolment


def judge(out: Path) -> dict[str, Any]:
    run = out / "run"
    audit = [json.loads(line) for line in (run / "pool_trained.jsonl").read_text().splitlines()]
    trained = [g for row in audit for g in row["groups"]]
    sent = [json.loads(line) for line in (out / "liar_sent.jsonl").read_text().splitlines()]
    lying = {row["uid"]: row["kind"] for row in sent if row["lie"]}
    events = (
        [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        if (run / "events.jsonl").is_file()
        else []
    )
    quarantined = {e["sampler_id"]: e["reason"] for e in events if e.get("event") == "quarantined"}
    log = (out / "learner.log").read_text()
    honest = f"pool-{HONEST_INDEX}"
    named = re.findall(rf"refused {honest}'s groups \((\w+);", log)
    return {
        "steps": len(audit),
        "trained": len(trained),
        "trained_twice": len(trained) - len(set(trained)),
        "poisoned groups trained on": Counter(lying[g] for g in trained if g in lying),
        "honest groups rejected": sorted(r for r in named if r in TRUST_REASONS) + (["quarantined"] if honest in quarantined else []),
        "honest refusals without blame": sorted(r for r in named if r not in TRUST_REASONS),
        "lies sent": Counter(lying.values()),
        "liars quarantined": {k: quarantined.get(liar_id(k)) for k in POOL_LIES},
        "refusals named": sorted(set(re.findall(r"refused (pool-\d+)'s groups \((\w+);", log))),
        "trained by pool": Counter(g.split("-")[0] for g in trained),
    }  # fmt: skip


def run(out: Path, steps: int, overrides: Sequence[str] = ()) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    keys, enrolment = make_keys(out, env)
    shared = [
        "+verl_preset=cpu_toy", "hetero.engine=verl", "hetero.transport=fs", f"hetero.transport_url={out / 'x'}",
        "hetero.delay.dist=none", "hetero.max_delay=2", f"trainer.default_local_dir={out / 'run'}",
        "hetero.max_queued_groups=8", *overrides,
    ]  # fmt: skip
    procs = {}
    logs = {name: open(out / f"{name}.log", "w") for name in ("learner", "honest", "liar")}
    try:
        procs["learner"] = subprocess.Popen(
            [sys.executable, "-m", "recipe.gepo.main_gepo", "--config-dir", "configs", *shared,
             f"hetero.trust.enrolment_file={enrolment}", f"trainer.total_training_steps={steps}"],
            cwd=ROOT, env=env, stdout=logs["learner"], stderr=subprocess.STDOUT)  # fmt: skip
        time.sleep(5)  # the learner clears the exchange's old groups when it starts
        procs["honest"] = subprocess.Popen(
            [sys.executable, "-m", "recipe.gepo.pool", "--index", str(HONEST_INDEX),
             "--key", str(keys / f"pool-{HONEST_INDEX}.key"), *shared],
            cwd=ROOT, env=env, stdout=logs["honest"], stderr=subprocess.STDOUT)  # fmt: skip
        procs["liar"] = subprocess.Popen(
            [sys.executable, "-m", "research.soak.pool_liars", "liar", "--keys", str(keys),
             "--record", str(out / "liar_sent.jsonl"), *shared],
            cwd=ROOT, env=env, stdout=logs["liar"], stderr=subprocess.STDOUT)  # fmt: skip
        rc = procs["learner"].wait(timeout=900 + 120 * steps)
        for name in ("honest", "liar"):
            procs[name].wait(timeout=300)  # the learner's stop marker ends them
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for f in logs.values():
            f.close()
    return {"learner_rc": rc, **judge(out)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["liar"]:  # the lying pool, started by run()
        liar = argparse.ArgumentParser(prog="pool_liars liar")
        liar.add_argument("--keys", type=Path, required=True)
        liar.add_argument("--record", type=Path, required=True)
        liar.add_argument("overrides", nargs="*")
        args = liar.parse_args(argv[1:])
        from recipe.gepo.pool import run_pool
        from recipe.gepo.remote_sampler import compose_config

        cfg = compose_config(["hetero.engine=verl", "hetero.transport=fs", *args.overrides])
        key = str(args.keys / f"pool-{LIAR_INDEX}.key")
        counters = run_pool(cfg, LIAR_INDEX, key, None, make_pool=make_liar_pool(args.keys, args.record))
        print(json.dumps({"pool": LIAR_INDEX, **counters}), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="pool_liars", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("runs/pool_liars"))
    parser.add_argument("overrides", nargs="*", help="hydra overrides for learner and pools")
    args = parser.parse_args(argv)
    report = run(args.out.resolve(), args.steps, args.overrides)
    print(json.dumps(report, indent=1, default=dict))
    bad = (
        sum(report["poisoned groups trained on"].values())
        or report["honest groups rejected"]
        or report["trained_twice"]
    )
    return 1 if bad or report["learner_rc"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
