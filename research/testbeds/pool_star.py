"""The verl engine's star with real separation on one box: an exchange server, a learner and two
sampler pools, each in its own network namespace behind its own rate-limited link.

    python -m research.testbeds.pool_star up --rate-mbit 100   # prints the exchange URL and FSSPEC_SFTP
    python -m research.testbeds.pool_star status
    python -m research.testbeds.pool_star cut --node pool0     # fault: the node's cable pulled (heal: back)
    python -m research.testbeds.pool_star exchange-restart     # fault: the server and its sessions killed
    python -m research.testbeds.pool_star down                 # idempotent

Nodes (:data:`ROLES`) hang off one bridge as ``research/testbeds/slurm_cluster.py``'s do (its
namespace, veth and ``tc tbf`` code, another subnet and names). The exchange node runs OpenSSH's
sshd (:mod:`.sftp_exchange`); its own link is not rate-limited, as an object store's is not, so each
learner or pool link is the bottleneck. Each other node starts its own Ray cluster (``ray.init``
inside its namespace): the only path between them is SFTP over their links.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import slurm_cluster as sc
from .sftp_exchange import SftpServer, missing_requirements

ROLES = {"exchange": "n1", "learner": "n2", "pool0": "n3", "pool1": "n4"}
CONFIG = sc.ClusterConfig(
    nodes=len(ROLES), subnet="10.216.0.0/24", bridge="hrl-pbr0", netns_prefix="hrl-star-",
    veth_prefix="hrlp-", state_dir="/tmp/heterorl-star",
)  # fmt: skip
EXCHANGE_PORT = 2222
EXCHANGE_ROOT = "/tmp/heterorl-star/exchange"


def netns(role: str) -> str:
    return CONFIG.netns(ROLES[role])


def address(role: str) -> str:
    return CONFIG.node_ip(ROLES[role])


def server() -> SftpServer:
    return SftpServer(Path(CONFIG.state_dir) / "sshd", address("exchange"), EXCHANGE_PORT, netns("exchange"))


def exchange_url(run: str) -> str:
    """The ``sftp://`` URL of run ``run``'s exchange folder on the server."""
    return server().url(f"{EXCHANGE_ROOT}/{run}")


def in_node(role: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``role``'s namespace."""
    return ["ip", "netns", "exec", netns(role), *argv]


def up(rate_mbit: Optional[float]) -> SftpServer:
    """Bridge, one namespace per role (the exchange's link unlimited), sshd on the exchange node."""
    problems = missing_requirements() + sc.missing_requirements(sc.link.effective_caps())
    if problems:
        raise sc.CommandError("the star needs " + "; ".join(problems))
    down()
    Path(EXCHANGE_ROOT).mkdir(parents=True, exist_ok=True)
    sc.bridge_up(CONFIG)
    for role, name in ROLES.items():
        sc.node_net_up(CONFIG, name, None if role == "exchange" else rate_mbit)
    srv = server()
    srv.start()
    return srv


def set_rate(role: str, rate_mbit: Optional[float]) -> None:
    sc.set_rate(CONFIG, ROLES[role], rate_mbit)


def cut(role: str) -> None:
    """Fault: the bridge side of the node's pair goes down; nothing crosses either way."""
    sc._run(["ip", "link", "set", CONFIG.host_if(ROLES[role]), "down"])


def heal(role: str) -> None:
    sc._run(["ip", "link", "set", CONFIG.host_if(ROLES[role]), "up"])


def down() -> None:
    """Every process in the nodes' namespaces ends; namespaces, veths, bridge and files go."""
    for name in reversed(list(ROLES.values())):
        sc.node_net_down(CONFIG, name)
    if sc.link_exists(CONFIG.bridge):
        sc._run(["ip", "link", "delete", "dev", CONFIG.bridge])
    server().remove()
    shutil.rmtree(CONFIG.state_dir, ignore_errors=True)


def status() -> dict:
    return {
        role: {
            "netns": netns(role),
            "address": address(role),
            "present": netns(role) in sc.netns_list(),
            "link_up": "UP" in sc._link_flags(CONFIG.host_if(name)),
            "rate_bytes_s": sc._tbf_bytes_s(CONFIG.host_if(name)),
            "processes": len(sc.netns_pids(netns(role))),
        }
        for role, name in ROLES.items()
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pool_star.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up").add_argument("--rate-mbit", type=float, default=100.0)
    for name in ("cut", "heal"):
        sub.add_parser(name).add_argument("--node", choices=[r for r in ROLES if r != "exchange"], required=True)
    for name in ("status", "down", "exchange-restart"):
        sub.add_parser(name)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            srv = up(args.rate_mbit)
            print(f"exchange: {exchange_url('RUN')}\nexport FSSPEC_SFTP='{srv.client_env()['FSSPEC_SFTP']}'")
        elif args.cmd == "status":
            print(json.dumps(status(), indent=1))
        elif args.cmd == "cut":
            cut(args.node)
        elif args.cmd == "heal":
            heal(args.node)
        elif args.cmd == "exchange-restart":
            srv = server()
            for pid in sc.netns_pids(netns("exchange")):
                os.kill(pid, 9)  # another process started it: end whatever runs on the exchange node
            srv.start()
        else:
            down()
    except sc.CommandError as err:
        print(f"pool_star.py {args.cmd}: {err}", file=sys.stderr)
        return sc.EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
