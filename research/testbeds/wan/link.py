#!/usr/bin/env python3
"""A real, rate-limited network link between the learner and the samplers, on one Linux box.

    python -m research.testbeds.wan.link up --rate-mbit 100    # namespace + veth pair + tbf on both ends
    python -m research.testbeds.wan.link set-rate --rate-mbit 10
    python -m research.testbeds.wan.link status [--json]
    python -m research.testbeds.wan.link cut                   # fault: the cable is pulled (both directions)
    python -m research.testbeds.wan.link heal                  # and plugged back in
    python -m research.testbeds.wan.link ns-gone --seconds 20  # fault: the sampler namespace deleted, then rebuilt
    python -m research.testbeds.wan.link down                  # idempotent: removes whatever is left

What it builds (:class:`LinkConfig`; docs/network.md): a sampler namespace joined to the root
namespace by a veth pair on a private /30, a ``tc tbf`` at the rate on both ends, the learner-side
address on a bridge so that it outlives the pair; the namespace has no default route, and nothing
else is touched. Without CAP_NET_ADMIN, CAP_SYS_ADMIN, ``ip`` and ``tc`` every command exits with
``EXIT_REFUSED`` naming what is missing, before changing anything."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

EXIT_USAGE = 2
EXIT_REFUSED = 3  # no capability / tools: nothing was changed
EXIT_FAILED = 4  # a command failed half-way; run `down` to clean up

CAP_NET_ADMIN = 12  # bit numbers in /proc/<pid>/status CapEff (linux/capability.h)
CAP_SYS_ADMIN = 21
MIN_RATE_MBIT = 0.1
MAX_RATE_MBIT = 100_000.0


@dataclass(frozen=True)
class LinkConfig:
    """Names and addresses of the link; the defaults are what every other script assumes."""

    netns: str = "heterorl-smp"
    """Network namespace of the sampler side."""
    host_if: str = "hrl-veth0"
    """veth end in the root (learner) namespace, a port of ``bridge``."""
    bridge: str = "hrl-br0"
    """Bridge in the root namespace holding ``host_ip`` (outlives the veth pair)."""
    ns_if: str = "hrl-veth1"
    """veth end inside ``netns``."""
    host_ip: str = "10.213.0.1"
    """Learner-side address (the Ray head binds here)."""
    ns_ip: str = "10.213.0.2"
    """Sampler-side address (the Ray worker node binds here)."""
    prefix: int = 30
    """Both addresses share this subnet; no other address is in it."""

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{self.host_ip}/{self.prefix}", strict=False)

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        for name in ("netns", "host_if", "ns_if", "bridge"):
            value = getattr(self, name)
            # IFNAMSIZ is 16 including the NUL; netns names become file names under /run/netns
            if not value or len(value) > 15 or not all(c.isalnum() or c in "-_." for c in value):
                raise ValueError(f"{name}={value!r}: 1-15 characters from [A-Za-z0-9-_.]")
        host, ns = ipaddress.ip_address(self.host_ip), ipaddress.ip_address(self.ns_ip)
        if not (host.is_private and ns.is_private) or host.is_loopback or ns.is_loopback:
            raise ValueError(f"host_ip={self.host_ip}, ns_ip={self.ns_ip}: both must be private, non-loopback")
        if host == ns or ns not in self.subnet:
            raise ValueError(f"ns_ip={self.ns_ip} must differ from host_ip and be in {self.subnet}")


def parse_rate_mbit(text: str | float) -> float:
    """'100', '100mbit', '1gbit', '500kbit' -> Mbit/s (float); ValueError naming the value otherwise."""
    raw = str(text).strip().lower()
    scale = 1.0
    for suffix, factor in (("gbit", 1000.0), ("mbit", 1.0), ("kbit", 0.001)):
        if raw.endswith(suffix):
            raw, scale = raw[: -len(suffix)], factor
            break
    try:
        rate = float(raw) * scale
    except ValueError:
        raise ValueError(f"rate {text!r}: expected a number of Mbit/s, e.g. 100 or 1gbit") from None
    if not (MIN_RATE_MBIT <= rate <= MAX_RATE_MBIT):
        raise ValueError(f"rate {text!r} = {rate:g} Mbit/s: must be within [{MIN_RATE_MBIT:g}, {MAX_RATE_MBIT:g}]")
    return rate


def tbf_args(rate_mbit: float) -> list[str]:
    """The ``tc qdisc ... tbf`` parameters for a rate.

    burst: 4 ms of traffic, at least 32 KiB (a token bucket smaller than a GSO segment burst
    throttles far below the rate at Gbit speeds); latency: at most 50 ms queued per direction, so
    the link adds a bounded queueing delay and drops beyond it, as a real bottleneck does.
    """
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(32 * 1024, int(rate_bytes * 0.004))
    return ["tbf", "rate", f"{int(round(rate_mbit * 1000))}kbit", "burst", str(burst), "latency", "50ms"]


def missing_requirements(capeff: int, which=shutil.which) -> list[str]:
    """What stops this script from running: missing capabilities (from a CapEff bit mask) and tools."""
    problems = []
    if not capeff >> CAP_NET_ADMIN & 1:
        problems.append("CAP_NET_ADMIN (create veth pairs, set addresses, add tc qdiscs)")
    if not capeff >> CAP_SYS_ADMIN & 1:
        problems.append("CAP_SYS_ADMIN (`ip netns add` mounts the namespace under /run/netns)")
    for tool in ("ip", "tc"):
        if which(tool) is None:
            problems.append(f"`{tool}` not on PATH (iproute2)")
    return problems


def refusal_message(problems: Sequence[str]) -> str:
    lines = ["research/testbeds/wan/link.py refuses to run: it needs root-like network privileges. Missing:"]
    lines += [f"  - {p}" for p in problems]
    lines.append("Run as root (or with CAP_NET_ADMIN and CAP_SYS_ADMIN) on Linux with iproute2; nothing was changed.")
    return "\n".join(lines)


def effective_caps(status_path: str = "/proc/self/status") -> int:
    """CapEff of this process (0 when unreadable, e.g. not Linux)."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def conflicting_routes(routes: list[dict], cfg: LinkConfig) -> list[str]:
    """Routes (``ip -j route`` entries) that overlap the link's subnet and are not the link's own."""
    out = []
    for route in routes:
        dst = route.get("dst", "")
        if dst == "default" or route.get("dev") in (cfg.host_if, cfg.bridge):
            continue
        try:
            net = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if net.version == 4 and net.overlaps(cfg.subnet):
            out.append(f"{dst} dev {route.get('dev', '?')}")
    return out


# --- side effects -------------------------------------------------------------------------------


class CommandError(RuntimeError):
    pass


def signal_until_gone(pids_now, grace_s: float, first: int = signal.SIGTERM, poll_s: float = 0.1) -> None:
    """Send ``first`` to what ``pids_now()`` returns, wait up to ``grace_s`` for it to be empty,
    then SIGKILL what is left (and wait up to 5 s more). Processes that exit meanwhile are skipped."""
    for sig, wait_s in ((first, grace_s), (signal.SIGKILL, 5.0)):
        pids = pids_now()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids_now() and time.monotonic() < deadline:
            time.sleep(poll_s)


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise CommandError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _in_ns(cfg: LinkConfig, args: list[str]) -> list[str]:
    return ["ip", "netns", "exec", cfg.netns, *args]


def netns_exists(cfg: LinkConfig) -> bool:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return any(line.split()[0] == cfg.netns for line in out.splitlines() if line.strip())


def host_if_exists(cfg: LinkConfig) -> bool:
    return _run(["ip", "link", "show", "dev", cfg.host_if], check=False).returncode == 0


def bridge_exists(cfg: LinkConfig) -> bool:
    return _run(["ip", "link", "show", "dev", cfg.bridge], check=False).returncode == 0


def _qdisc(cfg: LinkConfig, inside: bool) -> Optional[dict]:
    args = ["tc", "-j", "qdisc", "show", "dev", cfg.ns_if if inside else cfg.host_if]
    proc = _run(_in_ns(cfg, args) if inside else args, check=False)
    if proc.returncode != 0:
        return None
    for q in json.loads(proc.stdout or "[]"):
        if q.get("kind") == "tbf" and q.get("root", False):
            return q
    return None


def _addr(cfg: LinkConfig, inside: bool) -> list[str]:
    """IPv4 addresses of the sampler's veth end (``inside``) or of the learner side's bridge."""
    args = ["ip", "-j", "-4", "addr", "show", "dev", cfg.ns_if if inside else cfg.bridge]
    proc = _run(_in_ns(cfg, args) if inside else args, check=False)
    if proc.returncode != 0:
        return []
    return [
        f"{a['local']}/{a['prefixlen']}" for link in json.loads(proc.stdout or "[]") for a in link.get("addr_info", [])
    ]


def status(cfg: LinkConfig) -> dict:
    """The link's state as a dict: what exists, addresses, tbf rate (bytes/s) on each end,
    ``up`` (configured) and ``cut`` (configured, but the learner-side end is down)."""
    ns = netns_exists(cfg)
    state = {"config": asdict(cfg), "netns": ns, "host_if": host_if_exists(cfg), "bridge": bridge_exists(cfg)}
    state["cut"] = state["host_if"] and not _admin_up(cfg)
    state["host_addr"] = _addr(cfg, inside=False) if state["bridge"] else []
    state["ns_addr"] = _addr(cfg, inside=True) if ns else []
    host_q = _qdisc(cfg, inside=False) if state["host_if"] else None
    ns_q = _qdisc(cfg, inside=True) if ns else None
    state["host_tbf_bytes_s"] = host_q["options"]["rate"] if host_q else None
    state["ns_tbf_bytes_s"] = ns_q["options"]["rate"] if ns_q else None
    state["up"] = bool(
        ns
        and state["host_if"]
        and _master(cfg) == cfg.bridge
        and f"{cfg.host_ip}/{cfg.prefix}" in state["host_addr"]
        and f"{cfg.ns_ip}/{cfg.prefix}" in state["ns_addr"]
        and host_q
        and ns_q
    )
    return state


def _master(cfg: LinkConfig) -> Optional[str]:
    """The bridge the learner's veth end is a port of, or None."""
    proc = _run(["ip", "-j", "link", "show", "dev", cfg.host_if], check=False)
    return json.loads(proc.stdout or "[{}]")[0].get("master") if proc.returncode == 0 else None


def _admin_up(cfg: LinkConfig) -> bool:
    proc = _run(["ip", "-j", "link", "show", "dev", cfg.host_if], check=False)
    return proc.returncode == 0 and "UP" in json.loads(proc.stdout or "[{}]")[0].get("flags", [])


def cut(cfg: LinkConfig) -> None:
    """Fault injection: take the learner-side end down. Nothing crosses in either direction (the
    peer loses carrier); open TCP connections stay open and retransmit, as over a pulled cable."""
    _run(["ip", "link", "set", "dev", cfg.host_if, "down"])


def heal(cfg: LinkConfig) -> None:
    """Undo :func:`cut` (addresses, routes and the tbf are kept while the end is down)."""
    _run(["ip", "link", "set", "dev", cfg.host_if, "up"])


def set_rate(cfg: LinkConfig, rate_mbit: float) -> None:
    """Replace the tbf on both veth ends (each limits its own egress: together, both directions)."""
    args = tbf_args(rate_mbit)
    _run(["tc", "qdisc", "replace", "dev", cfg.host_if, "root", *args])
    _run(_in_ns(cfg, ["tc", "qdisc", "replace", "dev", cfg.ns_if, "root", *args]))


def ns_down(cfg: LinkConfig) -> None:
    """Remove the namespace (which destroys its veth end and so the pair); the bridge and the
    learner-side address stay. Idempotent."""
    if netns_exists(cfg):
        _run(["ip", "netns", "delete", cfg.netns])
    # the kernel destroys the namespace (and so the pair) asynchronously, once its last process is gone
    deadline = time.monotonic() + 10.0
    while host_if_exists(cfg) and time.monotonic() < deadline:
        time.sleep(0.1)
    if host_if_exists(cfg):  # the pair was never moved into the namespace, or a process holds it
        _run(["ip", "link", "delete", "dev", cfg.host_if], check=False)
        if host_if_exists(cfg):
            raise CommandError(f"{cfg.host_if} is still there after deleting netns {cfg.netns}")


def down(cfg: LinkConfig) -> None:
    """Remove the namespace (and so the veth pair), then the bridge; idempotent."""
    ns_down(cfg)
    if bridge_exists(cfg):
        _run(["ip", "link", "delete", "dev", cfg.bridge])


def _bridge_up(cfg: LinkConfig) -> None:
    """The learner side's bridge with ``host_ip``, if it is not there yet."""
    if not bridge_exists(cfg):
        _run(["ip", "link", "add", cfg.bridge, "type", "bridge"])
    if f"{cfg.host_ip}/{cfg.prefix}" not in _addr(cfg, inside=False):
        _run(["ip", "addr", "add", f"{cfg.host_ip}/{cfg.prefix}", "dev", cfg.bridge])
    _run(["ip", "link", "set", cfg.bridge, "up"])


def ns_up(cfg: LinkConfig, rate_mbit: float) -> None:
    """The sampler namespace and the veth pair, attached to the existing bridge, at ``rate_mbit``."""
    if not bridge_exists(cfg):
        raise CommandError(f"bridge {cfg.bridge} is missing; run `link.py up` first")
    ns_down(cfg)
    _run(["ip", "netns", "add", cfg.netns])
    _run(["ip", "link", "add", cfg.host_if, "type", "veth", "peer", "name", cfg.ns_if])
    _run(["ip", "link", "set", cfg.ns_if, "netns", cfg.netns])
    _run(["ip", "link", "set", cfg.host_if, "master", cfg.bridge])
    _run(["ip", "link", "set", cfg.host_if, "up"])
    _run(_in_ns(cfg, ["ip", "addr", "add", f"{cfg.ns_ip}/{cfg.prefix}", "dev", cfg.ns_if]))
    _run(_in_ns(cfg, ["ip", "link", "set", cfg.ns_if, "up"]))
    _run(_in_ns(cfg, ["ip", "link", "set", "lo", "up"]))  # Ray's own processes talk over loopback
    set_rate(cfg, rate_mbit)


def ns_gone(cfg: LinkConfig, seconds: float) -> None:
    """Fault injection: the sampler namespace (and the veth pair) deleted for ``seconds``, then
    rebuilt at the same rate. The learner side keeps its address on the bridge throughout."""
    if not 0 <= seconds <= 600:
        raise ValueError(f"seconds={seconds}: must be within [0, 600] (bounded faults only)")
    rate_bytes = status(cfg)["host_tbf_bytes_s"]
    if rate_bytes is None:
        raise CommandError("the link is not up; run `link.py up` first")
    ns_down(cfg)
    time.sleep(seconds)
    ns_up(cfg, rate_bytes * 8 / 1e6)


def up(cfg: LinkConfig, rate_mbit: float) -> None:
    """Create the link at ``rate_mbit``; if it is already up, only the rate changes (idempotent)."""
    state = status(cfg)
    if state["up"]:
        set_rate(cfg, rate_mbit)
        if state["cut"]:
            heal(cfg)
        return
    down(cfg)  # a half-built link from an interrupted run: start clean
    routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    clash = conflicting_routes(routes, cfg)
    if clash:
        raise CommandError(f"subnet {cfg.subnet} is already routed here ({'; '.join(clash)}); pick another --subnet")
    try:
        _bridge_up(cfg)
        ns_up(cfg, rate_mbit)
    except BaseException:
        down(cfg)
        raise


def config_from_args(args: argparse.Namespace) -> LinkConfig:
    net = ipaddress.ip_network(args.subnet, strict=True)
    if net.prefixlen != 30 or net.version != 4:
        raise ValueError(f"--subnet {args.subnet}: expected an IPv4 /30, e.g. 10.213.0.0/30")
    hosts = list(net.hosts())
    cfg = LinkConfig(netns=args.netns, host_ip=str(hosts[0]), ns_ip=str(hosts[1]), prefix=30)
    cfg.validate()
    return cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="link.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", default=LinkConfig.netns, help="sampler namespace name")
    parser.add_argument("--subnet", default="10.213.0.0/30", help="private IPv4 /30 of the link")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "set-rate"):
        p = sub.add_parser(name)
        p.add_argument("--rate-mbit", required=True, help="bandwidth per direction: Mbit/s, or e.g. 1gbit")
    p = sub.add_parser("status")
    p.add_argument("--json", action="store_true")
    sub.add_parser("down")
    sub.add_parser("cut", help="fault: no traffic either way until `heal`")
    sub.add_parser("heal")
    p = sub.add_parser("ns-gone", help="fault: delete the sampler namespace for --seconds, then rebuild it")
    p.add_argument("--seconds", type=float, required=True)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        rate = parse_rate_mbit(args.rate_mbit) if args.command in ("up", "set-rate") else None
        if args.command == "ns-gone" and not 0 <= args.seconds <= 600:
            raise ValueError(f"--seconds {args.seconds:g}: must be within [0, 600] (bounded faults only)")
    except ValueError as err:
        print(f"link.py: {err}", file=sys.stderr)
        return EXIT_USAGE
    problems = missing_requirements(effective_caps())
    if problems:
        print(refusal_message(problems), file=sys.stderr)
        return EXIT_REFUSED
    try:
        if args.command == "up":
            up(cfg, rate)
        elif args.command in ("set-rate", "cut", "heal"):
            if not status(cfg)["up"]:
                print("link.py: the link is not up; run `link.py up --rate-mbit R` first", file=sys.stderr)
                return EXIT_FAILED
            {"set-rate": lambda: set_rate(cfg, rate), "cut": lambda: cut(cfg), "heal": lambda: heal(cfg)}[
                args.command
            ]()
        elif args.command == "ns-gone":
            ns_gone(cfg, args.seconds)
        elif args.command == "down":
            down(cfg)
        state = status(cfg)
    except CommandError as err:
        print(f"link.py: {err}", file=sys.stderr)
        return EXIT_FAILED
    if args.command == "status" and args.json:
        print(json.dumps(state, indent=1))
    else:
        rate_txt = f"{state['host_tbf_bytes_s'] * 8 / 1e6:g} Mbit/s" if state["host_tbf_bytes_s"] else "-"
        print(
            f"link {('CUT' if state['cut'] else 'UP') if state['up'] else 'DOWN'}: netns {cfg.netns} {'present' if state['netns'] else 'absent'}, "
            f"{cfg.host_if} {','.join(state['host_addr']) or '-'} <-> {cfg.ns_if} {','.join(state['ns_addr']) or '-'}, "
            f"tbf {rate_txt}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
