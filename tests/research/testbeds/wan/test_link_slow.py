"""The real link and a real two-node Ray cluster across it (needs CAP_NET_ADMIN, ip, tc; slow).

    nice -n 10 .venv/bin/pytest -q -m slow tests/research/testbeds/wan/test_link_slow.py

Sets the link up at 20 Mbit/s, checks a bounded TCP transfer runs near that rate, starts the Ray
head (learner side) and worker (inside the sampler namespace), checks an actor asking for the
``sampler_node`` resource runs in the namespace and that an object it pulls from the head is
held to the link's rate, takes the sampler node away and back (the head keeps its address and a new
actor runs on the new node), then tears down and checks nothing is left: no namespace, no veth, no
bridge, no Ray process of ours.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.research.testbeds.wan.wan_scripts import load


link = load("link")
cluster = load("cluster")
probe = load("probe")

RATE_MBIT = 20.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only"),
    pytest.mark.skipif(
        bool(link.missing_requirements(link.effective_caps())),
        reason="needs " + "; ".join(link.missing_requirements(link.effective_caps())),
    ),
]

# a driver in its own process (Ray's auth mode is read at import; this keeps pytest's env clean)
DRIVER = textwrap.dedent(
    """
    import json, sys, time, ray
    address, host_ip, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(address=address, _node_ip_address=host_ip, log_to_driver=False, logging_level="ERROR")

    @ray.remote(num_cpus=0, resources={"sampler_node": 0.01})
    class Sampler:
        def ip(self):
            return ray.util.get_node_ip_address()
        def pull(self, box):
            t0 = time.perf_counter()
            data = ray.get(box[0], timeout=120)
            return len(data), time.perf_counter() - t0

    actor = Sampler.remote()
    ip = ray.get(actor.ip.remote(), timeout=120)
    size, seconds = ray.get(actor.pull.remote([ray.put(bytes(nbytes))]), timeout=180)
    print(json.dumps({"ip": ip, "bytes": size, "seconds": seconds}))
    ray.shutdown()
    """
)


def _our_ray_processes(state: dict) -> list[int]:
    return [pid for sid in state.get("sessions", {}).values() for pid in cluster._session_pids(int(sid))]


@pytest.fixture
def wan():
    link_cfg, cfg = link.LinkConfig(), cluster.ClusterConfig()
    if link.status(link_cfg)["netns"] or cluster.STATE_FILE.exists():
        pytest.skip(f"netns {link_cfg.netns} or {cluster.STATE_FILE} already exists: another run owns the link")
    try:
        address = cluster.up(cfg, link_cfg, RATE_MBIT)
        state = json.loads(cluster.STATE_FILE.read_text())
        yield link_cfg, address
    finally:
        cluster.down(cfg, link_cfg)
    # nothing left behind
    assert not link.netns_exists(link_cfg)
    assert not link.host_if_exists(link_cfg) and not link.bridge_exists(link_cfg)
    assert _our_ray_processes(state) == []
    assert not cluster.STATE_FILE.exists() and not cluster.TOKEN_FILE.exists()


def test_link_rate_and_ray_actor_in_the_sampler_namespace(wan):
    link_cfg, address = wan
    state = link.status(link_cfg)
    assert state["up"] and state["host_tbf_bytes_s"] == state["ns_tbf_bytes_s"] == RATE_MBIT * 1e6 / 8

    # raw TCP, 5 MB: 2 s at 20 Mbit/s; the tbf holds it near the rate (generous band: shared box)
    tcp = probe.transfer(link_cfg, 5_000_000, timeout=60)
    assert tcp["bytes"] == 5_000_000
    assert 0.6 * RATE_MBIT <= tcp["mbit_s"] <= 1.1 * RATE_MBIT, tcp

    # the namespace has no way out but the link: no default route
    routes = subprocess.run(
        ["ip", "netns", "exec", link_cfg.netns, "ip", "-j", "route"], capture_output=True, text=True
    )
    assert [r["dst"] for r in json.loads(routes.stdout)] == [str(link_cfg.subnet)]

    # Ray: the actor asking for sampler_node runs in the namespace; its pull is held to the rate
    nbytes = 2_500_000  # 1 s at 20 Mbit/s
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, address, link_cfg.host_ip, str(nbytes)],
        capture_output=True,
        text=True,
        timeout=300,
        env=cluster.ray_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ip"] == link_cfg.ns_ip and got["bytes"] == nbytes
    mbit_s = nbytes * 8 / 1e6 / got["seconds"]
    assert 0.5 * RATE_MBIT <= mbit_s <= 1.1 * RATE_MBIT, got

    # fault: a cut link carries nothing (the transfer times out); healed, it carries again
    link.cut(link_cfg)
    assert link.status(link_cfg)["cut"]
    with pytest.raises(OSError):  # socket.timeout / TimeoutError are OSErrors
        probe.transfer(link_cfg, 100_000, timeout=3)
    link.heal(link_cfg)
    assert probe.transfer(link_cfg, 500_000, timeout=30)["bytes"] == 500_000

    # `up` on a link that is up only changes the rate (idempotent)
    link.up(link_cfg, 2 * RATE_MBIT)
    again = link.status(link_cfg)
    assert again["up"] and again["host_tbf_bytes_s"] == again["ns_tbf_bytes_s"] == 2 * RATE_MBIT * 1e6 / 8

    # fault: the sampler node gone (namespace and veth deleted) -- the head's address stays on the
    # bridge the whole time, and the node that comes back runs sampler actors again
    link.ns_down(link_cfg)
    gone = link.status(link_cfg)
    assert not gone["netns"] and not gone["host_if"] and f"{link_cfg.host_ip}/30" in gone["host_addr"]
    link.ns_up(link_cfg, RATE_MBIT)
    cluster.worker_gone(cluster.ClusterConfig(), link_cfg, seconds=1)
    back = link.status(link_cfg)
    assert back["up"] and back["host_tbf_bytes_s"] == RATE_MBIT * 1e6 / 8
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, address, link_cfg.host_ip, "250000"],
        capture_output=True,
        text=True,
        timeout=300,
        env=cluster.ray_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ip"] == link_cfg.ns_ip
