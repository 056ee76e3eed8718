"""Soak test of async mode: train the toy model with 3 samplers over the fs transport for a
bounded time while a separate thread injects faults at random, then account for every rollout
group by uid.

    python scripts/soak.py                 # 10 minutes, seed 0
    python scripts/soak.py --minutes 1 --seed 3 --run-dir /tmp/soak

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

One sampler runs 4x slower than the others (``hetero.sampler_speed_factors=[1,1,4]``).

``--wan`` (opt-in; needs root / CAP_NET_ADMIN, refused clearly without it): the samplers run on
the sampler node of scripts/wan/cluster.py (a Ray worker in its own network namespace behind a
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
consumed twice). Exit status 1 if any group was lost, anything was consumed twice, or the run
failed; 0 otherwise.
"""

from __future__ import annotations

import _thread
import argparse
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from verl_ext.hetero.exchange import send_group  # noqa: E402
from verl_ext.hetero.protocol import (  # noqa: E402
    LEARNER_ACTOR,
    ROLLOUT_TOPIC,
    SAMPLER_ACTOR_PREFIX,
    WEIGHTS_TOPIC,
    parse_version_key,
    sampler_actor_name,
    version_key,
)
from verl_ext.hetero.records import RolloutGroup  # noqa: E402
from verl_ext.rundir import read_metric_rows  # noqa: E402
from verl_ext.hetero.transport import (  # noqa: E402
    COMMIT_SUFFIX,
    DATA_SUFFIX,
    TEMP_PREFIX,
    FsspecTransport,
    Transport,
    checksum,
)

CONFIG_DIR = REPO / "recipe" / "gepo" / "config"
# sampler uids: "s<i>-b<batch>-<j>", or "s<i>-<launch id>-b<batch>-<j>" when the engine namespaces
# each sampler launch; everything the injector writes starts with "fault-"
SAMPLER_UID = re.compile(r"^s\d+-(?:[0-9A-Za-z]+-)?b\d+-\d+$")
SAMPLER_ACTOR = re.compile(rf"^{re.escape(SAMPLER_ACTOR_PREFIX)}(\d+)-(\d+)$")

# fault kind -> relative frequency (learner_crash is scheduled separately)
FAULT_WEIGHTS = {
    "sampler_kill": 3.0,
    "rollout_half_written": 1.0,
    "rollout_truncated": 1.0,
    "rollout_corrupt": 1.0,
    "weights_half_written": 0.7,
    "weights_truncated": 0.7,
    "weights_corrupt": 0.7,
    "duplicate_message": 1.0,
    "duplicate_other_key": 0.5,
    "future_version": 1.0,
    "bad_nonfinite_logprob": 0.6,
    "bad_positive_logprob": 0.6,
    "bad_group_size": 0.6,
    "bad_empty_response": 0.6,
    "bad_nonfinite_reward": 0.6,
    "bad_reward_range": 0.6,
    "clock_skew_rollout": 0.8,
    "clock_skew_weights": 0.6,
}
# --wan: the fs transport's file-level faults cannot be injected into Ray's object store
FS_ONLY = {k for k in FAULT_WEIGHTS if k.startswith(("rollout_", "weights_"))}
WAN_FAULT_WEIGHTS = {"link_cut": 3.0, "link_slow": 3.0, "worker_gone": 4.0}  # ~40% of the faults
# bad-group kind -> the ledger's rejection reason it must produce
BAD_REASON = {
    "bad_nonfinite_logprob": "nonfinite_logprob",
    "bad_positive_logprob": "positive_logprob",
    "bad_group_size": "group_size",
    "bad_empty_response": "empty_response",
    "bad_nonfinite_reward": "nonfinite_reward",
    "bad_reward_range": "reward_range",
    "future_version": "future_version",
}
TOY_REWARD_RANGE = (0.0, 1.0)  # the toy task scores 0 or 1


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the soak started
    key: str = ""  # transport key / uid / actor name it concerns
    detail: dict[str, Any] = field(default_factory=dict)
    outcome: str = "pending"  # survived | NOT SURVIVED: ... | not judged: ...


@dataclass
class SoakResult:
    steps_done: int
    steps_executed: int
    faults: list[Fault]
    accounting: dict[str, Any]
    lost: int
    consumed_twice: int
    errors: list[str]
    wall_s: float
    run_dir: str

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.consumed_twice == 0 and not self.errors and self.steps_done > 0


# --------------------------------------------------------------------------- config
def soak_config(run_dir: Path, seed: int, save_freq: int, wait_timeout_s: float, extra: list[str],
                wan_address: str = ""):
    from hydra import compose, initialize_config_dir

    if wan_address:  # learner + mailbox on the head, samplers across the link
        transport = ["hetero.transport=ray", f"hetero.ray_address={wan_address}",
                     "hetero.learner_ray_resources={learner_node: 0.01}",
                     "hetero.sampler_ray_resources={sampler_node: 0.01}"]  # fmt: skip
    else:
        transport = ["hetero.transport=fs", f"hetero.transport_url={run_dir / 'exchange'}"]
    overrides = [
        "hetero.mode=async", "hetero.num_samplers=3", *transport,
        "hetero.delay.low=0.2", "hetero.delay.high=2", "hetero.max_delay=4",
        "hetero.sampler_speed_factors=[1.0,1.0,4.0]",
        f"hetero.wait_timeout_s={wait_timeout_s}", f"hetero.seed={seed}",
        "trainer.total_training_steps=1000000", f"trainer.save_freq={save_freq}", "trainer.test_freq=0",
        f"trainer.default_local_dir={run_dir / 'run'}", "trainer.resume_mode=auto", "trainer.logger=[]",
        "task.eval_size=16", f"task.cache_dir={REPO / '.cache' / 'heterorl'}",
        *extra,
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=overrides)
    if not cfg.actor_rollout_ref.model.path and cfg.task.name == "toy_addition":
        # the toy warm start is cached per seed; every soak seed trains from the seed-0 one
        from omegaconf import open_dict

        from recipe.gepo.local.tasks import TaskConfig, resolve_model_path

        with open_dict(cfg):
            cfg.actor_rollout_ref.model.path = resolve_model_path("", TaskConfig.from_omegaconf(cfg.task), 0)
    return cfg


# --------------------------------------------------------------------------- watcher
class _Watcher(threading.Thread):
    """Calls ``scan()`` every ``interval`` s until stopped, and once more after (the last messages)."""

    def __init__(self, interval: float):
        super().__init__(daemon=True, name="soak-watcher")
        self.interval = interval
        self.seen: dict[str, set[str]] = defaultdict(set)
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def scan(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self._halt.is_set():
            self.scan()
            time.sleep(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.scan()


class TransportWatcher(_Watcher):
    """Records every committed rollout message of any transport (one listing with checksums,
    ``Transport.infos``): key -> {sha256}; every ``interval`` s. Used with --wan (Ray transport)."""

    def __init__(self, transport: Transport, interval: float = 0.05):
        super().__init__(interval)
        self.transport = transport

    def scan(self) -> None:
        try:
            infos = self.transport.infos(ROLLOUT_TOPIC)
        except Exception:  # noqa: BLE001 - the mailbox busy or restarting: the next scan sees it
            return
        with self.lock:
            for info in infos:
                self.seen[info.key].add(info.sha256)



class Watcher(_Watcher):
    """Records every committed rollout message of the fs transport: key -> {sha256}; scans every
    ``interval`` s."""

    def __init__(self, folder: Path, interval: float = 0.05):
        super().__init__(interval)
        self.folder = folder
        self._markers: dict[str, tuple[int, int]] = {}

    def scan(self) -> None:
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.name
            if not name.endswith(COMMIT_SUFFIX) or name.startswith(TEMP_PREFIX):
                continue
            try:
                stat = entry.stat()
                stamp = (stat.st_mtime_ns, stat.st_size)
                key = name[: -len(COMMIT_SUFFIX)]
                if self._markers.get(key) == stamp:
                    continue
                sha = json.loads(Path(entry.path).read_bytes())["sha256"]
            except (FileNotFoundError, ValueError, KeyError):
                continue  # deleted or being replaced: the next scan sees the new marker
            self._markers[key] = stamp
            with self.lock:
                self.seen[key].add(sha)



# --------------------------------------------------------------------------- injector
class Injector(threading.Thread):
    """Injects one random fault every ``mean_interval`` seconds (exponential gaps) until stopped."""

    def __init__(self, exchange: Path, run_dir: Path, watcher: Watcher, seed: int, t0: float, duration: float,
                 mean_interval: float, learner_crashes: int, save_freq: int, in_run: threading.Event,
                 crash_flag: threading.Event, transport: Optional[Transport] = None, wan: Optional["WanLink"] = None):
        super().__init__(daemon=True, name="soak-injector")
        self.exchange, self.run_dir, self.watcher = exchange, run_dir, watcher
        self.transport = transport if transport is not None else FsspecTransport(str(exchange))
        self.wan = wan
        self.fault_weights = dict(FAULT_WEIGHTS)
        if wan is not None:
            self.fault_weights = {k: v for k, v in FAULT_WEIGHTS.items() if k not in FS_ONLY}
            self.fault_weights.update(WAN_FAULT_WEIGHTS)
        self.rng = random.Random(seed * 7919 + 1)
        self.t0, self.duration, self.mean_interval = t0, duration, mean_interval
        self.save_freq = save_freq
        self.crash_times = sorted(self.rng.uniform(0.3, 0.75) * duration for _ in range(learner_crashes))
        self.in_run, self.crash_flag = in_run, crash_flag
        self.faults: list[Fault] = []
        self.actor_names: set[str] = set()  # every actor name ever seen alive
        self.segment = 0
        self.counter = 0
        self.learner_handle = None
        self._handle_at = 0.0
        self.errors: list[str] = []
        self._halt = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    # -- helpers
    def _named_actors(self) -> list[str]:
        import ray

        try:
            names = list(ray.util.list_named_actors())
        except Exception:  # noqa: BLE001 - Ray busy or shutting down: try again next tick
            return []
        self.actor_names.update(f"{self.segment}:{n}" for n in names)
        if LEARNER_ACTOR in names and time.monotonic() - self._handle_at > 1.0:
            # holding a handle keeps the learner actor alive after run() returns, so the final
            # ledger can be read from it (Ray reclaims an actor once no handle is left)
            try:
                self.learner_handle = ray.get_actor(LEARNER_ACTOR)
                self._handle_at = time.monotonic()
            except ValueError:
                pass
        return names

    def _sampler_keys(self) -> list[str]:
        return [k for k in self.transport.keys(ROLLOUT_TOPIC) if SAMPLER_UID.match(k)]

    def _template(self) -> Optional[RolloutGroup]:
        keys = self._sampler_keys()
        self.rng.shuffle(keys)
        for key in keys[:10]:
            try:
                return RolloutGroup.from_bytes(self.transport.get(ROLLOUT_TOPIC, key))
            except (KeyError, ValueError):
                continue  # acknowledged (deleted) meanwhile
        return None

    def _latest_weights(self) -> Optional[int]:
        versions = [v for v in map(parse_version_key, self.transport.keys(WEIGHTS_TOPIC)) if v is not None]
        return max(versions) if versions else None

    def _fault_key(self, kind: str) -> str:
        self.counter += 1
        return f"fault-{kind.replace('_', '')}-{self.counter}"

    def _write_raw(self, topic: str, key: str, payload: bytes, committed_size: int, sha: str) -> None:
        """A committed message whose marker does not match its payload (truncated / corrupt)."""
        folder = self.exchange / topic
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}{DATA_SUFFIX}").write_bytes(payload)
        marker = {"topic": topic, "key": key, "size": committed_size, "sha256": sha, "sent_at": time.time()}
        (folder / f"{key}{COMMIT_SUFFIX}").write_text(json.dumps(marker))

    def _half_written(self, topic: str, key: str, payload: bytes) -> str:
        folder = self.exchange / topic
        folder.mkdir(parents=True, exist_ok=True)
        cut = payload[: max(1, len(payload) // 2)]
        if self.rng.random() < 0.5:  # killed while writing the temporary
            (folder / f"{TEMP_PREFIX}{key}{DATA_SUFFIX}.{self.counter:08x}").write_bytes(cut)
            return "temporary"
        (folder / f"{key}{DATA_SUFFIX}").write_bytes(payload)  # killed before the commit marker
        return "uncommitted"

    def _write_damaged(self, topic: str, key: str, payload: bytes, damage: str) -> dict:
        """Leave ``payload`` under (topic, key) ``half_written``, ``truncated`` or ``corrupt``;
        returns what to add to the fault's detail."""
        if damage == "half_written":
            return {"variant": self._half_written(topic, key, payload)}
        data = payload[: len(payload) // 2] if damage == "truncated" else self._corrupt(payload)
        self._write_raw(topic, key, data, len(payload), checksum(payload))
        return {}

    def _corrupt(self, payload: bytes) -> bytes:
        data = bytearray(payload)
        for _ in range(8):
            i = self.rng.randrange(len(data))
            data[i] ^= 0xFF
        return bytes(data)

    def _skewed(self, skew: float) -> Transport:
        """A second handle on the exchange whose sender clock is ``skew`` seconds off."""
        if self.wan is None:
            return FsspecTransport(str(self.exchange), clock=lambda: time.time() + skew)
        from verl_ext.hetero.transport import RayTransport

        return RayTransport(self.transport.name, self.transport.namespace, clock=lambda: time.time() + skew,
                            resources=self.transport.resources)  # fmt: skip

    # -- faults
    def inject(self, kind: str) -> Optional[Fault]:
        import ray

        fault = Fault(kind, self.now())
        if kind in WAN_FAULT_WEIGHTS:
            fault.detail = {"version_at_fault": self._latest_weights()}
            fault.detail.update(self.wan.inject(kind, self.rng))
            fault.detail["version_after_fault"] = self._latest_weights()
            fault.detail["ended_s"] = round(self.now(), 1)
            return fault
        if kind == "sampler_kill":
            names = [n for n in self._named_actors() if SAMPLER_ACTOR.match(n)]
            if not names:
                return None
            name = self.rng.choice(names)
            try:
                ray.kill(ray.get_actor(name))
            except ValueError:
                return None  # already gone
            index, incarnation = SAMPLER_ACTOR.match(name).groups()
            fault.key = name
            fault.detail = {"segment": self.segment, "restart_name": sampler_actor_name(int(index), int(incarnation) + 1)}
            return fault
        if kind == "learner_crash":
            try:
                learner = ray.get_actor(LEARNER_ACTOR)
            except ValueError:
                return None
            self.crash_flag.set()
            ray.kill(learner)
            fault.key = LEARNER_ACTOR
            fault.detail = {"segment": self.segment}
            return fault
        if kind.startswith("weights_") or kind == "clock_skew_weights":
            latest = self._latest_weights()
            if latest is None:
                return None
            fault.detail = {"version_at_fault": latest}
            if kind == "clock_skew_weights":
                key = version_key(latest)
                try:
                    payload = self.transport.get(WEIGHTS_TOPIC, key)
                except (KeyError, ValueError):
                    return None
                skew = self.rng.choice([-1, 1]) * self.rng.uniform(60, 600)
                self._skewed(skew).put(WEIGHTS_TOPIC, key, payload)
                fault.key, fault.detail["skew_s"] = key, round(skew, 1)
                return fault
            # a version the learner has not published yet (it replaces it when it gets there)
            key = version_key(latest + 3)
            try:
                payload = self.transport.get(WEIGHTS_TOPIC, version_key(latest))
            except (KeyError, ValueError):
                return None
            fault.key = key
            fault.detail.update(self._write_damaged(WEIGHTS_TOPIC, key, payload, kind.removeprefix("weights_")))
            return fault

        template = self._template()
        if template is None:
            return None
        payload = template.to_bytes()
        if kind.startswith("rollout_"):
            key = self._fault_key(kind)
            fault.key = key
            fault.detail.update(self._write_damaged(ROLLOUT_TOPIC, key, payload, kind.removeprefix("rollout_")))
            return fault
        if kind == "duplicate_message":
            # the very message a sampler committed, sent again (same bytes, new commit marker)
            try:
                original = self.transport.get(ROLLOUT_TOPIC, template.group_uid)
            except (KeyError, ValueError):
                return None
            self.transport.put(ROLLOUT_TOPIC, template.group_uid, original)
            fault.key = template.group_uid
            return fault
        if kind == "duplicate_other_key":
            key = self._fault_key(kind)
            self.transport.put(ROLLOUT_TOPIC, key, payload)
            fault.key, fault.detail["uid"] = key, template.group_uid
            return fault

        key = self._fault_key(kind)
        group = template
        group.group_uid, group.sampler_id = key, "soak-injector"
        fault.key = key
        generated = np.argwhere(group.response_mask.astype(bool))
        r0, c0 = (int(x) for x in generated[0])
        if kind == "future_version":
            latest = self._latest_weights() or 0
            group.policy_version = latest + 1000
        elif kind == "bad_nonfinite_logprob":
            group.sampler_logprobs = group.sampler_logprobs.copy()
            group.sampler_logprobs[r0, c0] = np.nan
        elif kind == "bad_positive_logprob":
            group.sampler_logprobs = group.sampler_logprobs.copy()
            group.sampler_logprobs[r0, c0] = 0.7
        elif kind == "bad_group_size":
            for name in ("response_ids", "response_mask", "sampler_logprobs", "rewards", "advantages"):
                setattr(group, name, getattr(group, name)[:-1].copy())
        elif kind == "bad_empty_response":
            group.response_mask = group.response_mask.copy()
            group.response_mask[0, :] = 0
        elif kind == "bad_nonfinite_reward":
            group.rewards = group.rewards.copy()
            group.rewards[0] = np.inf
        elif kind == "bad_reward_range":
            group.rewards = group.rewards.copy()
            group.rewards[0] = 100.0
        elif kind == "clock_skew_rollout":
            skew = self.rng.choice([-1, 1]) * self.rng.uniform(60, 3600)
            group.created_at = time.time() + skew
            send_group(self._skewed(skew), group)
            fault.detail["skew_s"] = round(skew, 1)
            return fault
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        send_group(self.transport, group)
        return fault

    def run(self) -> None:
        kinds, weights = zip(*self.fault_weights.items())
        next_at = self.now() + self.rng.expovariate(1.0 / self.mean_interval)
        while not self._halt.is_set():
            time.sleep(0.2)
            self._named_actors()
            if not self.in_run.is_set():
                continue
            try:
                if self.crash_times and self.now() >= self.crash_times[0] and self._checkpoint_step() >= self.save_freq:
                    self.crash_times.pop(0)
                    fault = self.inject("learner_crash")
                    if fault is not None:
                        self.faults.append(fault)
                    continue
                if self.now() < next_at:
                    continue
                next_at = self.now() + self.rng.expovariate(1.0 / self.mean_interval)
                kind = self.rng.choices(kinds, weights)[0]
                fault = self.inject(kind)
                if fault is not None:
                    self.faults.append(fault)
            except Exception as err:  # noqa: BLE001 - an injector bug must not look like a survived fault
                self.errors.append(f"injector: {type(err).__name__}: {err}")

    def _checkpoint_step(self) -> int:
        pointer = self.run_dir / "checkpoints" / "latest"
        try:
            return int(re.search(r"(\d+)", pointer.read_text()).group(1))
        except (FileNotFoundError, AttributeError):
            return 0


# --------------------------------------------------------------------------- the real link (--wan)
class WanLink:
    """The two-node cluster of scripts/wan/cluster.py and its network faults (see the module
    docstring). Check :meth:`refusal` before :meth:`up`: it names the missing privileges."""

    def __init__(self, rate_mbit: float, fault_s: float):
        sys.path.insert(0, str(REPO / "scripts" / "wan"))
        import cluster
        import link

        self.cluster, self.link = cluster, link
        self.link_cfg, self.cluster_cfg = link.LinkConfig(), cluster.ClusterConfig()
        self.rate_mbit, self.fault_s = float(rate_mbit), float(fault_s)
        self.address = ""

    def refusal(self) -> Optional[str]:
        problems = self.link.missing_requirements(self.link.effective_caps())
        return self.link.refusal_message(problems) if problems else None

    def up(self) -> str:
        self.cluster.join_env()  # the cluster's auth environment, before this process joins it
        self.address = self.cluster.up(self.cluster_cfg, self.link_cfg, self.rate_mbit)
        return self.address

    def down(self) -> None:
        self.cluster.down(self.cluster_cfg, self.link_cfg)

    def _sampler_node_alive(self) -> bool:
        try:
            nodes = self.cluster.alive_nodes(self.address, self.link_cfg.host_ip)
        except Exception:  # noqa: BLE001 - the head busy: count it as not known to be alive
            return False
        return any(n["ip"] == self.link_cfg.ns_ip for n in nodes)

    def inject(self, kind: str, rng: random.Random) -> dict:
        """Inject one network fault and wait it out; returns its details."""
        seconds = round(rng.uniform(self.fault_s, 1.5 * self.fault_s), 1)
        if kind == "link_cut":
            self.link.cut(self.link_cfg)
            try:
                time.sleep(seconds)
            finally:
                self.link.heal(self.link_cfg)
            detail = {"seconds": seconds}
        elif kind == "link_slow":
            slow = self.rate_mbit / 100
            self.link.set_rate(self.link_cfg, slow)
            try:
                time.sleep(seconds)
            finally:
                self.link.set_rate(self.link_cfg, self.rate_mbit)
            detail = {"seconds": seconds, "rate_mbit": slow}
        elif kind == "worker_gone":
            # the sampler node gone for 20 s: its Ray processes end, its namespace and veth pair are
            # deleted, then rebuilt and a new node joins (the head's address lives on the link's
            # bridge, so the head's own connections survive; docs/reliability.md)
            seconds = 20.0
            self.cluster.worker_gone(self.cluster_cfg, self.link_cfg, seconds)
            detail = {"seconds": seconds}
        else:
            raise ValueError(f"unknown network fault {kind!r}")
        # a cut past Ray's health check leaves the head believing the sampler node dead, and the
        # node's raylet exits when it learns so: start it again, as a node supervisor would
        deadline = time.monotonic() + 30
        while not self._sampler_node_alive() and time.monotonic() < deadline:
            time.sleep(2)
        if not self._sampler_node_alive():
            self._end_worker()
            self._start_worker()
            detail["node_restarted"] = True
        return detail

    def _end_worker(self) -> None:
        sessions = self.cluster._read_state().get("sessions", {})
        if "worker" in sessions:
            self.cluster._end_session(int(sessions["worker"]))

    def _start_worker(self) -> None:
        self.cluster._start("worker", self.cluster.worker_command(self.cluster_cfg, self.link_cfg))
        self.cluster._wait_worker(self.cluster_cfg, self.link_cfg, 90.0)


# --------------------------------------------------------------------------- driver
def _kill_leftover_actors(timeout_s: float = 30.0) -> list[str]:
    """Kill every engine actor still alive (what a crashed run leaves behind); wait until the
    names are free so the resumed run can reuse them."""
    import ray

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


def steps_done_guard(rows: list[dict]) -> bool:
    return any("hetero/consumed" in r for r in rows)


def _metrics(path: Path) -> list[dict]:
    # a live run's last line may be half written: skipped quietly
    return read_metric_rows(path, missing_ok=True, warn=False)


def soak(minutes: float = 10.0, seed: int = 0, run_dir: Optional[Path] = None, fault_every: float = 5.0,
         learner_crashes: int = 2, save_freq: int = 5, wait_timeout_s: float = 120.0,
         overrides: Optional[list[str]] = None, log=print, wan: Optional[WanLink] = None) -> SoakResult:
    """Run the soak; with ``wan`` (a :class:`WanLink` already ``up``) across the real link."""
    import ray

    from recipe.gepo.main_gepo import run

    run_dir = Path(run_dir or f"/tmp/heterorl-soak-{seed}-{int(time.time())}").resolve()
    exchange = run_dir / "exchange"
    exchange.mkdir(parents=True, exist_ok=True)
    cfg = soak_config(run_dir, seed, save_freq, wait_timeout_s, overrides or [],
                      wan_address=wan.address if wan is not None else "")  # fmt: skip
    batch = int(cfg.data.train_batch_size)
    duration = minutes * 60.0
    started_ray = not ray.is_initialized()
    if started_ray and wan is not None:
        from recipe.gepo.local.async_mode import _worker_env

        ray.init(address=wan.address, log_to_driver=False, logging_level="ERROR", runtime_env={"env_vars": _worker_env()})
    elif started_ray:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    transport: Optional[Transport] = None
    if wan is not None:  # the engine's own mailbox (same name and placement as the run's)
        from recipe.gepo.hetero_config import HeteroConfig
        from recipe.gepo.local.async_mode import transport_spec
        from recipe.gepo.local.run_utils import RunSettings

        transport = transport_spec(HeteroConfig.from_omegaconf(cfg.hetero), RunSettings.from_config(cfg)).open()

    # the time limit ends run(cfg) with a simulated SIGINT, which does nothing while SIGINT is
    # ignored -- as it is for a background job of a non-interactive shell (nohup ... &)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    watcher = Watcher(exchange / ROLLOUT_TOPIC) if transport is None else TransportWatcher(transport)
    in_run, crash_flag = threading.Event(), threading.Event()
    injector = Injector(exchange, run_dir / "run", watcher, seed, t0, duration, fault_every, learner_crashes,
                        save_freq, in_run, crash_flag, transport=transport, wan=wan)
    errors: list[str] = []
    segments: list[dict] = []
    stop, done = threading.Event(), threading.Event()

    def stopper() -> None:
        if not stop.wait(timeout=duration):
            stop.set()
            while in_run.is_set() and not done.is_set():
                _thread.interrupt_main()  # ends run(cfg) like Ctrl-C: no final checkpoint
                if done.wait(timeout=30):
                    break

    watcher.start()
    injector.start()
    threading.Thread(target=stopper, daemon=True, name="soak-stopper").start()
    try:
        while not stop.is_set():
            injector.segment = len(segments)
            segment = {"started_s": round(time.monotonic() - t0, 1), "ended": "?"}
            segments.append(segment)
            crash_flag.clear()
            try:
                in_run.set()
                run(cfg)
                segment["ended"] = "finished"
                break
            except KeyboardInterrupt:
                segment["ended"] = "time limit"
                break
            except Exception as err:  # noqa: BLE001
                in_run.clear()
                if crash_flag.is_set():
                    segment["ended"] = f"learner crash ({type(err).__name__})"
                    leftovers = _kill_leftover_actors()
                    segment["leftover_actors_killed"] = leftovers
                    log(f"[soak] learner crashed as injected; killed leftovers {leftovers}; resuming")
                    continue
                segment["ended"] = f"error: {type(err).__name__}: {err}"
                errors.append(f"run failed: {type(err).__name__}: {str(err)[:2000]}")
                break
            finally:
                in_run.clear()
                segment["ended_s"] = round(time.monotonic() - t0, 1)
    except KeyboardInterrupt:  # the time limit landed between two segments
        pass
    finally:
        done.set()
        stop.set()
        in_run.clear()
    injector.stop()
    watcher.stop()
    errors.extend(injector.errors)

    # ------------------------------------------------------------------ the final ledger
    checkpoint_step = None  # set when the ledger comes from a checkpoint instead of the live learner
    try:
        if injector.learner_handle is None:
            raise ValueError("no handle on the learner was taken")
        state = ray.get(injector.learner_handle.checkpoint_state.remote(), timeout=120)
        source = "live learner"
    except Exception as err:  # noqa: BLE001 - learner dead: fall back to the latest checkpoint
        from verl_ext.rundir import load_latest_checkpoint

        state = load_latest_checkpoint(run_dir / "run") or {"step": 0, "learner": {"version": 0},
                                                            "buffer": {"ledger": {"status": {}, "duplicates": {}}}}
        source = f"latest checkpoint, step {state['step']} (live learner unavailable: {type(err).__name__}: {str(err).splitlines()[0][:120]})"
        checkpoint_step = int(state["step"])
    ledger = dict(state["buffer"]["ledger"]["status"])
    duplicates = dict(state["buffer"]["ledger"]["duplicates"])
    final_version = int(state["learner"]["version"])
    del state
    injector.learner_handle = None
    leftovers = [n for n in _kill_leftover_actors() if n != LEARNER_ACTOR]  # the learner was kept on purpose

    if transport is None:
        transport = FsspecTransport(str(exchange))
        temporaries = transport.incomplete(ROLLOUT_TOPIC) + transport.incomplete(WEIGHTS_TOPIC)
    else:
        temporaries = []  # Ray's object store has no partial writes
    in_transport = set(transport.keys(ROLLOUT_TOPIC))

    # ------------------------------------------------------------------ accounting by uid
    sampler_seen = {k for k in watcher.seen if SAMPLER_UID.match(k)}
    generated = sampler_seen | {uid for uid in ledger if SAMPLER_UID.match(uid)}
    outcome: Counter[str] = Counter()
    lost_uids = []
    for uid in sorted(generated):
        status = ledger.get(uid)
        if status is not None:
            outcome[status.split(":", 1)[0]] += 1
            if status.startswith(("dropped", "rejected")):
                outcome[status] += 1
        elif uid in in_transport:
            outcome["in_transport"] += 1
        else:
            lost_uids.append(uid)
    # the injector re-sends sampler messages only byte for byte, so two contents = two groups
    reused = {uid: len(shas) for uid, shas in watcher.seen.items() if SAMPLER_UID.match(uid) and len(shas) > 1}
    lost = len(lost_uids) + sum(n - 1 for n in reused.values())
    unknown = sorted(k for k in set(watcher.seen) | set(ledger) if not k.startswith("fault-") and not SAMPLER_UID.match(k))
    if unknown:
        errors.append(f"{len(unknown)} rollout keys match neither the sampler uid pattern nor the injector's "
                      f"(e.g. {unknown[:3]}): the accounting would not cover them")

    rows = _metrics(run_dir / "run" / "metrics.jsonl")
    if steps_done_guard(rows) and not generated:
        errors.append("the learner took steps but no sampler group was seen: the accounting saw nothing")
    steps_done = max((int(r["step"]) for r in rows if "hetero/consumed" in r), default=0)
    step_rows = [r for r in rows if "hetero/consumed" in r and (checkpoint_step is None or r["step"] <= checkpoint_step)]
    consumed_by_metrics = int(sum(r["hetero/consumed"] for r in step_rows))
    consumed_in_ledger = sum(1 for s in ledger.values() if s == "consumed")
    # the learner may have taken one more batch whose step was cut by the time limit
    consumed_twice = max(0, consumed_by_metrics - consumed_in_ledger)
    unlogged = consumed_in_ledger - consumed_by_metrics
    if not 0 <= unlogged <= batch:
        errors.append(f"ledger has {consumed_in_ledger} consumed groups but the step metrics count "
                      f"{consumed_by_metrics} (batch {batch})")
    bad_finite = [r["step"] for r in step_rows if not math.isfinite(r.get("actor/loss", 0.0))]
    if bad_finite:
        errors.append(f"non-finite loss logged at steps {bad_finite[:5]}")

    # ------------------------------------------------------------------ judge each fault
    seen_names = injector.actor_names
    end_s = time.monotonic() - t0
    segment_end = {i: s.get("ended_s", end_s) for i, s in enumerate(segments)}
    for fault in injector.faults:
        kind, key = fault.kind, fault.key
        if kind == "sampler_kill":
            seg = fault.detail["segment"]
            if f"{seg}:{fault.detail['restart_name']}" in seen_names:
                fault.outcome = "survived"
            elif segment_end.get(seg, end_s) - fault.at < 30:
                fault.outcome = "not judged: run ended before the restart"
            else:
                fault.outcome = "NOT SURVIVED: sampler not restarted"
        elif kind == "learner_crash":
            seg = fault.detail["segment"]
            fault.outcome = "survived" if seg + 1 < len(segments) else "not judged: no segment after it"
        elif kind in BAD_REASON:
            expected = f"rejected:{BAD_REASON[kind]}"
            status = ledger.get(key)
            if status == expected:
                fault.outcome = "survived"
            elif status is None and key in in_transport:
                fault.outcome = "not judged: not read yet"
            else:
                fault.outcome = f"NOT SURVIVED: ledger says {status!r}, expected {expected!r}"
        elif kind.startswith("rollout_") or kind == "duplicate_other_key":
            fault.outcome = "survived" if key not in ledger else f"NOT SURVIVED: accepted as {ledger[key]!r}"
        elif kind.startswith("weights_") or kind == "clock_skew_weights":
            needed = fault.detail["version_at_fault"] + int(cfg.hetero.max_delay) + 1
            if final_version >= needed:
                fault.outcome = "survived"  # the learner kept consuming groups from newer weights
            elif end_s - fault.at < 60:
                fault.outcome = "not judged: run ended too soon"
            else:
                fault.outcome = f"NOT SURVIVED: learner stuck below version {needed}"
        elif kind == "duplicate_message":
            # one status for the uid (never "duplicate"); using it twice is caught by the
            # consumed-twice check over the whole run
            status = ledger.get(key)
            if status is not None or key in in_transport:
                fault.outcome = "survived"
            else:
                fault.outcome = "NOT SURVIVED: the uid vanished"
        elif kind in WAN_FAULT_WEIGHTS:
            after = fault.detail.get("version_after_fault") or 0
            needed = after + int(cfg.hetero.max_delay) + 1
            if final_version >= needed:
                fault.outcome = "survived"  # the learner kept training on groups from across the link
            elif end_s - fault.detail.get("ended_s", fault.at) < 90:
                fault.outcome = "not judged: run ended too soon after it"
            else:
                fault.outcome = f"NOT SURVIVED: learner stuck below version {needed}"
        elif kind == "clock_skew_rollout":
            status = ledger.get(key)
            if status is not None and not status.startswith("rejected"):
                fault.outcome = "survived"
            elif status is None and key in in_transport:
                fault.outcome = "survived (still in transport)"
            else:
                fault.outcome = f"NOT SURVIVED: ledger says {status!r}"

    accounting = {
        "ledger_source": source,
        "generated": len(generated),
        "consumed": outcome["consumed"],
        "dropped": outcome["dropped"],
        "rejected": outcome["rejected"],
        "buffered": outcome["buffered"],
        "in_transport": outcome["in_transport"],
        "reasons": {k: v for k, v in sorted(outcome.items()) if ":" in k},
        "lost_uids": lost_uids[:20],
        "reused_uids": dict(sorted(reused.items())[:20]),
        "uids_reused": len(reused),
        "sampler_groups_rejected_future": sum(1 for uid in generated if ledger.get(uid) == "rejected:future_version"),
        "consumed_by_step_metrics": consumed_by_metrics,
        "consumed_in_ledger_all": consumed_in_ledger,
        "duplicate_arrivals": int(sum(duplicates.values())),
        "leftover_temporaries": len(temporaries),
        "final_policy_version": final_version,
        "sampler_restarts": sum(1 for n in injector.actor_names
                                if SAMPLER_ACTOR.match(n.split(":", 1)[1]) and not n.endswith("-0")),
        "segments": segments,
        "leftover_actors_at_end": leftovers,
    }
    result = SoakResult(
        steps_done=steps_done, steps_executed=len(step_rows), faults=injector.faults, accounting=accounting,
        lost=lost, consumed_twice=consumed_twice, errors=errors, wall_s=time.monotonic() - t0, run_dir=str(run_dir),
    )
    if wan is not None and transport is not None:
        transport.shutdown()  # the detached mailbox (the cluster goes down next anyway)
    if started_ray:
        ray.shutdown()
    return result


def report(result: SoakResult, log=print) -> None:
    acc = result.accounting
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for fault in result.faults:
        label = "survived" if fault.outcome.startswith("survived") else (
            "not judged" if fault.outcome.startswith("not judged") else "NOT SURVIVED")
        by_kind[fault.kind][label] += 1
    survived = sum(c["survived"] for c in by_kind.values())
    judged = sum(c["survived"] + c["NOT SURVIVED"] for c in by_kind.values())
    log("=" * 72)
    log(f"soak: {result.wall_s / 60:.1f} min wall, run dir {result.run_dir}")
    log(f"steps done: {result.steps_done} (final policy version {acc['final_policy_version']}; "
        f"{len(acc['segments'])} run segment(s))")
    for i, seg in enumerate(acc["segments"]):
        log(f"  segment {i}: {seg['started_s']}s -> {seg.get('ended_s', '?')}s, ended: {seg['ended']}")
    log(f"faults injected: {len(result.faults)}")
    log(f"  {'kind':<24}{'injected':>9}{'survived':>9}{'not judged':>11}{'NOT SURV.':>10}")
    for kind in sorted(by_kind):
        c = by_kind[kind]
        log(f"  {kind:<24}{sum(c.values()):>9}{c['survived']:>9}{c['not judged']:>11}{c['NOT SURVIVED']:>10}")
    log(f"faults survived: {survived} of {judged} judged ({len(result.faults) - judged} not judged: run ended first)")
    for fault in result.faults:
        if fault.outcome.startswith("NOT"):
            log(f"  ! {fault.kind} {fault.key} at {fault.at:.0f}s: {fault.outcome}")
    log(f"groups generated by samplers: {acc['generated']} (ledger from the {acc['ledger_source']})")
    log(f"  consumed {acc['consumed']}, dropped {acc['dropped']}, rejected {acc['rejected']}, "
        f"buffered {acc['buffered']}, still in transport {acc['in_transport']}")
    log(f"  reasons: {acc['reasons']}")
    log(f"  consumed per step metrics {acc['consumed_by_step_metrics']} vs ledger {acc['consumed_in_ledger_all']} "
        f"-> consumed twice: {result.consumed_twice}")
    log(f"  sampler restarts seen: {acc['sampler_restarts']}")
    if acc["sampler_groups_rejected_future"]:
        log(f"  sampler groups rejected as future_version: {acc['sampler_groups_rejected_future']} (samplers loaded "
            f"weight versions a crashed learner published after its last checkpoint)")
    log(f"  duplicate arrivals refused: {acc['duplicate_arrivals']}; leftover temporaries/uncommitted files: "
        f"{acc['leftover_temporaries']}")
    log(f"  uids committed twice with different content: {acc['uids_reused']} {acc['reused_uids'] or ''}")
    if acc["leftover_actors_at_end"]:
        log(f"  engine actors still alive after the run returned (killed by the soak): {acc['leftover_actors_at_end']}")
    log(f"groups lost: {result.lost}" + (f" {acc['lost_uids']}" if acc["lost_uids"] else ""))
    for err in result.errors:
        log(f"ERROR: {err}")
    log(f"result: {'OK' if result.ok else 'FAILED'}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="fault schedule and run seed")
    parser.add_argument("--run-dir", type=Path, default=None, help="default /tmp/heterorl-soak-<seed>-<time>")
    parser.add_argument("--fault-every", type=float, default=5.0, help="mean seconds between faults (default 5)")
    parser.add_argument("--learner-crashes", type=int, default=2, help="learner kills, after a checkpoint (default 2)")
    parser.add_argument("--save-freq", type=int, default=5, help="checkpoint every k steps (default 5)")
    parser.add_argument("--wan", action="store_true",
                        help="samplers across the real rate-limited link of scripts/wan (needs CAP_NET_ADMIN)")
    parser.add_argument("--wan-rate-mbit", type=float, default=100.0, help="--wan: link rate (default 100)")
    parser.add_argument("--wan-cut-s", type=float, default=20.0,
                        help="--wan: a link cut / slow spell lasts this to 1.5x this many seconds (default 20)")
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides, e.g. hetero.max_delay=2")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes={args.minutes} must be > 0")
    if not args.fault_every > 0:
        parser.error(f"--fault-every={args.fault_every} must be > 0")
    wan = None
    if args.wan:
        if not 0 < args.wan_cut_s <= 120:
            parser.error(f"--wan-cut-s={args.wan_cut_s} must be in (0, 120] (bounded faults only)")
        wan = WanLink(args.wan_rate_mbit, args.wan_cut_s)
        refusal = wan.refusal()
        if refusal:
            print(f"soak --wan: {refusal}", file=sys.stderr)
            return 2
        wan.up()
    try:
        result = soak(args.minutes, args.seed, args.run_dir, args.fault_every, args.learner_crashes, args.save_freq,
                      overrides=args.overrides, wan=wan)
    finally:
        if wan is not None:
            wan.down()
    report(result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
