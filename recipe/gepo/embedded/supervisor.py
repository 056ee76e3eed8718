"""Async mode's driver process: :func:`run_async` starts Ray (:func:`ray_session`) and runs the one
loop (:func:`~.loop.run_loop`) against a :class:`RemoteRuntime`, which launches the learner actor
(:mod:`.learner_actor`) and N sampler actors (:mod:`.sampler`) and supervises the samplers while
each step waits. The transport is Ray's object store (``hetero.transport=ray``) or an fsspec URL
(``hetero.transport=fs``) that any process building a :class:`~.sampler.SamplerWorker` on it joins
(a sampler in another data centre). The driver owns logging, evaluation cadence, checkpoints and
the progress bar; a dead sampler is reported, its announcements withdrawn, and it is restarted with
the newest weights it sees, at the batch index the dead one reached (:meth:`RemoteRuntime._reached`),
so no prompt is reused. Trust (``hetero.trust``): each sampler makes its signing key where it runs;
the driver records the public half in the run directory's ``enrolment.json`` and has the learner
enrol it before the sampler may send (a resumed learner enrols the file's keys before it reads
anything); every arriving group passes the learner's :class:`~verl_ext.trust.gate.TrustGate`.
One step, from the entry point to the optimizer: docs/architecture.md, "One step, in order".
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, Iterator, Optional

import ray
from tqdm import tqdm

from ..sections import HeteroConfig
from .async_shared import system_cores, transport_spec
from .loop import run_loop
from .engine_config import EngineConfig
from .learner_actor import LearnerWorker
from .run_log import MetricLogger
from .sampler import SamplerWorker
from verl_ext.hetero.affinity import Pinned
from verl_ext.trust.signing import Enrolment
from verl_ext.hetero.protocol import (
    EXPECTED_TOPIC,
    LEARNER_ACTOR,
    TransportSpec,
    clear_stop,
    clear_topic,
    request_stop,
    sampler_actor_name,
    sampler_progress,
)
from verl_ext.rundir import ENROLMENT_FILE


class _SamplerCounters:
    """Sums over all samplers: response tokens per wall-clock second since the last update, the
    seconds samplers have waited for weights within the bound (``sampler_skip_stale``) and for
    room in the learner's queue (``max_queued_groups``), and their weight loads by path (full
    version or deltas, ``weight_sync``) with the payload bytes they fetched.

    Never blocks the step: each update collects the answers that have arrived and asks again
    (one request in flight per sampler), so the numbers lag by up to one step."""

    def __init__(self):
        self._counters: dict[Any, dict] = {}
        self._pending: dict[Any, Any] = {}  # ObjectRef -> actor
        self._last = time.perf_counter()

    def update(self, samplers: dict[int, Any]) -> dict[str, float]:
        total_new = 0.0
        if self._pending:
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            for ref in ready:
                actor = self._pending.pop(ref)
                try:
                    counters = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead sampler contributes nothing
                    continue
                total_new += float(counters["tokens"]) - float(self._counters.get(actor, {}).get("tokens", 0.0))
                self._counters[actor] = counters
        asked = set(self._pending.values())
        for actor in samplers.values():
            if actor not in asked:
                self._pending[actor.counters.remote()] = actor
        live = set(samplers.values())  # a replaced sampler's requests are dropped
        self._pending = {ref: a for ref, a in self._pending.items() if a in live}
        now = time.perf_counter()
        rate = total_new / max(now - self._last, 1e-9)
        self._last = now
        summed = ("stale_wait_s", "queue_wait_s", "lost_version_reloads", *SamplerWorker.WEIGHT_STATS.values())
        totals = {k: sum(float(c.get(k, 0.0)) for c in self._counters.values()) for k in summed}
        return {"perf/sampler_tokens_per_s": rate, **{f"perf/sampler_{k}_total": v for k, v in totals.items()}}


def _placement(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options placing an actor on the node(s) holding ``resources`` (none: anywhere)."""
    return {"resources": dict(resources)} if resources else {}


def gpu_share(hetero: HeteroConfig) -> dict[str, Any]:
    """Ray actor options of the learner and of each sampler for ``hetero.device``: none on the CPU
    (nothing changes); on CUDA an equal share of one GPU each, num_gpus = 1 / (num_samplers + 1)
    (the learner and its samplers fit one GPU together), with Ray told to leave
    CUDA_VISIBLE_DEVICES as the driver has it, so ``cuda:N`` names the same GPU in every actor."""
    if not hetero.device.startswith("cuda"):
        return {}
    return {
        "num_gpus": 1.0 / (hetero.num_samplers + 1),
        "runtime_env": {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
    }


class RemoteRuntime:
    """The driver's view of the learner actor, a :class:`~.loop.Runtime` for
    :func:`~.loop.run_loop` (each call forwarded to ``LearnerWorker`` over Ray), plus the
    samplers' supervision while a step waits."""

    def __init__(self, engine: EngineConfig, model_path: str, spec: TransportSpec):
        self.engine, self.model_path, self.spec = engine, model_path, spec
        self.transport = spec.open()
        clear_stop(self.transport)  # a previous run of this exchange stopped it
        hetero = engine.hetero
        # actors hold no CPU reservation: on a 2-core laptop the learner and samplers share the
        # cores (hetero.*_cpus pins them); custom resources place them on a cluster's nodes
        self.learner = (
            ray.remote(num_cpus=0, concurrency_groups={"control": 1})(LearnerWorker)
            .options(name=LEARNER_ACTOR, **_placement(hetero.learner_ray_resources), **gpu_share(hetero))
            .remote(engine, model_path, spec)
        )
        # two threads: run() generates while counters() answers the driver
        self._sampler_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(SamplerWorker)
        self.samplers: dict[int, Any] = {}
        self.namespaces: dict[int, str] = {}
        self.runs: dict[Any, int] = {}
        self.keys_pending: dict[int, Any] = {}  # sampler -> its public key's ObjectRef, until it runs
        self.all_up_once = False  # every sampler has run once: start-up lines end
        # the launched samplers' public keys (hetero.trust.sign_records), kept in the run directory
        self.enrolment_path = engine.settings.run_dir / ENROLMENT_FILE
        self.enrolment = Enrolment()
        self.restarts = {i: 0 for i in range(engine.hetero.num_samplers)}
        self.resume_at: dict[int, int] = {}  # sampler -> the batch index its next launch starts at
        self.failures = 0
        self.counters = _SamplerCounters()

    def _launch(self, i: int) -> None:
        # named, so an operator (or a fault-injection test) can find and kill a sampler
        self.namespaces[i] = f"s{i}-{uuid.uuid4().hex[:8]}"
        self.samplers[i] = self._sampler_cls.options(
            name=sampler_actor_name(i, self.restarts[i]),
            **_placement(self.engine.hetero.sampler_ray_resources),
            **gpu_share(self.engine.hetero),
        ).remote(i, self.engine, self.model_path, self.spec, self.engine.hetero.speed_factors()[i], self.namespaces[i])
        self.restarts[i] += 1
        # its key is made where it runs; it generates once _start_ready has recorded the public half
        self.keys_pending[i] = self.samplers[i].public_key.remote()

    def _start_ready(self, bar_write) -> None:
        """Launched samplers whose public key has arrived: the key goes into the run directory's
        enrolment (so a learner resumed after a crash still accepts the groups they leave in
        flight) and to the learner, and only then does the sampler run (it waits for the
        learner's enrolment before it sends anything)."""
        if not self.keys_pending:
            return
        ready, _ = ray.wait(list(self.keys_pending.values()), timeout=0, num_returns=len(self.keys_pending))
        for i in [i for i, ref in self.keys_pending.items() if ref in ready]:
            ref = self.keys_pending.pop(i)
            try:
                public_hex = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - died while starting: restarted like any failure
                self._restart(i, err, bar_write)
                continue
            enrolled = None
            if public_hex is not None:  # hetero.trust.sign_records
                self.enrolment.enrol(f"sampler-{i}", public_hex)
                self.enrolment.save(self.enrolment_path)
                enrolled = self.learner.enrol.remote(f"sampler-{i}", public_hex)
            self.runs[self.samplers[i].run.remote(self.resume_at[i], enrolled=enrolled)] = i
            if not self.all_up_once:  # start-up: one line per sampler up (restarts say so themselves)
                total = self.engine.hetero.num_samplers
                bar_write(f"[heterorl] sampler-{i} started ({len(self.runs)} of {total} samplers running)")
                self.all_up_once = len(self.runs) == total

    def start(self, checkpoint: Optional[dict]) -> int:
        # the samplers this run launched before a crash (fresh run: none; the file is rewritten)
        self.enrolment = Enrolment.load(self.enrolment_path) if checkpoint is not None else Enrolment()
        self.enrolment_path.parent.mkdir(parents=True, exist_ok=True)
        version = ray.get(self.learner.start.remote(checkpoint, self.enrolment.to_json()))
        self.resume_at = {i: self._first_batch(i, checkpoint) for i in range(self.engine.hetero.num_samplers)}
        return version

    def _first_batch(self, i: int, checkpoint: Optional[dict]) -> int:
        """Where sampler i's first launch starts: batch 0 in a fresh run (the same prompts as any
        fresh run of this seed); after a resume, past any batch the crashed run may have drawn:
        ``step x 1000`` (a sampler draws far fewer batches per learner step), or further if this
        exchange shows its launches got further."""
        if checkpoint is None:
            return 0
        progress = sampler_progress(self.transport, f"sampler-{i}")
        return max(int(checkpoint["step"]) * 1000, 0 if progress is None else progress.next_batch)

    def _launch_all(self) -> None:
        # at the first step, after the initial evaluation: samplers started during it only slow
        # it down on shared cores, and samplers killed while still starting, with version 0 re-sent
        # under a skewed clock, could stall the learner at version 0 for good (it needs a first
        # batch to publish a version the samplers can see)
        for i in range(self.engine.hetero.num_samplers):
            self._launch(i)

    def _check_samplers(self, bar_write) -> None:
        """A sampler whose run() returned before the stop marker died (or was killed)."""
        finished, _ = ray.wait(list(self.runs), timeout=0, num_returns=len(self.runs)) if self.runs else ([], [])
        for ref in finished:
            i = self.runs.pop(ref)
            try:
                ray.get(ref)
            except Exception as err:  # noqa: BLE001 - any actor failure is reported the same way
                self._restart(i, err, bar_write)

    def _restart(self, i: int, err: Exception, bar_write) -> None:
        self.failures += 1
        bar_write(f"[heterorl] sampler-{i} failed ({type(err).__name__}); restarting it")
        # unreachable is not dead (ActorUnavailableError across a cut link): end it for
        # good, so it does not keep generating beside its replacement when the link heals
        try:
            ray.kill(self.samplers[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        # its announced groups will never come: the learner must not wait for them
        clear_topic(self.transport, EXPECTED_TOPIC, prefix=f"{self.namespaces[i]}-")
        self.resume_at[i] = self._reached(i)
        self._launch(i)

    def _reached(self, i: int) -> int:
        """Where sampler i's replacement starts: after the last batch its failed launch claimed
        (the sampler claims each batch index on the exchange before it draws the prompts), so
        the replacement draws new prompts and never reuses one; the launch's own start if it
        claimed none."""
        progress = sampler_progress(self.transport, f"sampler-{i}")
        if progress is None or progress.launch != self.namespaces[i]:
            return self.resume_at[i]
        return max(self.resume_at[i], progress.next_batch)

    def step(self, step: int) -> dict[str, float]:
        hetero = self.engine.hetero
        status_every = min(30.0, hetero.wait_timeout_s / 3)  # how often a blocked learner is reported
        if not self.samplers:
            self._launch_all()
        pending = self.learner.step.remote(step)
        waiting_since, next_status = time.monotonic(), status_every
        while True:
            ready, _ = ray.wait([pending], timeout=0.5)
            waited = time.monotonic() - waiting_since
            if not ready and waited >= next_status:
                starting = f", {len(self.keys_pending)} still starting" if self.keys_pending else ""
                tqdm.write(
                    f"[heterorl] step {step + 1}: waiting for rollouts for {waited:.0f}s "
                    f"({len(self.runs)} sampler(s) running{starting}; the learner fails after "
                    f"hetero.wait_timeout_s={hetero.wait_timeout_s:g})"
                )
                next_status += status_every
            self._start_ready(tqdm.write)
            self._check_samplers(tqdm.write)
            if ready:
                break
        metrics = ray.get(pending)
        metrics["hetero/sampler_failures"] = float(self.failures)
        metrics.update(self.counters.update(self.samplers))
        return metrics

    def evaluate(self, seed: int) -> dict[str, float]:
        return ray.get(self.learner.evaluate.remote(seed))

    def drain_events(self) -> list[dict]:
        return ray.get(self.learner.drain_events.remote())

    def checkpoint_state(self) -> dict[str, Any]:
        return ray.get(self.learner.checkpoint_state.remote())

    def acknowledge(self, buffer_state: dict) -> int:
        return ray.get(self.learner.acknowledge.remote(buffer_state))

    def ledger_counts(self) -> dict[str, int]:
        return ray.get(self.learner.ledger_counts.remote())

    def shutdown(self) -> None:
        # samplers stop on the marker even if the learner actor is gone (the driver writes it too)
        request_stop(self.transport)
        try:
            ray.get(self.learner.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead learner must not keep the samplers running
            pass
        for actor in self.samplers.values():
            ray.kill(actor)


def _worker_env() -> dict[str, str]:
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": repo + (os.pathsep + path if path else "")}
    if os.environ.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def run_async(engine: EngineConfig, model_path: str, logger: MetricLogger) -> dict[str, float]:
    """Train for ``trainer.total_training_steps`` learner steps with real learner and sampler actors."""
    hetero = engine.hetero
    # the driver on the system cores before ray.init, so the GCS, raylet and mailbox it starts
    # inherit them and stay off the learner's cores (the actors re-pin themselves)
    with Pinned(system_cores(hetero), "hetero.system_cpus"):
        return _run_async(engine, model_path, logger)


@contextlib.contextmanager
def ray_session(hetero: HeteroConfig) -> Iterator[None]:
    """Ray for an async run, started the one way every caller shares (the run itself, the soak,
    the WAN scripts): nothing if Ray is already up in this process; else join the cluster at
    ``hetero.ray_address`` (the actors import this repo, so its root goes on their path), or start
    a local instance. Shut down on exit only if started here."""
    if ray.is_initialized():
        yield
        return
    if hetero.ray_address:
        ray.init(
            address=hetero.ray_address,
            log_to_driver=False,
            logging_level="ERROR",
            runtime_env={"env_vars": _worker_env()},
        )
    else:
        ray.init(num_cpus=max(2, hetero.num_samplers + 1), include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def check_placement(hetero: HeteroConfig) -> None:
    """Refuse (ValueError naming the key) ``hetero.learner_ray_resources`` /
    ``sampler_ray_resources`` that no live node of the Ray cluster offers in the amounts asked
    for: Ray would keep such an actor (and, for the learner's, the Ray transport's mailbox) pending
    forever, waiting for a node that may never join, and the run would hang without a word."""
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    for key in ("learner_ray_resources", "sampler_ray_resources"):
        wanted = getattr(hetero, key)
        if not wanted or any(all(offer.get(name, 0) >= amount for name, amount in wanted.items()) for offer in nodes):
            continue
        builtin = ("CPU", "GPU", "memory", "object_store_memory")
        offered = sorted({n for offer in nodes for n in offer if n not in builtin and not n.startswith("node:")})
        raise ValueError(
            f"hetero.{key}={wanted}: no node of the Ray cluster offers these resources (custom resources "
            f"offered: {', '.join(offered) or 'none'}); the actor would wait for such a node forever"
        )


def _run_async(engine: EngineConfig, model_path: str, logger: MetricLogger) -> dict[str, float]:
    runtime = None
    with ray_session(engine.hetero):
        check_placement(engine.hetero)
        try:
            runtime = RemoteRuntime(engine, model_path, transport_spec(engine.hetero, engine.settings))
            return run_loop(runtime, engine, logger, desc="async")
        finally:
            if runtime is not None:
                runtime.shutdown()
