#!/usr/bin/env python3
"""A two-node Ray cluster across the rate-limited link: head = learner node, worker = sampler node.

    python -m research.testbeds.wan.cluster up --rate-mbit 100         # link (link.py up) + Ray head + Ray worker
    python -m research.testbeds.wan.cluster status
    python -m research.testbeds.wan.cluster worker-gone --seconds 20   # fault: sampler node gone and back
    python -m research.testbeds.wan.cluster down                       # Ray processes of this script, then the link

The head runs in the root namespace with the resource ``{"learner_node": 1}``, the worker inside
the sampler namespace with ``{"sampler_node": 1}``: an actor placed with
``resources={"sampler_node": 0.01}`` fetches and sends every object across the link. Kept apart from
other Ray users of the machine (docs/network.md): its own ``--temp-dir`` and auth token, and ``down``
ends only the two process sessions this script started (ids in ``STATE_FILE``), never ``ray stop``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m research.testbeds.wan.cluster ...")
from . import link  # noqa: E402
from .link import LinkConfig  # noqa: E402

ROOT = Path("/tmp/heterorl-wan")
STATE_FILE = ROOT / "cluster.json"
TOKEN_FILE = ROOT / "auth_token"  # this cluster's own Ray auth token (never ~/.ray/auth_token)
RAY_BIN = str(Path(sys.executable).with_name("ray"))


@dataclass(frozen=True)
class ClusterConfig:
    """How the two Ray nodes are started."""

    port: int = 6391
    """GCS port of the head, on the learner-side address."""
    temp_dir: str = str(ROOT / "ray")
    """Ray's temp dir for both nodes (kept apart from the machine's default /tmp/ray)."""
    object_store_mb: int = 256
    """Object store per node; weights of the toy model are a few MB."""
    head_cpus: int = 1
    """Logical CPUs of the head (learner) node."""
    worker_cpus: int = 1
    """Logical CPUs of the worker (sampler) node."""
    head_resources: dict = field(default_factory=lambda: {"learner_node": 1})
    worker_resources: dict = field(default_factory=lambda: {"sampler_node": 1})

    def address(self, link_cfg: LinkConfig) -> str:
        return f"{link_cfg.host_ip}:{self.port}"


def ray_env() -> dict[str, str]:
    """Environment of every process of this cluster, drivers included: Ray's token auth with the
    cluster's own token (a worker node or driver without it is refused by the head), no
    usage-stats upload, one thread per op (this box is shared)."""
    return dict(
        os.environ,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(TOKEN_FILE),
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS="1",
        RAY_ADDRESS="",
    )


def join_env() -> None:
    """Make this process a driver of the cluster: its environment as ``ray_env()``. Ray reads the
    auth mode once, when it is imported; if it already is, re-read it as Ray itself does."""
    os.environ.update(ray_env())
    if "ray" in sys.modules:
        from ray._raylet import Config

        Config.initialize("")


def write_token() -> None:
    """A fresh random token (as ``ray get-auth-token --generate`` makes), readable by root only."""
    ROOT.mkdir(parents=True, exist_ok=True)
    TOKEN_FILE.unlink(missing_ok=True)
    fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def head_command(cfg: ClusterConfig, link_cfg: LinkConfig) -> list[str]:
    return [
        RAY_BIN,
        "start",
        "--head",
        "--block",
        f"--node-ip-address={link_cfg.host_ip}",
        f"--port={cfg.port}",
        f"--temp-dir={cfg.temp_dir}",
        f"--num-cpus={cfg.head_cpus}",
        "--num-gpus=0",
        f"--resources={json.dumps(cfg.head_resources)}",
        f"--object-store-memory={cfg.object_store_mb * 2**20}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]


def worker_command(cfg: ClusterConfig, link_cfg: LinkConfig) -> list[str]:
    return [
        "ip",
        "netns",
        "exec",
        link_cfg.netns,
        RAY_BIN,
        "start",
        "--block",
        f"--address={cfg.address(link_cfg)}",
        f"--node-ip-address={link_cfg.ns_ip}",
        f"--num-cpus={cfg.worker_cpus}",
        "--num-gpus=0",
        f"--resources={json.dumps(cfg.worker_resources)}",
        f"--object-store-memory={cfg.object_store_mb * 2**20}",
        "--disable-usage-stats",
    ]


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the ``ray start`` we launched and everything it forked)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields_ = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields_[3]) == sid and fields_[0] != "Z":  # field 6 of stat: session id
            pids.append(int(entry))
    return pids


def _end_session(sid: int, grace_s: float = 10.0) -> None:
    """SIGTERM then SIGKILL every process of a session this script started."""
    link.signal_until_gone(lambda: _session_pids(sid), grace_s, poll_s=0.2)


def _wait_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{' '.join(proc.args[:3])}` exited with {proc.returncode}; see {ROOT}/*.log")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"Ray head not listening on {host}:{port} after {timeout_s}s")


def _read_state() -> dict:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def alive_nodes(address: str, node_ip: str, timeout_s: float = 30.0) -> list[dict]:
    """The alive nodes' ip and resources, asked from the GCS in a short-lived subprocess (so the
    caller's own Ray connection, if any, is untouched)."""
    code = (
        "import json, ray; ray.init(address=%r, _node_ip_address=%r, logging_level='ERROR', log_to_driver=False);"
        "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']}"
        " for n in ray.nodes() if n['Alive']]))" % (address, node_ip)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=ray_env())
    if out.returncode != 0:
        raise RuntimeError(f"cannot query the cluster at {address}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _start(role: str, cmd: list[str]) -> subprocess.Popen:
    """Start one node's ``ray start --block`` in a session of its own, recorded in STATE_FILE."""
    with open(ROOT / f"{role}.log", "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ray_env(), start_new_session=True)
    state = _read_state()
    state.setdefault("sessions", {})[role] = proc.pid  # start_new_session: pid == sid == pgid
    STATE_FILE.write_text(json.dumps(state))
    return proc


def _wait_worker(cfg: ClusterConfig, link_cfg: LinkConfig, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = alive_nodes(cfg.address(link_cfg), link_cfg.host_ip)
        if link_cfg.ns_ip in {n["ip"] for n in nodes}:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker node {link_cfg.ns_ip} did not join in {timeout_s}s; see {ROOT}/worker.log")
        time.sleep(1.0)


def up(cfg: ClusterConfig, link_cfg: LinkConfig, rate_mbit: float, timeout_s: float = 90.0) -> str:
    """Link up at ``rate_mbit``, then head and worker; returns the head address. On any failure
    everything started here is torn down again."""
    down(cfg, link_cfg, keep_link=True)  # Ray left from an interrupted run: start clean
    link.up(link_cfg, rate_mbit)
    write_token()
    for role in ("head", "worker"):
        (ROOT / f"{role}.log").unlink(missing_ok=True)
    STATE_FILE.write_text(json.dumps({"cluster": asdict(cfg), "link": asdict(link_cfg), "sessions": {}}))
    try:
        _wait_port(link_cfg.host_ip, cfg.port, timeout_s, _start("head", head_command(cfg, link_cfg)))
        _start("worker", worker_command(cfg, link_cfg))
        _wait_worker(cfg, link_cfg, timeout_s)
        return cfg.address(link_cfg)
    except BaseException:
        down(cfg, link_cfg)
        raise


def worker_gone(cfg: ClusterConfig, link_cfg: LinkConfig, seconds: float, timeout_s: float = 90.0) -> None:
    """Fault injection: the sampler node disappears (its Ray processes end, its namespace and veth
    are deleted) for ``seconds``, then comes back at the same rate and rejoins the head as a new
    node with the same ``sampler_node`` resource. Actors that lived on it are dead. The head keeps
    its address (it lives on the link's bridge, not on the deleted veth)."""
    if not 0 <= seconds <= 600:
        raise ValueError(f"seconds={seconds}: must be within [0, 600] (bounded faults only)")
    rate_bytes = link.status(link_cfg)["host_tbf_bytes_s"]
    if rate_bytes is None:
        raise link.CommandError("the link is not up; run `cluster.py up` first")
    sessions = _read_state().get("sessions", {})
    if "worker" in sessions:
        _end_session(int(sessions["worker"]))
    link.ns_down(link_cfg)
    time.sleep(seconds)
    link.ns_up(link_cfg, rate_bytes * 8 / 1e6)
    _start("worker", worker_command(cfg, link_cfg))
    _wait_worker(cfg, link_cfg, timeout_s)


def down(cfg: ClusterConfig, link_cfg: LinkConfig, keep_link: bool = False) -> None:
    """End the Ray sessions recorded in the state file (worker first), then the link; idempotent."""
    sessions = _read_state().get("sessions", {})
    for role in ("worker", "head"):
        if role in sessions:
            _end_session(int(sessions[role]))
    STATE_FILE.unlink(missing_ok=True)
    TOKEN_FILE.unlink(missing_ok=True)
    if not keep_link:
        link.down(link_cfg)


def status(cfg: ClusterConfig, link_cfg: LinkConfig) -> dict:
    """The link's state, live processes per recorded Ray session, and the alive nodes."""
    state = _read_state()
    sessions = {role: len(_session_pids(int(sid))) for role, sid in state.get("sessions", {}).items()}
    out = {"link": link.status(link_cfg), "ray_processes": sessions, "nodes": []}
    if sessions.get("head"):
        address = f"{link_cfg.host_ip}:{state.get('cluster', {}).get('port', cfg.port)}"  # as started
        out["address"] = address
        try:
            out["nodes"] = alive_nodes(address, link_cfg.host_ip)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            out["nodes_error"] = str(err)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up")
    p.add_argument("--rate-mbit", required=True, help="link bandwidth per direction (Mbit/s)")
    p.add_argument("--port", type=int, default=ClusterConfig.port, help="GCS port of the head")
    sub.add_parser("status")
    sub.add_parser("down")
    p = sub.add_parser("worker-gone", help="fault: end the sampler node and its namespace, bring both back")
    p.add_argument("--seconds", type=float, default=20.0, help="how long it stays gone (0-600)")
    args = parser.parse_args(argv)
    link_cfg = LinkConfig()
    # `up` takes --port; the other commands use the port the running cluster was started with
    port = args.port if args.command == "up" else _read_state().get("cluster", {}).get("port", ClusterConfig.port)
    cfg = ClusterConfig(port=int(port))
    try:
        rate = link.parse_rate_mbit(args.rate_mbit) if args.command == "up" else None
    except ValueError as err:
        print(f"cluster.py: {err}", file=sys.stderr)
        return link.EXIT_USAGE
    problems = link.missing_requirements(link.effective_caps())
    if problems:
        print(link.refusal_message(problems), file=sys.stderr)
        return link.EXIT_REFUSED
    try:
        if args.command == "up":
            print(f"Ray head at {up(cfg, link_cfg, rate)}; join with RAY_ADDRESS={cfg.address(link_cfg)}")
        elif args.command == "down":
            down(cfg, link_cfg)
        elif args.command == "worker-gone":
            worker_gone(cfg, link_cfg, args.seconds)
        print(json.dumps(status(cfg, link_cfg), indent=1))
    except (link.CommandError, RuntimeError, TimeoutError, ValueError) as err:
        print(f"cluster.py: {err}", file=sys.stderr)
        return link.EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
