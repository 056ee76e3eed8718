"""The soak itself (see ``research/soak/__main__.py``): set up the run, the watcher and the injector; run
``recipe.gepo.main_gepo.run`` under the time limit, resuming after each injected learner crash;
then check what happened and return the result. Ray is up through it all (the injector kills
actors; the final ledger is read from the live learner), started the product's one way
(``ray_session``), which the run itself then reuses."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ray

from recipe.gepo.sections import HeteroConfig
from recipe.gepo.embedded.async_shared import transport_spec
from recipe.gepo.embedded.supervisor import ray_session
from recipe.gepo.embedded.run_log import RunSettings
from recipe.gepo.main_gepo import run
from .checks import RunEnd, accounting, account_uids, check_steps, final_state, judge_faults, liar_figures
from .config import soak_config
from .faults import SAMPLER_ACTOR
from .injector import Injector
from .liars import start_crew, start_honest_bf16
from .report import SoakResult
from .wan_link import WanLink
from .watchers import TransportWatcher, Watcher
from verl_ext.trust.signing import Enrolment, SamplerKey
from verl_ext.hetero.protocol import LEARNER_ACTOR, ROLLOUT_TOPIC, WEIGHTS_TOPIC
from verl_ext.hetero.transport import Transport
from verl_ext.rundir import read_metric_rows


@dataclass
class Harness:
    """One soak: its config and folder (``exchange/`` and the run directory ``run/``), the
    engine's transport, the watcher and injector threads, and the run's segments so far."""

    cfg: Any
    folder: Path
    transport: Transport
    watcher: Any  # Watcher | TransportWatcher
    injector: Injector
    duration: float
    t0: float
    wan: bool
    segments: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.folder / "run"


def calibrate_bf16(cfg, folder: Path, overrides: list[str]) -> None:
    """The honest bf16 sampler of ``--liars`` is accepted by an fp32 learner only with bf16 bounds
    calibrated on the run's own model (a run accepts the precisions its config names): measure
    them once per soak folder (``recipe.gepo.calibrate``) and hand the file to the run."""
    from omegaconf import open_dict

    from recipe.gepo.calibrate import main as calibrate_main

    bounds = folder / "bounds_bf16.json"
    if not bounds.exists():
        calibrate_main(
            [
                "--out",
                str(bounds),
                "--groups",
                "64",
                "hetero.mode=async",
                "hetero.trust.checkable_sampling=true",
                f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path}",
                f"task.cache_dir={cfg.task.cache_dir}",
                *overrides,
            ]
        )
    with open_dict(cfg):
        cfg.hetero.trust.bounds_file = str(bounds)


def soak(
    minutes: float = 10.0,
    seed: int = 0,
    run_dir: Optional[Path] = None,
    fault_every: float = 5.0,
    learner_crashes: int = 2,
    save_freq: int = 5,
    wait_timeout_s: float = 120.0,
    overrides: Optional[list[str]] = None,
    log=print,
    wan: Optional[WanLink] = None,
    liars: bool = False,
) -> SoakResult:
    """Run the soak; with ``wan`` (a :class:`WanLink` already ``up``) across the real link; with
    ``liars`` beside the lying samplers of :mod:`research.soak.liars` and its honest bf16 sampler,
    with ``hetero.trust.checkable_sampling`` on (unless ``overrides`` turn it off)."""
    folder = Path(run_dir or f"/tmp/heterorl-soak-{seed}-{int(time.time())}").resolve()
    (folder / "exchange").mkdir(parents=True, exist_ok=True)
    # the liars that only the token check catches need checkable sampling (an override may turn it off:
    # they are then left out)
    extra = ["hetero.trust.checkable_sampling=true"] if liars else []
    cfg = soak_config(
        folder,
        seed,
        save_freq,
        wait_timeout_s,
        extra + list(overrides or []),
        wan_address=wan.address if wan is not None else "",
    )
    if liars and not cfg.hetero.trust.bounds_file:
        calibrate_bf16(cfg, folder, list(overrides or []))
    hetero = HeteroConfig.from_omegaconf(cfg.hetero)
    if liars and not hetero.trust.sign_records:
        raise ValueError("--liars: the outsiders' lies are only refused with hetero.trust.sign_records=true")
    with ray_session(hetero):
        h = _set_up(cfg, hetero, folder, seed, minutes * 60.0, fault_every, learner_crashes, save_freq, wan)
        crew = start_crew(cfg, Path(cfg.hetero.trust.enrolment_file)) if liars else None
        bf16 = start_honest_bf16(cfg, Path(cfg.hetero.trust.enrolment_file)) if liars else None
        try:
            _run_until_time_limit(h, log)
            crew_report = _stop_crew(crew)
            if bf16 is not None:
                ray.get(bf16.halt.remote(), timeout=60)
            return _check(h, crew_report)
        finally:
            for actor in (crew, bf16):
                if actor is not None:
                    ray.kill(actor)
            if h.wan:
                h.transport.shutdown()  # the detached mailbox (the cluster goes down next anyway)


def _stop_crew(crew) -> Optional[dict]:
    if crew is None:
        return None
    report = ray.get(crew.report.remote(), timeout=60)
    ray.get(crew.halt.remote(), timeout=60)
    return report


# --------------------------------------------------------------------------- set-up
def _set_up(
    cfg,
    hetero: HeteroConfig,
    folder: Path,
    seed: int,
    duration: float,
    fault_every: float,
    learner_crashes: int,
    save_freq: int,
    wan: Optional[WanLink],
) -> Harness:
    # the engine's own exchange folder, or its mailbox (same name and placement as the run's)
    transport = transport_spec(hetero, RunSettings.from_config(cfg)).open()
    # the time limit ends run(cfg) with a simulated SIGINT, which does nothing while SIGINT is
    # ignored -- as it is for a background job of a non-interactive shell (nohup ... &)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    exchange = folder / "exchange"
    watcher = TransportWatcher(transport) if wan is not None else Watcher(exchange / ROLLOUT_TOPIC)
    key = None
    if hetero.trust.sign_records:  # the injector is enrolled: its bad groups meet validation, not the signature check
        key = SamplerKey.generate("soak-injector")
        enrolment = Enrolment.load(hetero.trust.enrolment_file)
        enrolment.enrol(key.sampler_id, key.public_hex())
        enrolment.save(hetero.trust.enrolment_file)
    injector = Injector(
        transport,
        exchange,
        folder / "run",
        seed,
        t0,
        duration,
        fault_every,
        learner_crashes,
        save_freq,
        wan=wan,
        key=key,
    )
    return Harness(cfg, folder, transport, watcher, injector, duration, t0, wan is not None)


# --------------------------------------------------------------------------- the run, under its time limit
def _run_until_time_limit(h: Harness, log) -> None:
    """``run(cfg)`` in segments -- resumed from its checkpoint after each injected learner crash --
    until it finishes or fails, or the time limit ends it like Ctrl-C; faults go in meanwhile."""
    stop, done = threading.Event(), threading.Event()
    h.watcher.start()
    h.injector.start()
    threading.Thread(target=_stopper, args=(h, stop, done), daemon=True, name="soak-stopper").start()
    try:
        while not stop.is_set() and _run_segment(h, log):
            pass
    except KeyboardInterrupt:  # the time limit landed between two segments
        pass
    finally:
        done.set()
        stop.set()
        h.injector.in_run.clear()
    h.injector.stop()
    h.watcher.stop()
    h.errors.extend(h.injector.errors)


def _stopper(h: Harness, stop: threading.Event, done: threading.Event) -> None:
    if not stop.wait(timeout=h.duration):
        stop.set()
        while h.injector.in_run.is_set() and not done.is_set():
            _thread.interrupt_main()  # ends run(cfg) like Ctrl-C: no final checkpoint
            if done.wait(timeout=30):
                break


def _run_segment(h: Harness, log) -> bool:
    """One ``run(cfg)`` until it ends; True to resume it (after an injected learner crash)."""
    in_run = h.injector.in_run
    h.injector.segment = len(h.segments)
    segment = {"started_s": round(time.monotonic() - h.t0, 1), "ended": "?"}
    h.segments.append(segment)
    h.injector.crash_flag.clear()
    try:
        in_run.set()
        run(h.cfg)
        segment["ended"] = "finished"
        return False
    except KeyboardInterrupt:
        segment["ended"] = "time limit"
        return False
    except Exception as err:  # noqa: BLE001
        in_run.clear()
        return _after_failure(h, segment, err, log)
    finally:
        in_run.clear()
        segment["ended_s"] = round(time.monotonic() - h.t0, 1)


def _after_failure(h: Harness, segment: dict, err: Exception, log) -> bool:
    if h.injector.crash_flag.is_set():
        segment["ended"] = f"learner crash ({type(err).__name__})"
        leftovers = _kill_leftover_actors()
        segment["leftover_actors_killed"] = leftovers
        log(f"[soak] learner crashed as injected; killed leftovers {leftovers}; resuming")
        return True
    segment["ended"] = f"error: {type(err).__name__}: {err}"
    h.errors.append(f"run failed: {type(err).__name__}: {str(err)[:2000]}")
    return False


def _kill_leftover_actors(timeout_s: float = 30.0) -> list[str]:
    """Kill every engine actor still alive (what a crashed run leaves behind); wait until the
    names are free so the resumed run can reuse them."""
    killed = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = [n for n in ray.util.list_named_actors() if n == LEARNER_ACTOR or SAMPLER_ACTOR.match(n)]
        if not names:
            break
        for name in names:
            try:
                ray.kill(ray.get_actor(name))
                killed.append(name)
            except ValueError:
                pass
        time.sleep(0.5)
    return sorted(set(killed))


# --------------------------------------------------------------------------- the checks after, the result
def _check(h: Harness, crew_report: Optional[dict] = None) -> SoakResult:
    final = final_state(h.injector.learner_handle, h.run_dir)
    h.injector.learner_handle = None
    leftovers = [n for n in _kill_leftover_actors() if n != LEARNER_ACTOR]  # the learner was kept on purpose
    # Ray's object store has no partial writes
    temporaries = [] if h.wan else h.transport.incomplete(ROLLOUT_TOPIC) + h.transport.incomplete(WEIGHTS_TOPIC)
    in_transport = set(h.transport.keys(ROLLOUT_TOPIC))
    uids = account_uids(h.watcher.seen, final.ledger, in_transport)
    # a live run's last line may be half written: skipped quietly
    rows = read_metric_rows(h.run_dir, missing_ok=True, warn=False)
    steps = check_steps(rows, final, int(h.cfg.data.train_batch_size), uids.generated)
    end_s = time.monotonic() - h.t0
    judge_faults(
        h.injector.faults,
        RunEnd(
            final.ledger,
            in_transport,
            final.version,
            int(h.cfg.hetero.max_delay),
            h.injector.actor_names,
            {i: s.get("ended_s", end_s) for i, s in enumerate(h.segments)},
            len(h.segments),
            end_s,
        ),
    )
    return SoakResult(
        steps_done=steps.steps_done,
        steps_executed=steps.steps_executed,
        faults=h.injector.faults,
        accounting=accounting(final, uids, steps, temporaries, h.injector.actor_names, h.segments, leftovers),
        lost=uids.lost,
        consumed_twice=steps.consumed_twice,
        errors=h.errors + uids.errors + steps.errors,
        wall_s=time.monotonic() - h.t0,
        run_dir=str(h.folder),
        liars=None
        if crew_report is None
        else liar_figures(final.ledger, crew_report, h.run_dir, h.cfg.hetero.trust.verify_fraction),
    )
