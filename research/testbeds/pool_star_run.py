"""The verl engine's learner and two sampler pools on the star (:mod:`.pool_star`), with faults,
judged by the transport's acknowledgements: every group a pool sent is trained once or still on
the exchange; none lost, none trained twice.

    python -m research.testbeds.pool_star_run --steps 24 --rate-mbit 100 --out runs/star [--no-faults]

Faults, in order (``FAULTS``), each while the learner trains and the pools it hits send: pool 1
joins late; pool 0 is killed (its node's processes, SIGKILL) and started again; pool 1's link is cut
for 30 s, then healed; the exchange server is killed with its sessions and restarted; the learner
node is killed and the learner resumed from its checkpoint while the pools keep generating. The run
needs steps enough for all of them (24 on this 2-core VM). Prints one JSON report (also
``report.json`` under ``--out``); exit status 1 when a group was lost or trained twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from . import pool_star as star
from . import slurm_cluster as sc

ROOT = Path(__file__).resolve().parents[2]
POOL_INDEX = {"pool0": 32, "pool1": 33}
FAULTS = (
    "pool1 joins late",  # at step 1
    "pool0 killed and restarted",  # at step 2, once pool 0 has sent two batches
    "pool1 link cut 30 s",  # once pool 1 (joined late) has sent two batches
    "exchange server restarted",  # a step later
    "learner killed and resumed",  # a step later, the link healed, the restarted pool 0 sending
)
CUT_S, EXCHANGE_DOWN_S, POOL_DOWN_S = 30.0, 5.0, 5.0


class Star:
    """The processes of one run: the learner and the pools, each in its node, logs under ``out``."""

    def __init__(self, out: Path, steps: int, env: dict, shared: list[str], keys: dict[str, Path], enrolment: Path,
                 slow_factor: float = 1.0):  # fmt: skip
        self.out, self.steps, self.env, self.shared, self.keys = out, steps, env, shared, keys
        self.slow_factor = slow_factor
        self.enrolment = enrolment
        self.procs: dict[str, subprocess.Popen] = {}
        self.launches: dict[str, int] = {}

    def _start(self, role: str, argv: list[str]) -> None:
        n = self.launches[role] = self.launches.get(role, 0) + 1
        log = open(self.out / f"{role}.{n}.log", "w")
        self.procs[role] = subprocess.Popen(star.in_node(role, argv), cwd=ROOT, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        log.close()

    def start_learner(self) -> None:
        self._start("learner", [
            sys.executable, "-m", "recipe.gepo.main_gepo", "--config-dir", "configs", *self.shared,
            f"hetero.trust.enrolment_file={self.enrolment}", f"trainer.total_training_steps={self.steps}",
            "trainer.save_freq=1",
        ])  # fmt: skip

    def start_pool(self, role: str) -> None:
        index = POOL_INDEX[role]
        speed = self.slow_factor if role == "pool1" else 1.0  # pool 1 on slower hardware
        self._start(role, [sys.executable, "-m", "recipe.gepo.pool", "--index", str(index), "--speed-factor", str(speed),
                           "--key", str(self.keys[role]), *self.shared])  # fmt: skip

    def kill_node(self, role: str) -> None:
        """Every process in the node's namespace, SIGKILL: the node lost its power."""
        for pid in sc.netns_pids(star.netns(role)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[role].wait(timeout=60)

    def batches_sent(self, role: str) -> int:
        """Batch lines in the log of ``role``'s current launch."""
        log = self.out / f"{role}.{self.launches.get(role, 0)}.log"
        return log.read_text().count("] batch ") if log.is_file() else 0

    def step(self) -> int:
        metrics = self.out / "run" / "metrics.jsonl"
        if not metrics.is_file():
            return 0
        return max((json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()), default=0)


def _keys(out: Path, env: dict) -> tuple[dict[str, Path], Path]:
    keys, enrolment = {}, out / "enrol.json"
    for role, index in POOL_INDEX.items():
        keys[role] = out / f"pool-{index}.key"
        run = lambda *a: subprocess.run([sys.executable, "-m", "verl_ext.trust.signing", *a],  # noqa: E731
                                        cwd=ROOT, env=env, capture_output=True, text=True, check=True)  # fmt: skip
        public = run("keygen", str(keys[role]), f"pool-{index}").stdout.strip()
        run("enrol", str(enrolment), f"pool-{index}", public)
    return keys, enrolment


def sent_groups(logs: list[Path]) -> tuple[set[str], set[str]]:
    """Groups a pool's logs say it sent: (surely sent, maybe sent). A batch line is printed before
    its groups go out, so the last batch of a launch that was killed is only maybe sent."""
    sure, maybe = set(), set()
    for log in logs:
        text = log.read_text()
        launch, batches = None, []
        for line in text.splitlines():
            if m := re.search(r"\] up: exchange .*, launch (\S+), starting", line):
                launch = m.group(1)
            elif (m := re.search(r"\] batch (\d+): (\d+) groups", line)) and launch:
                batches.append((int(m.group(1)), int(m.group(2))))
        finished = '"pool":' in text.strip().splitlines()[-1] if text.strip() else False
        for k, (b, n) in enumerate(batches):
            names = {f"{launch}-b{b}-{i}" for i in range(n)}
            (sure if finished or k < len(batches) - 1 else maybe).update(names)
    return sure, maybe


BATCH_SENT = r"\] batch \d+: \d+ groups, version (\d+) \(published ([\d.]+) s before\)"
LOADED = r"\] version (\d+) loaded, ([\d.]+) s after it was published"


def lag_per_version(logs: list[Path], pattern: str = BATCH_SENT) -> dict:
    """Seconds from the learner publishing a version to the first batch sent with it, per version
    (the earliest over the pools), from the pools' batch lines; their median and range. With
    :data:`LOADED`: to the version being loaded into a pool's servers."""
    first: dict[int, float] = {}
    for log in logs:
        for m in re.finditer(pattern, log.read_text()):
            version, age = int(m.group(1)), float(m.group(2))
            first[version] = min(age, first.get(version, age))
    later = [age for version, age in first.items() if version > 0]  # version 0 waits for the pools to start
    if not later:
        return {}
    return {"versions": len(later), "median": statistics.median(later), "min": min(later), "max": max(later)}


def run(
    out: Path,
    steps: int,
    rate_mbit: float,
    faults: bool,
    pools: int = 2,
    slow_factor: float = 1.0,
    overrides: Sequence[str] = (),
) -> dict:
    """One run (see the module docstring); ``pools``: 1 or 2 without faults (the faults need both)."""
    if faults and pools != 2:
        raise ValueError(f"--pools {pools}: the fault schedule needs both pools")
    shutil.rmtree(out, ignore_errors=True)  # the run's own folder: keys, logs, run dir
    out.mkdir(parents=True)
    srv = star.up(rate_mbit)
    name = f"star-{int(time.time())}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **srv.client_env())
    shared = [
        "+verl_preset=cpu_toy", "hetero.engine=verl", "hetero.transport=fs",
        f"hetero.transport_url={star.exchange_url(name)}", "hetero.delay.dist=none", "hetero.max_delay=2",
        f"trainer.default_local_dir={out / 'run'}", "hetero.max_queued_groups=8",
        "hetero.weight_sync=delta", "hetero.weights_bf16=true", *overrides,
    ]  # fmt: skip
    keys, enrolment = _keys(out, env)
    s = Star(out, steps, env, shared, keys, enrolment, slow_factor)
    done: list[dict] = []
    started = time.monotonic()

    def note(fault: str) -> None:
        done.append({"fault": fault, "at_step": s.step(), "t_s": round(time.monotonic() - started, 1)})
        print(f"[star] {fault} (learner at step {s.step()})", flush=True)

    try:
        s.start_learner()
        time.sleep(5)  # the learner clears the exchange's old groups when it starts
        s.start_pool("pool0")
        if not faults and pools == 2:
            s.start_pool("pool1")
        pending = list(FAULTS) if faults else []
        heal_at = None
        deadline = time.monotonic() + 900 + 120 * steps
        while time.monotonic() < deadline:
            if heal_at and time.monotonic() >= heal_at:
                star.heal("pool1")
                note("pool1 link healed")
                heal_at = None
            if s.procs["learner"].poll() is not None:
                if s.procs["learner"].returncode == 0 or s.launches["learner"] > 2:
                    break
                raise RuntimeError(f"the learner exited ({s.procs['learner'].returncode}) outside a fault")
            last_step = done[-1]["at_step"] if done else 0
            ready = (
                pending
                and {  # each fault mid-run: pools killed or cut while they send, not as they start
                    "pool1 joins late": s.step() >= 1,
                    "pool0 killed and restarted": s.step() >= 2 and s.batches_sent("pool0") >= 2,
                    "pool1 link cut 30 s": s.batches_sent("pool1") >= 2,
                    "exchange server restarted": s.step() > last_step,
                    "learner killed and resumed": s.step() > last_step and not heal_at and s.batches_sent("pool0") >= 1,
                }[pending[0]]
            )
            if ready:
                fault = pending.pop(0)
                note(fault)
                if fault == "pool1 joins late":
                    s.start_pool("pool1")
                elif fault == "pool0 killed and restarted":
                    s.kill_node("pool0")
                    time.sleep(POOL_DOWN_S)
                    s.start_pool("pool0")
                elif fault == "pool1 link cut 30 s":
                    star.cut("pool1")
                    heal_at = time.monotonic() + CUT_S
                elif fault == "exchange server restarted":
                    srv.restart(down_s=EXCHANGE_DOWN_S)
                elif fault == "learner killed and resumed":
                    s.kill_node("learner")
                    s.start_learner()
            time.sleep(1)
        learner_rc = s.procs["learner"].wait(timeout=60)
        pools_rc = {role: proc.wait(timeout=300) for role, proc in s.procs.items() if role != "learner"}
    finally:
        if heal_at:
            star.heal("pool1")
        for role in s.procs:
            for pid in sc.netns_pids(star.netns(role)):
                os.kill(pid, signal.SIGKILL)
    report = judge(out, name, steps)
    report.update(faults=done, learner_rc=learner_rc, pools_rc=pools_rc, rate_mbit=rate_mbit, pool_count=pools,
                  slow_factor=slow_factor, overrides=list(overrides),
                  wall_s=round(time.monotonic() - started, 1))  # fmt: skip
    srv.stop()
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def judge(out: Path, name: str, steps: int) -> dict:
    from verl_ext.hetero.protocol import ROLLOUT_TOPIC
    from verl_ext.hetero.transport import FsspecTransport

    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    audit = [json.loads(line) for line in (out / "run" / "pool_trained.jsonl").read_text().splitlines()]
    trained = [g for row in audit for g in row["groups"]]
    left = set(FsspecTransport(f"{star.EXCHANGE_ROOT}/{name}").keys(ROLLOUT_TOPIC))  # the server's own disk
    report: dict = {"steps": sorted({r["step"] for r in rows if "pool/groups_filled" in r})}
    per_pool, every_sent = {}, set()
    for role in POOL_INDEX:
        sure, maybe = sent_groups(sorted(out.glob(f"{role}.*.log")))
        every_sent |= sure | maybe
        mine = [g for g in trained if g in sure | maybe]
        per_pool[role] = {"sent": len(sure), "maybe_sent_when_killed": len(maybe), "trained": len(mine),
                          "lost": sorted(sure - set(trained) - left)}  # fmt: skip
    logs = "".join(p.read_text() for p in out.glob("*.log"))
    last = rows[-1]
    report.update(
        pools=per_pool,
        trained=len(trained),
        trained_twice=len(trained) - len(set(trained)),
        lost=sum(len(p["lost"]) for p in per_pool.values()),
        trained_from_no_pool=len(set(trained) - every_sent),
        exchange_reconnects=logs.count("lost the server"),
        refused=sum(r.get("trust/refused", 0) for r in rows),
        # groups refused as copies of content or a slot seen under another uid (no blame): honest ones
        # too, where a confident model answers a prompt given back with the very same tokens
        refused_as_copies=sum(r.get(f"hetero/rejected/{k}", 0) for r in rows for k in ("replayed", "slot_reused")),
        checked=last.get("trust/checked"), failed=last.get("trust/failed"),
        versions_fetched=last.get("pool/versions_fetched"), version_fetch_errors=last.get("pool/version_fetch_errors"),
        median_step_s=statistics.median(r["timing_s/step"] for r in rows if "timing_s/step" in r),
        # the share of a step the learner waited for groups (verl's timing_s/gen: the slots being
        # filled), steps 2 on (step 1 waits for the pools' first version)
        idle_fraction=statistics.median(r["timing_s/gen"] / r["timing_s/step"] for r in rows[1:]) if rows[1:] else None,
        publish_to_first_group_s=lag_per_version(sorted(out.glob("pool*.log"))),
        publish_to_loaded_s=lag_per_version(sorted(out.glob("pool*.log")), LOADED),
        prompts={k.split("/")[-1]: v for k, v in last.items() if k.startswith("pool/prompts_")},
        mean_response_length=statistics.mean(r["response_length/mean"] for r in rows if "response_length/mean" in r),
    )  # fmt: skip
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pool_star_run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--out", type=Path, default=Path("runs/star"))
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--pools", type=int, choices=(1, 2), default=2, help="without faults: one pool or two")
    parser.add_argument("--slow-factor", type=float, default=1.0, help="pool 1's speed factor (5: 5x slower)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for learner and pools")
    parser.add_argument("--keep", action="store_true", help="leave the star up afterwards")
    args = parser.parse_args(argv)
    try:
        report = run(args.out.resolve(), args.steps, args.rate_mbit, not args.no_faults, args.pools,
                     args.slow_factor, args.overrides)  # fmt: skip
    finally:
        if not args.keep:
            star.down()
    print(json.dumps(report, indent=1))
    return 0 if report["lost"] == 0 and report["trained_twice"] == 0 and report["learner_rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
