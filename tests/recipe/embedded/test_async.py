"""Async mode end to end: a real learner actor and 2 sampler actors on a local Ray.

One run (module fixture, ~30 s on 2 shared cores, most of it Ray and actor start-up) is shared by
the checks: the staleness bound at every step, the ledger balance, the metric names. It sends
weights as deltas (``hetero.weight_sync=delta``; the other async tests run the default, full
versions), so the delta path runs end to end through the Ray transport and delay channels.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from recipe.gepo.main_gepo import run

from .helpers import STEP_METRICS, TINY, compose_cfg, read_metrics, train_lines

MAX_DELAY = 2
STEPS = 5
PROMPTS = 2


@pytest.fixture(scope="module")
def async_run(tiny_model_path, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("async")
    cfg = compose_cfg(
        TINY
        + [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={run_dir}",
            "hetero.mode=async",
            "hetero.num_samplers=2",
            f"hetero.max_delay={MAX_DELAY}",
            # seconds: weights reach samplers late, so groups arrive stale and some past the bound
            "hetero.delay.low=0.2",
            "hetero.delay.high=2",
            "hetero.wait_timeout_s=120",
            "hetero.weight_sync=delta",
            "hetero.weights_bf16=true",
            # the checks in their own process (the default runs them in the learner: the demo's runs)
            "hetero.trust.check_process=true",
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
            "trainer.experiment_name=test-async",
        ]
    )
    final = run(cfg)
    return run_dir, final, read_metrics(run_dir)


def test_async_completes_and_every_step_respects_the_bound(async_run):
    run_dir, final, lines = async_run
    assert [line["step"] for line in lines] == list(range(STEPS + 1))
    for line in train_lines(lines):
        step = line["step"]
        assert line["training/policy_version"] == step
        assert math.isfinite(line["actor/loss"])
        assert 0 <= line["hetero/staleness_min"] <= line["hetero/staleness_max"] <= MAX_DELAY, step
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in line.items() if k.startswith("hetero/staleness_hist/")}
        assert sorted(hist) == list(range(MAX_DELAY + 1)), step  # no bucket past the bound exists
        assert sum(hist.values()) == PROMPTS == line["hetero/consumed"], step
        assert line["hetero/sampler_failures"] == 0
    # the learner outpaces the samplers' weight delays, so it does train on stale groups
    assert max(line["hetero/staleness_max"] for line in train_lines(lines)) > 0
    assert final["training/policy_version"] == STEPS


def test_async_ledger_balances(async_run):
    run_dir, final, lines = async_run
    ledger = {k.removeprefix("hetero/ledger_"): v for k, v in final.items() if k.startswith("hetero/ledger_")}
    assert ledger, sorted(final)
    # generated = consumed + dropped + rejected + still queued in the buffer
    assert ledger["generated"] == ledger["consumed"] + ledger["dropped"] + ledger["rejected"] + ledger["buffered"]
    assert ledger["consumed"] == STEPS * PROMPTS
    steps = train_lines(lines)
    # every drop a step reported is in the ledger (groups arriving after the last step may add more)
    assert sum(line["hetero/dropped"] for line in steps) <= ledger["dropped"]
    assert steps[-1]["hetero/generated_total"] <= ledger["generated"]

    # the final checkpoint's ledger: every consumed uid was produced by one of the two samplers
    # and each was consumed once (statuses are per uid)
    ckpt_dir = Path(run_dir) / "checkpoints"
    state = torch.load(ckpt_dir / (ckpt_dir / "latest").read_text().strip(), weights_only=False)
    status = state["buffer"]["ledger"]["status"]
    consumed = [uid for uid, s in status.items() if s == "consumed"]
    assert len(consumed) == STEPS * PROMPTS
    assert {uid.split("-")[0] for uid in consumed} <= {"s0", "s1"}
    assert all(s.split(":")[0] in ("buffered", "consumed", "dropped", "rejected") for s in status.values())
    # stale, over a sampler's quota (samplers faster than the learner: hetero.max_buffered_per_sampler),
    # or withheld until the bound took them (hetero.trust.hold_unchecked: no later check vouched in time)
    dropped = {s for s in status.values() if s.startswith("dropped")}
    assert dropped <= {"dropped:stale", "dropped:over_quota", "dropped:stale_unvouched"}, dropped


def test_without_checkpoints_settled_rollouts_leave_the_transport_every_step(async_run):
    """trainer.save_freq=0: no checkpoint before the end, so nothing waits for one to be
    acknowledged; the learner deletes the rollouts its ledger settled at every step (before, they
    stayed in the transport for the whole run)."""
    steps = train_lines(async_run[2])
    released = [line.get("hetero/inbox_acknowledged", 0.0) for line in steps]
    assert released[-1] > 0 and released == sorted(released), released  # a run total, reported before each step


def test_async_logs_the_fixed_metric_names(async_run):
    missing = {line["step"]: [n for n in STEP_METRICS if n not in line] for line in train_lines(async_run[2])}
    assert not any(missing.values()), missing


def test_async_metrics_say_which_path_weight_loads_took(async_run):
    lines = train_lines(async_run[2])
    paths = (
        "perf/sampler_weight_full_loads_total",
        "perf/sampler_weight_delta_loads_total",
        "perf/sampler_weight_bytes_fetched_total",
        "perf/sampler_weight_delta_fallbacks_total",
    )
    assert all(name in line for line in lines for name in paths)
    last = lines[-1]  # the samplers' counters lag a step; by the last one each has loaded a first, full version
    assert last["perf/sampler_weight_full_loads_total"] >= 1
    assert last["perf/sampler_weight_bytes_fetched_total"] > 0


def test_async_signs_checks_and_rejects_no_honest_group(async_run):
    """hetero.trust at its defaults: the driver recorded each started sampler's public key in the
    run directory, the learner re-scored groups (probation), and no honest group was refused."""
    from verl_ext.trust.signing import Enrolment

    run_dir, final, lines = async_run
    ckpt_dir = Path(run_dir) / "checkpoints"
    state = torch.load(ckpt_dir / (ckpt_dir / "latest").read_text().strip(), weights_only=False)
    status = state["buffer"]["ledger"]["status"]
    # every sampler whose groups were trained on was enrolled first (an unenrolled sender's groups are
    # refused); on a loaded machine the second sampler may still be starting when the last step ends
    senders = {f"sampler-{uid.split('-')[0][1:]}" for uid, s in status.items() if s == "consumed"}
    enrolled = set(Enrolment.load(Path(run_dir) / "enrolment.json").keys)
    assert senders and senders <= enrolled <= {"sampler-0", "sampler-1"}, (senders, enrolled)
    last = train_lines(lines)[-1]
    assert last["trust/checked"] >= 4 and last["trust/failed"] == 0 and last["trust/quarantined"] == 0
    assert last["perf/trust_check_cpu_s_total"] > 0
    # hetero.trust.check_process: the checks went to the checker process; the learner checked a
    # group's rewards itself only while it waited for groups (its core idle), so never longer
    # than it waited, and never re-scored one (it holds no model copy to re-score with)
    idle_s = sum(line["perf/step_s"] * line["perf/learner_idle_frac"] for line in train_lines(lines))
    assert last["trust/check_batches"] > 0
    assert last["perf/trust_check_learner_cpu_s_total"] <= idle_s
    # the learner's waits on those verdicts are part of its idle time, never more
    assert 0 <= last["perf/learner_verdict_block_s_total"] <= idle_s
    # no group refused, but for the one refusal an honest run can meet: two samplers drawing the
    # very same group at one version (1-digit sums, G=4), refused as a replay without blame
    refused = [s for s in status.values() if s.startswith("rejected")]
    assert set(refused) <= {"rejected:replayed"}, refused
