"""The real link of ``--wan``: the two-node cluster of research/testbeds/wan/cluster.py (samplers behind a
rate-limited veth pair) and its network faults ``link_cut``, ``link_slow`` and ``worker_gone``."""

from __future__ import annotations

import random
import time
from typing import Optional


class WanLink:
    """The two-node cluster of research/testbeds/wan/cluster.py and its network faults (see
    ``research/soak/__main__.py``). Check :meth:`refusal` before :meth:`up`: it names the missing privileges."""

    def __init__(self, rate_mbit: float, fault_s: float):
        from ..testbeds.wan import cluster, link

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
            detail = self._cut(seconds)
        elif kind == "link_slow":
            detail = self._slow(seconds)
        elif kind == "worker_gone":
            detail = self._worker_gone()
        else:
            raise ValueError(f"unknown network fault {kind!r}")
        if self._restart_dead_node():
            detail["node_restarted"] = True
        return detail

    def _cut(self, seconds: float) -> dict:
        self.link.cut(self.link_cfg)
        try:
            time.sleep(seconds)
        finally:
            self.link.heal(self.link_cfg)
        return {"seconds": seconds}

    def _slow(self, seconds: float) -> dict:
        slow = self.rate_mbit / 100
        self.link.set_rate(self.link_cfg, slow)
        try:
            time.sleep(seconds)
        finally:
            self.link.set_rate(self.link_cfg, self.rate_mbit)
        return {"seconds": seconds, "rate_mbit": slow}

    def _worker_gone(self) -> dict:
        # the sampler node gone for 20 s: its Ray processes end, its namespace and veth pair are
        # deleted, then rebuilt and a new node joins (the head's address lives on the link's
        # bridge, so the head's own connections survive; docs/reliability.md)
        seconds = 20.0
        self.cluster.worker_gone(self.cluster_cfg, self.link_cfg, seconds)
        return {"seconds": seconds}

    def _restart_dead_node(self) -> bool:
        """A cut past Ray's health check leaves the head believing the sampler node dead, and the
        node's raylet exits when it learns so: start it again, as a node supervisor would."""
        deadline = time.monotonic() + 30
        while not self._sampler_node_alive() and time.monotonic() < deadline:
            time.sleep(2)
        if self._sampler_node_alive():
            return False
        self._end_worker()
        self._start_worker()
        return True

    def _end_worker(self) -> None:
        sessions = self.cluster._read_state().get("sessions", {})
        if "worker" in sessions:
            self.cluster._end_session(int(sessions["worker"]))

    def _start_worker(self) -> None:
        self.cluster._start("worker", self.cluster.worker_command(self.cluster_cfg, self.link_cfg))
        self.cluster._wait_worker(self.cluster_cfg, self.link_cfg, 90.0)
