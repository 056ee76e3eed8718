"""The option contract in async mode: (option, async) pairs declared honoured change the run.

Async runs are not deterministic (which sampler's groups a step takes, their staleness, the
timings), so two runs of one config differ in their metrics. The observation is what a config
decides:

- the error's first line (numbers collapsed);
- the kinds of files the run writes (the run dir and its sandbox, each path with its numbers and
  hashes collapsed: ``exchange/rollouts/s#-#-b#-#.msg``), so the fs transport's folders, the delta
  files, the learner's status record and the announcements show, and who wrote how many does not;
- :func:`run_facts`: what a 2-step run decides whatever its timing (the kinds of events, whether a
  group was re-scored, the reasons of failed checks, the samplers' trust scores, whether the token
  check's and the divergence bound's metrics were logged, the weight versions the fs exchange
  keeps and their wire size, whether samplers waited for weights);
- the core sets the driver process ran on.

Where an option acts only in some situation, the case's setup makes it (every re-score failing,
rollouts delayed past the run, a quota one sampler cannot fill); a changed run left without its
first batch ends in ``BufferTimeout`` after ``hetero.wait_timeout_s`` (``TIMEOUT``), an error
``EXPECTED_ERRORS`` names like any other a case may end in. A control pair (the same config twice
gives the same observation) comes first; a planted option declared honoured but not read is caught
(the harness can fail). Every case is a real 2-step run on the toy (20-60 s): all are ``slow``.

Options replay honours too have their behaviour case in the replay harness
(``tests/recipe/test_options.py``); ``SHARED_WITH_REPLAY`` links each to the code both modes read
it through. Four options act only in moments no 2-step run of an honest toy decides
(``OBSERVED_ELSEWHERE``): the test that shows each, and the async code that hands it on."""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import inspect
import json
import os
import re
import tempfile
import threading
from pathlib import Path

import pytest

from recipe.gepo import options
from tests.recipe.test_options import (
    BASE,
    SECTIONS,
    BehaviourHarness,
    Case,
    _c,
    check_pointers,
    compose_cfg,
    declare_honoured,
    write_case_data,
)

ROOT = Path(__file__).resolve().parents[2]
EMB = "recipe.gepo.embedded"
ASYNC_BASE = tuple("hetero.mode=async" if o == "hetero.mode=replay" else o for o in BASE) + (
    "hetero.wait_timeout_s=120",
)
"""The tiny run of the replay cases (2 steps, toy task), in async mode with 2 samplers."""
FS = ("hetero.transport=fs",)
TIMEOUT = ("hetero.wait_timeout_s=60",)
"""Setups whose changed run cannot get its first batch end in BufferTimeout after this long (the
control still has its samplers up and the first batch in well within it)."""
NEVER = ("hetero.trust.verify_fraction=1e-9", "hetero.trust.hold_unchecked=false")
"""A group off probation is re-scored once in 10^9 (0 re-scores none), and taken unvouched."""
LENIENT = (*NEVER, "hetero.trust.probation_groups=1", "hetero.trust.quarantine_below=0")
"""Each sampler's first group is re-scored, no later one; a failed check costs trust and refuses
the group but quarantines nobody, so a run whose every check fails still gets its batches."""
FAILING = (*LENIENT, "hetero.trust.logprob_tolerance=1e-30")
"""Every re-scored group fails (no honest q is re-scored to the last bit)."""

CASES_ASYNC: dict[str, Case] = {
    "hetero.transport": _c("hetero.transport=fs"),
    "hetero.transport_url": _c("hetero.transport_url={sandbox}/elsewhere", setup=FS),
    "hetero.weight_sync": _c("hetero.weight_sync=delta", setup=FS),
    "hetero.wait_timeout_s": _c("hetero.wait_timeout_s=0.001"),
    "hetero.trust.sign_records": _c("hetero.trust.sign_records=false"),
    # the exchange's files (fs): the weight versions kept, their wire size, the learner's status record
    "hetero.keep_weight_versions": _c("hetero.keep_weight_versions=1", setup=FS),
    "hetero.weights_bf16": _c("hetero.weights_bf16=true", setup=FS),
    "hetero.max_queued_groups": _c("hetero.max_queued_groups=2", setup=FS),
    "hetero.stale_policy": _c("hetero.stale_policy=wait", setup=FS),  # the announcements a run leaves
    # samplers that wait for weights: 3 steps, each needing the previous step's version (max_delay=0),
    # which reaches the samplers 2 s after it is published
    "hetero.sampler_skip_stale": _c(
        "hetero.sampler_skip_stale=false",
        setup=(
            "trainer.total_training_steps=3",
            "hetero.max_delay=0",
            "hetero.delay.dist=constant",
            "hetero.delay.value=2",
        ),
    ),
    # the driver's cores while it runs
    "hetero.system_cpus": _c("hetero.system_cpus=[0]"),
    # no first batch: rollouts that never arrive, samplers too slow, or too few of them for the quota
    "hetero.delay_rollouts": _c(
        "hetero.delay_rollouts=true",
        # weights after 1 s (1e6 s x 1e-6), rollouts (the learner's stream, factor 1) after 1e6 s
        setup=(
            *TIMEOUT,
            "hetero.delay.dist=constant",
            "hetero.delay.value=1e6",
            "hetero.sampler_speed_factors=[1e-6,1e-6]",
        ),
    ),
    "hetero.sampler_speed_factors": _c("hetero.sampler_speed_factors=[1e6,1e6]", setup=TIMEOUT),
    "hetero.num_samplers": _c("hetero.num_samplers=1", setup=(*TIMEOUT, "hetero.max_buffered_per_sampler=1")),
    "hetero.max_buffered_per_sampler": _c(
        "hetero.max_buffered_per_sampler=1", setup=(*TIMEOUT, "hetero.num_samplers=1")
    ),
    # where Ray runs: handed to ray.init as the cluster to join (an address Ray cannot parse fails at
    # once; an unreachable one only after Ray's minute of retries); resources no node offers (the
    # cluster joined: a fresh local instance, ray.init's address "local"; braces doubled: a case's
    # overrides are format strings, {sandbox} and {data} filled in)
    "hetero.ray_address": _c("hetero.ray_address=not-an-address"),
    "hetero.learner_ray_resources": _c(
        "hetero.learner_ray_resources={{nowhere: 1}}", setup=("hetero.ray_address=local",)
    ),
    "hetero.sampler_ray_resources": _c(
        "hetero.sampler_ray_resources={{nowhere: 1}}", setup=("hetero.ray_address=local",)
    ),
    # trust: what was checked, what failed, the scores, the refusals
    "hetero.trust.enrolment_file": _c("hetero.trust.enrolment_file={data}/revoked.json", setup=TIMEOUT),
    "hetero.trust.verify_fraction": _c(
        "hetero.trust.verify_fraction=1", setup=("hetero.trust.verify_fraction=0", "hetero.trust.probation_groups=0")
    ),
    "hetero.trust.probation_groups": _c("hetero.trust.probation_groups=0", setup=NEVER),
    "hetero.trust.check_rewards": _c("hetero.trust.check_rewards=false", setup=("hetero.trust.verify_fraction=0",)),
    "hetero.trust.logprob_tolerance": _c("hetero.trust.logprob_tolerance=1e-30", setup=LENIENT),
    "hetero.trust.trust_penalty": _c("hetero.trust.trust_penalty=0", setup=FAILING),
    "hetero.trust.quarantine_below": _c("hetero.trust.quarantine_below=0.5", setup=(*FAILING, *TIMEOUT)),
    "hetero.trust.checkable_sampling": _c("hetero.trust.checkable_sampling=true"),
    "hetero.trust.check_process": _c("hetero.trust.check_process=false"),  # no checker: all checks in the learner
    "hetero.trust.max_divergence": _c("hetero.trust.max_divergence=1e9"),
}
"""(option, async) pairs declared honoured and how a 2-step async run shows each."""
EXPECTED_ERRORS = {
    "hetero.wait_timeout_s": "BufferTimeout",
    "hetero.delay_rollouts": "BufferTimeout",
    "hetero.sampler_speed_factors": "BufferTimeout",
    "hetero.num_samplers": "BufferTimeout",
    "hetero.max_buffered_per_sampler": "BufferTimeout",
    "hetero.ray_address": "ValueError: Invalid address format: not-an-address",
    "hetero.learner_ray_resources": "hetero.learner_ray_resources=.*no node of the Ray cluster offers",
    "hetero.sampler_ray_resources": "hetero.sampler_ray_resources=.*no node of the Ray cluster offers",
    "hetero.trust.enrolment_file": r"^BufferTimeout: .*rejected so far by reason: \{'revoked'",
    "hetero.trust.quarantine_below": r"^BufferTimeout: .*rejected so far by reason: .*'quarantined'",
}
"""Cases whose change shows as an error (a pattern of it); any other case's run must not fail."""

OBSERVED_ELSEWHERE = {
    "hetero.order": (
        "tests/hetero/test_hetero_buffer.py::test_take_respects_bound_and_order",
        f"{EMB}.loop:build_buffer",
        "order=hetero.order",
    ),
    "hetero.max_delta_chain": (
        "tests/hetero/test_hetero_weight_delta.py::test_sampler_within_the_chain_uses_deltas_beyond_it_one_full_version",
        "recipe.gepo.sections:HeteroConfig.weight_store_options",
        '"max_delta_chain": self.max_delta_chain',
    ),
    "hetero.trust.trust_recovery": (
        "tests/recipe/embedded/test_trust_gate.py::test_lenient_trust_needs_two_failures",
        "verl_ext.trust.gate:TrustGate.__init__",
        "config.ledger(",
    ),
    "hetero.trust.divergence_window": (
        "tests/trust/test_ledger.py::test_divergence_window_bound_and_events",
        "verl_ext.trust.gate:TrustGate.__init__",
        "config.ledger(",
    ),
    "hetero.trust.hold_unchecked": (
        "tests/recipe/embedded/test_trust_gate.py::"
        "test_a_liar_that_waits_out_probation_gets_no_lie_trained_on_while_unchecked_groups_wait",
        "verl_ext.trust.gate:TrustGate.__init__",
        "config.hold_unchecked",
    ),
    "hetero.trust.bounds_file": (
        "tests/recipe/embedded/test_trust_calibration.py::test_a_calibration_catches_a_lie_the_table_lets_through",
        "verl_ext.trust.gate:TrustGate.__init__",
        "config.bounds()",
    ),
}
"""Honoured (option, async) pairs whose effect needs a moment no 2-step run of an honest toy
decides: a take that finds groups of two versions (``order``), a sampler's unchecked group
vouched for by a later group's check (``hold_unchecked``: when is the secret draw's), a sampler two versions behind
when it next looks (``max_delta_chain``), a failed check then a passed one (``trust_recovery``),
a sampler's window of consumed groups straddling the bound (``divergence_window``), a bf16
sampler re-scored by an fp32 learner (``bounds_file``: a run's samplers and scorer share
``hetero.sampler_precision``, and bf16 against bf16 on the tiny model is exact). Each names
the test that shows the effect, and the async-mode code that hands the key to it (the buffer,
the weight store, the trust ledger that ``TrustGate`` builds from ``hetero.trust``)."""


def honoured_async_only_keys() -> set[str]:
    """Fields of the project's sections declared honoured by async and not by replay (those
    replay honours too have their replay case in ``tests/recipe/test_options.py``)."""
    return {
        key
        for prefix, cls in SECTIONS
        for key, field, _ in options.option_fields(cls, prefix)
        if options.ASYNC in options.honoured_by(field) and options.REPLAY not in options.honoured_by(field)
    }


@dataclasses.dataclass(frozen=True)
class Link:
    """Options both modes read through ``reader`` (``module:qualname``; ``reads``: what in its
    source reads them), and where replay mode (``replay``) and async mode (``in_async``) call it.
    A site ``module:Class.method`` is the method as the class has it (inherited included),
    followed through its ``super().method(`` calls; ``site -> name``: the site calls (or, a mode's
    runner, dispatches to) ``name``, which leads to the reader (another site of the link shows that)."""

    keys: tuple[str, ...]
    reader: str
    reads: str
    replay: tuple[str, ...]
    in_async: tuple[str, ...]


LEARNER = f"{EMB}.learner_actor:LearnerWorker.__init__"  # async's learner: a LearnerRuntime in a Ray actor
SAMPLER = f"{EMB}.sampler:SamplerWorker"
RUNTIME = f"{EMB}.loop:LearnerRuntime"
SHARED_WITH_REPLAY: tuple[Link, ...] = (
    Link(
        ("hetero.delay.*",),
        "recipe.gepo.sections:DelayConfig.build",
        "self.model_params()",
        (f"{EMB}.replay:ReplaySource.__init__",),
        (f"{SAMPLER}.__init__",),
    ),
    Link(("hetero.max_delay",), f"{EMB}.loop:build_buffer", "hetero.max_delay", (f"{RUNTIME}.__init__",), (LEARNER,)),
    Link(
        (
            "hetero.max_nonfinite_steps",
            "hetero.learner_precision",
            "actor_rollout_ref.actor.*",
            "algorithm.rollout_correction.*",
        ),
        f"{EMB}.loop:build_learner",
        "engine.actor",
        (f"{RUNTIME}.__init__",),
        (LEARNER,),
    ),
    Link(
        ("hetero.device", "hetero.sampler_precision"),
        f"{EMB}.model_placement:Placement.of",
        "hetero.sampler_precision",
        (f"{EMB}.replay:ReplaySource.__init__", f"{RUNTIME}.__init__"),
        (f"{SAMPLER}.__init__", LEARNER),
    ),
    Link(
        ("hetero.learner_cpus", "hetero.sampler_cpus"),
        "verl_ext.hetero.affinity:pin_process",
        "sched_setaffinity",
        ("verl_ext.hetero.affinity:Pinned.__enter__", f"{EMB}.replay:run_replay -> Pinned"),
        (f"{EMB}.async_shared:pin_worker", f"{LEARNER} -> pin_worker", f"{SAMPLER}.__init__ -> pin_worker"),
    ),
    Link(
        (
            "hetero.seed",
            "task.name",
            "task.digits",
            "task.answer_format",
            "task.eval_*",
            "task.dataset*",
            "task.template",
        ),
        f"{EMB}.tasks:Task",
        "config.eval_size",
        (f"{RUNTIME}.__init__",),
        (f"{SAMPLER}.__init__", LEARNER),
    ),
    Link(
        ("data.train_batch_size",),
        f"{EMB}.tasks:Task.train_items",
        "def train_items(self, n",
        (f"{EMB}.replay:ReplaySource.next_batch",),
        (f"{SAMPLER}.assigned_groups",),
    ),
    Link(
        ("task.cache_dir", "task.warm_start_steps", "task.model", "actor_rollout_ref.model.path"),
        f"{EMB}.tasks:resolve_model_path",
        "task_config",
        ("recipe.gepo.main_gepo:run_local", "recipe.gepo.main_gepo:run_local -> run_replay"),
        ("recipe.gepo.main_gepo:run_local -> run_async",),
    ),
    Link(
        (
            "actor_rollout_ref.rollout.*",
            "data.max_response_length",
            "algorithm.adv_estimator",
            "algorithm.norm_adv_by_std_in_grpo",
        ),
        f"{EMB}.rollout_groups:generate_groups",
        "settings.temperature",
        (f"{EMB}.replay:ReplaySource.next_batch",),
        (f"{SAMPLER}.assigned_groups",),
    ),
    Link(
        ("task.diagnostics_*",),
        f"{EMB}.advantage_error:step_diagnostics",
        "engine.task.diagnostics_every",
        (f"{RUNTIME}.step",),
        (f"{EMB}.learner_actor:LearnerWorker.step",),
    ),
    Link(
        ("trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq", "trainer.resume_mode"),
        f"{EMB}.loop:run_loop",
        "settings.total_steps",
        (f"{EMB}.replay:run_replay",),
        (f"{EMB}.supervisor:_run_async",),
    ),
    Link(
        (
            "hetero.dry_run",
            "hetero.export_hf",
            "trainer.default_local_dir",
            "trainer.logger",
            "trainer.project_name",
            "trainer.experiment_name",
        ),
        "recipe.gepo.main_gepo:run_local",
        "engine.hetero.dry_run",
        ("recipe.gepo.main_gepo:run_local -> run_replay",),
        ("recipe.gepo.main_gepo:run_local -> run_async",),
    ),
)
"""Every (option, async) pair replay honours too has its behaviour case in the replay harness
(``tests/recipe/test_options.py``): here, the one function both modes read it through and where
each mode calls it, so async mode no longer reading one (a sampler that stops building its delay
model, a learner actor that is no longer a ``LearnerRuntime``) breaks its link."""


def _resolve(where: str):
    module, _, qualname = where.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _site_source(where: str) -> str:
    """The source of a call site, through the ``super().method(`` calls it makes."""
    module, _, qualname = where.partition(":")
    owner, _, name = qualname.rpartition(".")
    if not owner or not inspect.isclass(_resolve(f"{module}:{owner}")):
        return inspect.getsource(_resolve(where))
    sources = []
    for klass in _resolve(f"{module}:{owner}").__mro__:
        if name in vars(klass):
            sources.append(inspect.getsource(vars(klass)[name]))
            if f"super().{name}(" not in sources[-1]:
                break
    return "\n".join(sources)


def honoured_shared_keys() -> set[str]:
    """(option, async) pairs replay honours too: the project's fields and the verl keys the
    embedded engine acts on (in both modes), less the runner selectors."""
    from tests.recipe.test_options import SELECTORS, honoured_replay_keys

    fields = {
        key
        for prefix, cls in SECTIONS
        for key, field, _ in options.option_fields(cls, prefix)
        if options.ASYNC in options.honoured_by(field)
    }
    replay = honoured_replay_keys()
    return {
        k for k in replay if k in fields or not k.startswith(tuple(p + "." for p in options.PROJECT_SECTIONS))
    } - set(SELECTORS)


def test_every_option_shared_with_replay_is_read_through_the_same_code_in_async_mode():
    for key in sorted(honoured_shared_keys()):
        links = [link for link in SHARED_WITH_REPLAY if any(fnmatch.fnmatchcase(key, p) for p in link.keys)]
        assert len(links) == 1, f"{key}: {len(links)} links in SHARED_WITH_REPLAY (expected one)"
    for link in SHARED_WITH_REPLAY:
        assert link.reads in inspect.getsource(_resolve(link.reader)), f"{link.reader} does not read {link.reads}"
        for site in (*link.replay, *link.in_async):
            where, _, callee = site.partition(" -> ")
            name = callee or link.reader.rpartition(".")[2].rpartition(":")[2]
            pattern = rf"\b{re.escape(name)}\b" if callee else rf"\b{re.escape(name)}\("
            assert re.search(pattern, _site_source(where)), f"{link.keys}: {where} does not call {name}"
    from recipe.gepo.embedded.loop import LearnerRuntime
    from recipe.gepo.embedded.learner_actor import LearnerWorker

    assert issubclass(LearnerWorker, LearnerRuntime)  # the learner's sites above are LearnerRuntime's


def test_every_async_only_option_has_a_behaviour_case():
    honoured = honoured_async_only_keys()
    covered = set(CASES_ASYNC) | set(OBSERVED_ELSEWHERE)
    assert honoured - covered == set(), "declared honoured by async with no case"
    assert covered - honoured == set(), "an async case for an option async does not honour (or replay does)"
    assert not set(CASES_ASYNC) & set(OBSERVED_ELSEWHERE)
    from verl_ext.trust.config import TrustConfig

    check_pointers({key: where for key, (where, _, _) in OBSERVED_ELSEWHERE.items()})
    for key, (_, site, hands_on) in OBSERVED_ELSEWHERE.items():
        assert hands_on in _site_source(site), f"{key}: {site} does not hand it on ({hands_on})"
        if hands_on == "trust.ledger(":  # the ledger TrustGate builds takes it
            assert key.rpartition(".")[2] in TrustConfig._LEDGER_FIELDS.values(), key
        if hands_on == "trust.bounds()":  # the bounds TrustGate builds read it
            assert f"self.{key.rpartition('.')[2]}" in inspect.getsource(TrustConfig.validate), key


def _shape(path: str) -> str:
    return re.sub(r"\d+", "#", re.sub(r"[0-9a-f]{6,}", "#", path))


def _driver_cores(stop: threading.Event, seen: set) -> None:
    """Every core set this process's threads are allowed while a run goes (``hetero.system_cpus``
    pins every thread of the driver, this one included, and restores them after)."""
    while not stop.wait(0.1):
        seen.add(tuple(sorted(os.sched_getaffinity(0))))


def run_facts(sandbox: Path) -> dict:
    """What a 2-step async run decides whatever its timing, read from its run dir and exchange:

    - ``events``: the kinds of events in events.jsonl (a quarantine, the divergence bound crossed);
    - ``checked``: some group was re-scored (``trust/checked`` > 0); ``checks_cost``: the learner
      spent CPU on checks (``perf/trust_check_cpu_s_total`` > 0, reward checks included);
      ``checks_in_checker``: checks went to a checker process (``trust/check_batches`` > 0; not with
      ``hetero.trust.check_process=false``, where every check runs in the learner's process);
      ``failed``: the reasons of failed checks; ``scores``: the samplers' trust scores at the end;
      ``token_checks`` / ``divergence``: the token check's counters / a sampler's divergence
      metric were logged;
    - ``samplers_waited_for_weights``: a sampler waited for weights within the bound
      (``perf/sampler_stale_wait_s_total`` > 0 at the end; the driver's sampler counters lag
      a step, so a run shows a wait of its next-to-last step);
    - ``weights``: under the fs transport, the weight versions the exchange holds at the end (how
      many, and the sizes of their messages: one size per wire dtype).

    Metric *values* that depend on timing (staleness, drops, waits, how many groups) are not
    read; a metric's key is, where every run of a config logs it."""
    run = sandbox / "run"
    lines = []
    if (run / "metrics.jsonl").is_file():
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = lines[-1] if lines else {}
    keys = {k for line in lines for k in line}
    events = []
    if (run / "events.jsonl").is_file():
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    weights = [p for p in sandbox.rglob("*.msg") if p.parent.name == "weights"]  # not their .ok markers
    return {
        "events": sorted({e["event"] for e in events}),
        "checked": any(line.get("trust/checked", 0) > 0 for line in lines),
        "checks_cost": any(line.get("perf/trust_check_cpu_s_total", 0) > 0 for line in lines),
        "checks_in_checker": any(line.get("trust/check_batches", 0) > 0 for line in lines),
        "failed": sorted(k.split("/", 2)[2] for k, v in last.items() if k.startswith("trust/failed/") and v > 0),
        "scores": sorted({round(v, 6) for k, v in last.items() if re.fullmatch(r"trust/[^/]+/score", k)}),
        "token_checks": "trust/tokens_checked" in keys,
        "divergence": any(re.fullmatch(r"trust/[^/]+/divergence", k) for k in keys),
        "weights": (len(weights), sorted({p.stat().st_size for p in weights})),
        "samplers_waited_for_weights": last.get("perf/sampler_stale_wait_s_total", 0) > 0,
    }


class AsyncHarness(BehaviourHarness):
    """Tiny async runs through the entry's ``run_local``, each in its own sandbox folder (the
    working directory), observed as (the error's first line, the kinds of files written, the
    :func:`run_facts`, the core sets the driver ran on)."""

    runner = "in async mode"

    def __init__(self, root: Path, model: str):
        super().__init__(root, model)
        self.data = write_case_data(root / "data")
        # an enrolment file that revokes both launched samplers (a revoked id stays revoked
        # whatever key it enrols): every group they send is refused
        (self.data / "revoked.json").write_text(json.dumps({"keys": {}, "revoked": ["sampler-0", "sampler-1"]}))

    def observe(self, overrides: tuple[str, ...]) -> dict:
        from recipe.gepo.main_gepo import run_local

        self._n += 1
        sandbox = self.root / f"run{self._n}"
        sandbox.mkdir()
        fill = {"sandbox": sandbox, "data": self.data}
        items = [
            o.format(**fill)
            for o in (
                *ASYNC_BASE,
                f"actor_rollout_ref.model.path={self.model}",
                f"trainer.default_local_dir={sandbox / 'run'}",
                *overrides,
            )
        ]
        error = None
        cwd = os.getcwd()
        cores: set = set()
        stop = threading.Event()
        watcher = threading.Thread(target=_driver_cores, args=(stop, cores), daemon=True)
        os.chdir(sandbox)
        watcher.start()
        try:
            run_local(compose_cfg(*items))
        except options.OptionNotHonoured:
            raise
        except Exception as err:  # noqa: BLE001 -- an error is an observation
            err = getattr(err, "cause", None) or err  # a Ray actor's error: the one raised in the actor
            error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            error = _shape(error.replace(str(sandbox), "<sandbox>"))
        finally:
            stop.set()
            watcher.join()
            os.chdir(cwd)
        # not the hidden files of a write still in flight when the run ended (``.tmp.<key>.msg.<n>``)
        written = [p for p in sandbox.rglob("*") if p.is_file() and not p.name.startswith(".")]
        files = sorted({_shape(str(p.relative_to(sandbox))) for p in written})
        return {"files": files, "error": error, "facts": run_facts(sandbox), "driver_cores": sorted(cores)}

    def check_error(self, key: str, case: Case, changed: dict) -> None:
        """Only the cases of ``EXPECTED_ERRORS`` may end in an error, and only in theirs."""
        if key in EXPECTED_ERRORS:
            assert re.search(EXPECTED_ERRORS[key], changed["error"] or ""), f"{key}: {changed['error']}"
        else:
            assert changed["error"] is None, f"{key}: {case.change} failed: {changed['error']}"


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> AsyncHarness:
    """On the embedded tests' tiny warm start (``tests/recipe/test_options.py``'s ``tiny_model``)."""
    from verl_ext.data.toy.checkpoints import warm_start

    cache = Path(os.environ.get("HETERORL_TEST_CACHE", Path(tempfile.gettempdir()) / "heterorl-test-cache"))
    model = warm_start(cache, digits=1, steps=50, n_eval=32, batch_size=32, warmup_steps=5)
    return AsyncHarness(tmp_path_factory.mktemp("async_behaviour"), str(model))


@pytest.mark.slow
def test_the_control_pair_is_identical(harness):
    """The same config twice: the same kinds of files and no error, so a difference below is the option's."""
    first = harness.control(())
    assert first["error"] is None and "run/metrics.jsonl" in first["files"]
    assert harness.observe(()) == first


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(CASES_ASYNC))
def test_an_async_only_option_changes_the_run(harness, key):
    harness.check(key, CASES_ASYNC[key])


@pytest.mark.slow
def test_the_harness_catches_an_option_declared_honoured_that_is_not_read(harness, monkeypatch):
    """Plant ``verl_engine.preset`` (the verl engine's plan prints it; the embedded engine never
    reads it) among the options async mode honours: the coverage check and the behaviour check
    both fail."""
    from recipe.gepo.sections import VerlEngineConfig

    declare_honoured(monkeypatch, VerlEngineConfig, "preset", options.ASYNC)
    with pytest.raises(AssertionError, match="declared honoured by async with no case"):
        test_every_async_only_option_has_a_behaviour_case()
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "verl_engine.preset: declared honoured in async mode, but ('+verl_engine.preset=other',) changed nothing"
        ),
    ):
        harness.check("verl_engine.preset", _c("+verl_engine.preset=other"))
