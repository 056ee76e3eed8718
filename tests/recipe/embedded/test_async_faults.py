"""Async mode under faults: a sampler killed mid-run, a second run on a used exchange.

Both are slow (Ray start-up plus actor restarts, ~40-60 s each on 2 shared cores).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import ray

import torch

from recipe.gepo.main_gepo import run

from verl_ext.hetero.protocol import sampler_actor_name

from .helpers import read_metrics, train_lines, wait_until

STEPS = 14  # well past what sampler-0's backlog (versions <= kill step, max_delay 2) can serve


def _trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((line["step"] for line in read_metrics(run_dir)), default=0)


@pytest.mark.slow
def test_killed_sampler_does_not_stop_training(tiny_cfg, tmp_path):
    cfg = tiny_cfg(
        tmp_path,
        "hetero.mode=async",
        "hetero.num_samplers=2",
        "hetero.max_delay=2",
        "hetero.delay.dist=constant",
        "hetero.delay.value=0.0",
        "hetero.wait_timeout_s=120",
        # sampler-1 is so slow it never delivers: once sampler-0 is killed, every further step
        # needs the restarted sampler-0 to rejoin (deterministic, unlike a race with sampler-1)
        "hetero.sampler_speed_factors=[1.0,1000.0]",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.experiment_name=test-kill",
    )
    # our own Ray session, so the driver thread's engine leaves it up and we can reach its actors
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    outcome: dict = {}

    def driver():
        try:
            outcome["metrics"] = run(cfg)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = err

    thread = threading.Thread(target=driver, daemon=True)
    try:
        thread.start()
        wait_until(lambda: _trained_steps(tmp_path) >= 1 or not thread.is_alive(), "the first learner step", 180, 0.2)
        victim = sampler_actor_name(0, 0)
        assert victim in ray.util.list_named_actors()  # names in this job's namespace
        ray.kill(ray.get_actor(victim), no_restart=True)
        killed_at = _trained_steps(tmp_path)
        assert killed_at < STEPS, "the run ended before the kill: the test would prove nothing"
        wait_until(
            lambda: sampler_actor_name(0, 1) in ray.util.list_named_actors() or not thread.is_alive(),
            "the replacement of sampler-0",
            120,
            0.2,
        )
        thread.join(timeout=300)
        assert not thread.is_alive(), "the run did not finish"
    finally:
        ray.shutdown()
    assert "error" not in outcome, outcome.get("error")

    lines = read_metrics(tmp_path)
    assert [line["step"] for line in lines] == list(range(STEPS + 1))
    steps = train_lines(lines)
    assert steps[-1]["hetero/sampler_failures"] >= 1
    assert steps[-1]["training/policy_version"] == STEPS
    assert outcome["metrics"]["hetero/sampler_failures"] >= 1
    # the failure was noticed while training went on: steps after the kill report it
    assert any(line["hetero/sampler_failures"] >= 1 for line in steps if line["step"] > killed_at)
    # the restarted sampler-0 rejoined and resumed where the killed one stopped: its batch
    # indices (and so its prompts, a function of seed, sampler and batch index) continue after
    # the killed launch's, none reused and at most the batch it was drawing when killed skipped
    ckpt_dir = tmp_path / "checkpoints"
    state = torch.load(ckpt_dir / (ckpt_dir / "latest").read_text().strip(), weights_only=False)
    status = state["buffer"]["ledger"]["status"]
    # uids are "s<sampler>-<launch nonce>-b<batch>-<group>"
    launches: dict[str, set[int]] = {}
    for uid in status:
        launch, batch = re.fullmatch(r"(s0-[0-9a-f]+)-b(\d+)-\d+", uid).groups() if uid.startswith("s0-") else (None, 0)
        if launch is not None:
            launches.setdefault(launch, set()).add(int(batch))
    assert len(launches) >= 2, f"the restarted sampler-0 sent nothing: {sorted(status)}"
    ranges = sorted((min(b), max(b), launch) for launch, b in launches.items())
    assert ranges[0][0] == 0, ranges
    for (_, prev_last, _), (first, _, _) in zip(ranges, ranges[1:]):
        assert prev_last < first <= prev_last + 2, f"a restart did not resume where its launch stopped: {ranges}"
    rejoined = [uid for uid in status if uid.startswith(ranges[-1][2] + "-")]
    assert any(status[uid] == "consumed" for uid in rejoined), f"the restarted sampler-0 did not rejoin: {status}"
    consumed_before = [uid for uid in status if uid.startswith(ranges[0][2] + "-") and status[uid] == "consumed"]
    assert len(consumed_before) >= 2 * killed_at  # the steps before the kill used the first sampler-0
    assert not any(s.startswith("rejected") for s in status.values())


@pytest.mark.slow
def test_second_fresh_async_run_on_a_used_exchange_completes(tiny_cfg, tmp_path):
    overrides = (
        "hetero.mode=async",
        "hetero.transport=fs",
        "hetero.num_samplers=1",
        "hetero.max_delay=2",
        "hetero.delay.dist=constant",
        "hetero.delay.value=0.0",
        "hetero.wait_timeout_s=60",  # a loaded 2-core box starts a sampler in 20-40 s
        "trainer.total_training_steps=6",
        "trainer.test_freq=0",
    )
    for _ in range(2):
        run(tiny_cfg(tmp_path, *overrides))
    assert [line["step"] for line in read_metrics(tmp_path)] == list(range(7))
