#!/usr/bin/env python3
"""A real SLURM cluster of N nodes on one Linux box, each node a network + UTS namespace.

    python -m research.testbeds.slurm_cluster up --nodes 3 [--rate-mbit 100] [--cpus-per-node 2]
    export SLURM_CONF=/tmp/heterorl-slurm/slurm.conf      # `up` prints this as its last line
    sinfo; srun -N2 hostname; sbatch --nodes=2 job.sbatch  # any Slurm command, pointed at it
    python -m research.testbeds.slurm_cluster status [--json]
    python -m research.testbeds.slurm_cluster cut --node n2        # fault: n2's cable pulled (heal: back)
    python -m research.testbeds.slurm_cluster node-gone --node n2  # fault: n2 powered off (node-back: rebuilt)
    python -m research.testbeds.slurm_cluster down                 # idempotent: removes whatever is left

What it builds (:class:`ClusterConfig`; docs/scale-out.md): a bridge with the controller's address and
nodes ``n1..nN``, each a namespace behind a veth pair (``tc tbf`` on both ends with ``--rate-mbit``)
with its own hostname, hosts file and ``slurmd``; one ``munged`` and ``slurmctld`` of its own. Its
files are under ``STATE_DIR``, and it stops only what it started, by recorded process id. Needs root
(``up`` installs Slurm with apt-get if missing); without it every command exits with ``EXIT_REFUSED``."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence


def _load_wan_link():
    """``research/testbeds/wan/link.py`` (namespaces, tbf, capability checks), imported by path."""
    name = "heterorl_wan_link"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent / "wan" / "link.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


link = _load_wan_link()
CommandError = link.CommandError
EXIT_USAGE, EXIT_REFUSED, EXIT_FAILED = link.EXIT_USAGE, link.EXIT_REFUSED, link.EXIT_FAILED

PROG = "slurm_cluster.py"
STATE_DIR = "/tmp/heterorl-slurm"
MAX_NODES = 64
SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SLURM_BINARIES = ("slurmctld", "slurmd", "sinfo", "srun", "sbatch", "scontrol", "munged", "munge")
NODE_TOOLS = ("nsenter", "unshare", "setpriv")  # util-linux


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster's shape, names and addresses; the defaults are what the other scripts assume."""

    nodes: int = 3
    """Number of nodes, named ``n1..nN``."""
    cpus_per_node: int = 2
    """CPUs each node reports (``CPUs=``); any count works (``SlurmdParameters=config_overrides``),
    but every node shares the machine's real cores."""
    real_memory_mb: int = 4000
    """Memory each node reports (``RealMemory=``); not enforced (no cgroups)."""
    subnet: str = "10.214.0.0/24"
    """Private IPv4 subnet of the bridge; the controller takes its first address."""
    first_node_host: int = 11
    """Host number of ``n1`` in ``subnet``: n1 = .11, n2 = .12, ..."""
    bridge: str = "hrl-sbr0"
    """Bridge in the root namespace holding the controller's address."""
    netns_prefix: str = "hrl-slurm-"
    """Network namespace of node ``nK``: ``<netns_prefix>nK``."""
    veth_prefix: str = "hrls-"
    """Root-namespace end of node ``nK``'s veth pair (a bridge port): ``<veth_prefix>nK``; the other
    end is ``eth0`` inside the node's namespace."""
    state_dir: str = STATE_DIR
    """slurm.conf, state file, logs, spool, munge socket and key; removed by ``down``."""
    partition: str = "heterorl"
    """The one partition, over all nodes (the default partition)."""
    ctld_port: int = 6817
    """slurmctld's port on the controller's address."""
    slurmd_port: int = 6818
    """slurmd's port on each node's address (each node has its own network stack)."""
    default_time: str = "02:00:00"
    """Time limit of a job that asks for none."""
    max_time: str = "1-00:00:00"
    """Longest time limit a job may ask for."""
    slurmd_timeout_s: int = 30
    """A node whose slurmd is silent this long is marked DOWN (faults are seen within this)."""

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(self.subnet, strict=True)

    @property
    def controller_ip(self) -> str:
        return str(next(self.network.hosts()))

    @property
    def node_names(self) -> list[str]:
        return [f"n{k}" for k in range(1, self.nodes + 1)]

    def node_ip(self, name: str) -> str:
        return str(self.network.network_address + self.first_node_host + int(name[1:]) - 1)

    def netns(self, name: str) -> str:
        return self.netns_prefix + name

    def host_if(self, name: str) -> str:
        return self.veth_prefix + name

    @property
    def conf_path(self) -> Path:
        return Path(self.state_dir) / "slurm.conf"

    @property
    def state_file(self) -> Path:
        return Path(self.state_dir) / "cluster.json"

    @property
    def munge_socket(self) -> Path:
        return Path(self.state_dir) / "munge" / "munge.socket"

    @property
    def hosts_file(self) -> Path:
        return Path(self.state_dir) / "hosts"

    def validate(self) -> None:
        """Raise ValueError naming the bad field (as its command-line flag) and its value."""
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes {self.nodes}: must be within [1, {MAX_NODES}]")
        if not 1 <= self.cpus_per_node <= 1024:
            raise ValueError(f"--cpus-per-node {self.cpus_per_node}: must be within [1, 1024]")
        if self.real_memory_mb < 100:
            raise ValueError(f"--real-memory-mb {self.real_memory_mb}: must be at least 100")
        try:
            net = self.network
        except ValueError as err:
            raise ValueError(f"--subnet {self.subnet}: {err}") from None
        if net.version != 4 or not net.is_private or net.is_loopback:
            raise ValueError(f"--subnet {self.subnet}: expected a private IPv4 subnet, e.g. 10.214.0.0/24")
        if not 2 <= self.first_node_host or self.first_node_host + self.nodes >= net.num_addresses:
            raise ValueError(
                f"--subnet {self.subnet} has no room for {self.nodes} nodes from host .{self.first_node_host}"
            )
        longest = f"n{self.nodes}"
        for name, value in (("bridge", self.bridge), ("netns", self.netns(longest)), ("veth", self.host_if(longest))):
            # IFNAMSIZ is 16 including the NUL; netns names become file names under /run/netns
            if len(value) > 15 or not all(c.isalnum() or c in "-_." for c in value):
                raise ValueError(f"{name} name {value!r}: 1-15 characters from [A-Za-z0-9-_.]")
        if not os.path.isabs(self.state_dir) or os.path.normpath(self.state_dir) == "/":
            raise ValueError(f"state_dir {self.state_dir!r}: must be an absolute path other than /")


# --- pure parts ---------------------------------------------------------------------------------


def node_addresses(cfg: ClusterConfig) -> dict[str, str]:
    """Node name -> its address on the bridge, in node order."""
    return {name: cfg.node_ip(name) for name in cfg.node_names}


def controller_hostname() -> str:
    """This machine's short hostname: slurmctld only runs where it matches ``SlurmctldHost``."""
    return socket.gethostname().split(".")[0]


def render_slurm_conf(cfg: ClusterConfig, controller_host: str) -> str:
    """slurm.conf of the cluster: no GRES, no cgroups, no accounting; every path under state_dir."""
    d = cfg.state_dir
    lines = [
        f"# Written by research/testbeds/slurm_cluster.py: {cfg.nodes} namespace nodes on {controller_host}.",
        "ClusterName=heterorl",
        f"SlurmctldHost={controller_host}({cfg.controller_ip})",
        f"SlurmctldPort={cfg.ctld_port}",
        f"SlurmdPort={cfg.slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={cfg.munge_socket}",
        "CommunicationParameters=NoCtldInAddrAny",
        f"StateSaveLocation={d}/ctld",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/run/slurmctld.pid",
        f"SlurmdPidFile={d}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SwitchType=switch/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",  # nodes report the configured CPUs, not the real count
        "ReturnToService=2",  # a node that was DOWN returns to service when its slurmd registers
        f"SlurmdTimeout={cfg.slurmd_timeout_s}",
        "SlurmctldTimeout=30",
        "MessageTimeout=10",
        "KillWait=5",
        "InactiveLimit=0",
        "MinJobAge=300",
        "MailProg=/bin/true",
    ]
    for name, ip in node_addresses(cfg).items():
        lines.append(
            f"NodeName={name} NodeAddr={ip} NodeHostname={name} CPUs={cfg.cpus_per_node} "
            f"RealMemory={cfg.real_memory_mb} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName={cfg.partition} Nodes={','.join(cfg.node_names)} Default=YES "
        f"DefaultTime={cfg.default_time} MaxTime={cfg.max_time} State=UP"
    )
    return "\n".join(lines) + "\n"


def render_hosts(cfg: ClusterConfig, controller_host: str) -> str:
    """The /etc/hosts every node sees: loopback, the controller and every node by name."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines.append(f"{cfg.controller_ip}\t{controller_host}")
    lines += [f"{ip}\t{name}" for name, ip in node_addresses(cfg).items()]
    return "\n".join(lines) + "\n"


def with_cluster_hosts(cfg: ClusterConfig, argv: list[str], hostname: Optional[str] = None) -> list[str]:
    """``argv`` in a mount namespace of its own where the cluster's hosts file is /etc/hosts, and
    with ``hostname`` also in a UTS namespace with that hostname. unshare execs without forking
    and the shell execs ``argv``: the started process's id is ``argv``'s."""
    script = 'h="$1" f="$2"; shift 2; { [ -z "$h" ] || hostname "$h"; } && mount --bind "$f" /etc/hosts && exec "$@"'
    uts = ["--uts"] if hostname else []
    return [
        "unshare",
        "--mount",
        "--propagation",
        "slave",
        *uts,
        "--",
        "sh",
        "-c",
        script,
        "sh",
        hostname or "",
        str(cfg.hosts_file),
        *argv,
    ]


def slurmd_command(cfg: ClusterConfig, name: str, slurmd: str = "slurmd") -> list[str]:
    """slurmd of node ``name``: in the node's network namespace (nsenter execs without forking, and
    unlike `ip netns exec` keeps the host's /sys), with hostname ``name`` and the cluster's hosts."""
    argv = [slurmd, "-D", "-f", str(cfg.conf_path)]
    return ["nsenter", f"--net=/run/netns/{cfg.netns(name)}", "--", *with_cluster_hosts(cfg, argv, hostname=name)]


def slurmctld_command(cfg: ClusterConfig, slurmctld: str = "slurmctld") -> list[str]:
    """slurmctld in the root namespace; it sees the cluster's hosts file, where this machine's name
    is the bridge address, so with ``NoCtldInAddrAny`` it listens on that address only."""
    return with_cluster_hosts(cfg, [slurmctld, "-D", "-f", str(cfg.conf_path)])


def missing_requirements(capeff: int, which=shutil.which) -> list[str]:
    """What stops this script: link.py's capabilities and iproute2, plus util-linux's tools."""
    problems = link.missing_requirements(capeff, which)
    problems += [f"`{tool}` not on PATH (util-linux)" for tool in NODE_TOOLS if which(tool) is None]
    return problems


def refusal_message(problems: Sequence[str]) -> str:
    lines = [f"research/testbeds/{PROG} refuses to run: it needs root (namespaces, veths, mounts). Missing:"]
    lines += [f"  - {p}" for p in problems]
    lines.append("Run as root (CAP_NET_ADMIN, CAP_SYS_ADMIN) with iproute2 and util-linux; nothing was changed.")
    return "\n".join(lines)


def missing_slurm(which=shutil.which) -> list[str]:
    return [b for b in SLURM_BINARIES if which(b) is None]


def parse_sinfo(text: str) -> dict[str, str]:
    """``sinfo -h -N -o '%N %T'`` lines -> node -> state (a node listed twice keeps its first)."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            states.setdefault(parts[0], parts[1])
    return states


# --- processes ----------------------------------------------------------------------------------


def _start_time(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of a live, non-zombie process; None otherwise."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            after = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if after[0] in ("Z", "X") else int(after[19])  # field 3 is the state, 22 starttime


def proc_record(pid: int) -> dict:
    return {"pid": pid, "start": _start_time(pid)}


def alive(record: Optional[dict]) -> bool:
    """The recorded process is still that process (same id and start time) and not a zombie."""
    return bool(record) and record.get("start") is not None and _start_time(int(record["pid"])) == record["start"]


def stop_process(record: Optional[dict], grace_s: float = 10.0) -> None:
    """End a process this script recorded, by id (only if its start time still matches)."""
    if alive(record):
        link.signal_until_gone(lambda: [int(record["pid"])] if alive(record) else [], grace_s)


def _netns_inode(netns: str) -> Optional[int]:
    try:
        return os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return None


def netns_pids(netns: str) -> list[int]:
    """Live processes inside network namespace ``netns`` (a node's slurmd, job steps, Ray...)."""
    inode = _netns_inode(netns)
    if inode is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode and _start_time(int(entry)) is not None:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


# --- network ------------------------------------------------------------------------------------

_run = link._run  # `ip`/`tc` with a timeout, CommandError on failure


def netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_exists(dev: str) -> bool:
    return _run(["ip", "link", "show", "dev", dev], check=False).returncode == 0


def _link_flags(dev: str, netns: Optional[str] = None) -> list[str]:
    proc = _run(["ip", *(["-n", netns] if netns else []), "-j", "link", "show", "dev", dev], check=False)
    return json.loads(proc.stdout or "[{}]")[0].get("flags", []) if proc.returncode == 0 else []


def _tbf_bytes_s(dev: str, netns: Optional[str] = None) -> Optional[int]:
    proc = _run(["tc", *(["-n", netns] if netns else []), "-j", "qdisc", "show", "dev", dev], check=False)
    if proc.returncode != 0:
        return None
    for q in json.loads(proc.stdout or "[]"):
        if q.get("kind") == "tbf" and q.get("root", False):
            return q["options"]["rate"]
    return None


def _addrs(dev: str, netns: Optional[str] = None) -> list[str]:
    proc = _run(["ip", *(["-n", netns] if netns else []), "-j", "-4", "addr", "show", "dev", dev], check=False)
    if proc.returncode != 0:
        return []
    return [f"{a['local']}/{a['prefixlen']}" for x in json.loads(proc.stdout or "[]") for a in x.get("addr_info", [])]


def set_rate(cfg: ClusterConfig, name: str, rate_mbit: Optional[float]) -> None:
    """A tbf at ``rate_mbit`` on both ends of the node's pair (each limits its own egress), or none."""
    ns = cfg.netns(name)
    for prefix, dev in (([], cfg.host_if(name)), (["-n", ns], "eth0")):
        if rate_mbit is None:
            _run(["tc", *prefix, "qdisc", "del", "dev", dev, "root"], check=False)
        else:
            _run(["tc", *prefix, "qdisc", "replace", "dev", dev, "root", *link.tbf_args(rate_mbit)])


def bridge_up(cfg: ClusterConfig) -> None:
    net = cfg.network
    routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    clash = link.conflicting_routes(routes, SimpleNamespace(host_if=cfg.bridge, bridge=cfg.bridge, subnet=net))
    if clash:
        raise CommandError(f"subnet {net} is already routed here ({'; '.join(clash)}); pick another --subnet")
    if not link_exists(cfg.bridge):
        _run(["ip", "link", "add", cfg.bridge, "type", "bridge"])
    address = f"{cfg.controller_ip}/{net.prefixlen}"
    if address not in _addrs(cfg.bridge):
        _run(["ip", "addr", "add", address, "dev", cfg.bridge])
    _run(["ip", "link", "set", cfg.bridge, "up"])


def node_net_up(cfg: ClusterConfig, name: str, rate_mbit: Optional[float]) -> None:
    """Node ``name``'s namespace: loopback, and ``eth0`` with its address, the peer of a bridge port."""
    ns, host_if = cfg.netns(name), cfg.host_if(name)
    _run(["ip", "netns", "add", ns])
    _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns])
    _run(["ip", "link", "set", host_if, "master", cfg.bridge])
    _run(["ip", "link", "set", host_if, "up"])
    _run(["ip", "-n", ns, "addr", "add", f"{cfg.node_ip(name)}/{cfg.network.prefixlen}", "dev", "eth0"])
    _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # Ray's own processes talk over loopback
    if rate_mbit is not None:
        set_rate(cfg, name, rate_mbit)


def node_net_down(cfg: ClusterConfig, name: str, netns: Optional[str] = None) -> None:
    """Every process left in the node's namespace ends (TERM, then KILL), then the namespace and
    so its veth pair go. Idempotent."""
    ns = netns or cfg.netns(name)
    link.signal_until_gone(lambda: netns_pids(ns), grace_s=2.0)
    if ns in netns_list():
        _run(["ip", "netns", "delete", ns])
    # the kernel destroys an unnamed namespace (and so the pair) asynchronously, once nothing refers
    # to it: closing TCP connections of killed processes can delay that for seconds. Deleting our
    # end of the pair deletes both ends at once.
    host_if = cfg.host_if(name)
    if link_exists(host_if):
        _run(["ip", "link", "delete", "dev", host_if], check=False)
    if link_exists(host_if):
        raise CommandError(f"{host_if} is still there after deleting netns {ns}")


# --- state --------------------------------------------------------------------------------------


def read_state(state_dir: str = STATE_DIR) -> dict:
    try:
        return json.loads((Path(state_dir) / "cluster.json").read_text())
    except (OSError, ValueError):
        return {}


def config_of(state: dict, default: Optional[ClusterConfig] = None) -> ClusterConfig:
    """The config a recorded cluster was started with (``default`` when there is none)."""
    recorded = state.get("config")
    if not recorded:
        return default or ClusterConfig()
    known = {f.name for f in fields(ClusterConfig)}
    return ClusterConfig(**{k: v for k, v in recorded.items() if k in known})


def _write_state(cfg: ClusterConfig, state: dict) -> None:
    tmp = cfg.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(cfg.state_file)


# --- daemons ------------------------------------------------------------------------------------


def slurm_env(cfg: ClusterConfig) -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=str(cfg.conf_path))


def ensure_slurm_installed(which=shutil.which, log=sys.stderr) -> None:
    """apt-get install the Slurm packages if any of their binaries is missing; CommandError with
    one line naming what to install when that cannot be done."""
    missing = missing_slurm(which)
    if not missing:
        return
    want = " ".join(SLURM_PACKAGES)
    if which("apt-get") is None:
        raise CommandError(
            f"Slurm is not installed ({', '.join(missing)} missing) and apt-get is unavailable: install {want}"
        )
    print(f"{PROG}: installing {want} ({', '.join(missing)} missing)", file=log)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", *SLURM_PACKAGES]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:  # stale package lists: update once and retry
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=600)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    still = missing_slurm(which)
    if proc.returncode != 0 or still:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise CommandError(f"`apt-get install {want}` failed ({tail[0]}); install {want} and retry")


def _spawn(cfg: ClusterConfig, cmd: list[str], log_name: str) -> dict:
    """Start a daemon in a session of its own, output to ``log/<log_name>``; its pid record."""
    with open(Path(cfg.state_dir) / "log" / log_name, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=slurm_env(cfg),
            start_new_session=True,
        )
    return proc_record(proc.pid)


def _log_tail(path: str, lines: int = 5) -> str:
    """The last lines of a log, for an error message (a failed ``up`` removes the state dir)."""
    try:
        tail = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  {path}: {line}" for line in tail)


def _wait(what: str, ready, timeout_s: float, record: Optional[dict] = None, log: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if record is not None and not alive(record):
            raise CommandError(f"{what} exited while starting{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise CommandError(f"{what} not ready after {timeout_s:g} s{_log_tail(log)}")
        time.sleep(0.2)


def _make_dirs(cfg: ClusterConfig, controller_host: str) -> None:
    d = Path(cfg.state_dir)
    for sub in ("ctld", "run", "log", *(f"spool/{n}" for n in cfg.node_names)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    # munged insists: the socket's dir searchable by all, the key's dir and the key its own only
    try:
        munge = pwd.getpwnam("munge")
    except KeyError:
        raise CommandError("no user `munge` (the munge package creates it): install munge") from None
    key_dir = d / "munge" / "key"
    key_dir.mkdir(parents=True, exist_ok=True)
    key = key_dir / "munge.key"
    key.write_bytes(os.urandom(128))
    for path, mode in ((d / "munge", 0o755), (key_dir, 0o700), (key, 0o400)):
        os.chown(path, munge.pw_uid, munge.pw_gid)
        os.chmod(path, mode)
    cfg.conf_path.write_text(render_slurm_conf(cfg, controller_host))
    cfg.hosts_file.write_text(render_hosts(cfg, controller_host))


def start_munged(cfg: ClusterConfig) -> dict:
    m = Path(cfg.state_dir) / "munge"
    cmd = [
        "setpriv",
        "--reuid=munge",
        "--regid=munge",
        "--init-groups",
        "munged",
        "--foreground",
        f"--socket={cfg.munge_socket}",
        f"--key-file={m}/key/munge.key",
        f"--pid-file={m}/munged.pid",
        f"--seed-file={m}/munged.seed",
        f"--log-file={m}/munged.log",
    ]
    record = _spawn(cfg, cmd, "munged.log")
    _wait("munged", cfg.munge_socket.exists, 15, record, f"{cfg.state_dir}/log/munged.log")
    return record


def _ctld_answers(cfg: ClusterConfig) -> bool:
    proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=slurm_env(cfg), timeout=30)
    return proc.returncode == 0 and "is UP" in proc.stdout


def start_slurmctld(cfg: ClusterConfig) -> dict:
    record = _spawn(cfg, slurmctld_command(cfg, shutil.which("slurmctld") or "slurmctld"), "slurmctld.out")
    _wait("slurmctld", lambda: _ctld_answers(cfg), 30, record, f"{cfg.state_dir}/log/slurmctld.log")
    return record


def start_slurmd(cfg: ClusterConfig, name: str) -> dict:
    return _spawn(cfg, slurmd_command(cfg, name, shutil.which("slurmd") or "slurmd"), f"slurmd-{name}.out")


def sinfo_states(cfg: ClusterConfig) -> dict[str, str]:
    """Node -> Slurm state (``idle``, ``alloc``, ``down*``...); {} when the controller is silent."""
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=slurm_env(cfg), timeout=30
        )
    except subprocess.TimeoutExpired:
        return {}
    return parse_sinfo(proc.stdout) if proc.returncode == 0 else {}


def wait_idle(cfg: ClusterConfig, names: Sequence[str], timeout_s: float, records: dict) -> None:
    def ready() -> bool:
        for name in names:
            if not alive(records.get(name)):
                raise CommandError(f"slurmd of {name} exited{_log_tail(f'{cfg.state_dir}/log/slurmd-{name}.log')}")
        states = sinfo_states(cfg)
        return all(states.get(name) == "idle" for name in names)

    _wait(f"nodes {','.join(names)} idle in sinfo", ready, timeout_s, log=f"{cfg.state_dir}/log/slurmctld.log")


# --- commands -----------------------------------------------------------------------------------


def healthy(cfg: ClusterConfig, state: dict) -> bool:
    """Every recorded daemon alive and every node's namespace present."""
    pids = state.get("pids", {})
    have = set(netns_list())
    return (
        alive(pids.get("munged"))
        and alive(pids.get("slurmctld"))
        and all(alive(pids.get("slurmd", {}).get(n)) and cfg.netns(n) in have for n in cfg.node_names)
    )


def up(cfg: ClusterConfig, rate_mbit: Optional[float], timeout_s: float = 60.0) -> Path:
    """Bridge, nodes, munged, slurmctld, one slurmd per node; waits until every node is idle and
    returns slurm.conf's path. A healthy cluster of the same shape is kept (only its rate is set
    again); anything else left over is torn down first. On failure everything is torn down."""
    cfg.validate()
    state = read_state(cfg.state_dir)
    if state and config_of(state) == cfg and healthy(cfg, state):
        for name in cfg.node_names:
            set_rate(cfg, name, rate_mbit)
            _run(["ip", "link", "set", cfg.host_if(name), "up"])  # heal a cut link
        state["rate_mbit"] = rate_mbit
        _write_state(cfg, state)
        wait_idle(cfg, cfg.node_names, timeout_s, state["pids"]["slurmd"])
        return cfg.conf_path
    down(config_of(state, cfg))
    host = controller_hostname()
    try:
        _make_dirs(cfg, host)
        state = {
            "config": asdict(cfg),
            "controller": {"host": host, "ip": cfg.controller_ip},
            "conf": str(cfg.conf_path),
            "rate_mbit": rate_mbit,
            "nodes": node_addresses(cfg),
            "pids": {"slurmd": {}},
        }
        _write_state(cfg, state)
        bridge_up(cfg)
        for name in cfg.node_names:
            node_net_up(cfg, name, rate_mbit)
        state["pids"]["munged"] = start_munged(cfg)
        _write_state(cfg, state)
        state["pids"]["slurmctld"] = start_slurmctld(cfg)
        _write_state(cfg, state)
        for name in cfg.node_names:
            state["pids"]["slurmd"][name] = start_slurmd(cfg, name)
            _write_state(cfg, state)
        wait_idle(cfg, cfg.node_names, timeout_s, state["pids"]["slurmd"])
        return cfg.conf_path
    except BaseException:
        down(cfg)
        raise


def down(cfg: Optional[ClusterConfig] = None) -> None:
    """Remove the cluster: slurmds (by recorded id) and whatever their jobs left in the node
    namespaces, the namespaces and veths, slurmctld and munged (by recorded id), the bridge, the
    state dir. Idempotent; with no state file it still removes this cluster's namespaces (by their
    name prefix) and the bridge, and daemons whose pid files are in the state dir."""
    state = read_state((cfg or ClusterConfig()).state_dir)
    cfg = config_of(state, cfg)
    pids = state.get("pids", {})
    for name, record in pids.get("slurmd", {}).items():
        stop_process(record, grace_s=5.0)
    ours = [ns for ns in netns_list() if ns.startswith(cfg.netns_prefix)]
    # what jobs left in the nodes (steps, srun, Ray...): TERM, a short grace, KILL; all nodes at once
    link.signal_until_gone(lambda: [pid for ns in ours for pid in netns_pids(ns)], grace_s=2.0)
    for ns in ours:
        node_net_down(cfg, ns[len(cfg.netns_prefix) :], ns)
    stop_process(pids.get("slurmctld") or _pidfile_record(cfg, "run/slurmctld.pid"))
    stop_process(pids.get("munged") or _pidfile_record(cfg, "munge/munged.pid"))
    if link_exists(cfg.bridge):
        _run(["ip", "link", "delete", "dev", cfg.bridge])
    shutil.rmtree(cfg.state_dir, ignore_errors=True)


def _pidfile_record(cfg: ClusterConfig, rel: str) -> Optional[dict]:
    """A daemon of this cluster known only by its pid file (the state file was lost): trusted only
    if its command line names the state dir."""
    try:
        pid = int((Path(cfg.state_dir) / rel).read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return None
    return proc_record(pid) if cfg.state_dir in cmdline else None


def _recorded(cfg: ClusterConfig, node: str) -> dict:
    state = read_state(cfg.state_dir)
    if not state:
        raise CommandError(f"no cluster is up (no {cfg.state_file}); run `{PROG} up --nodes N` first")
    if node not in state.get("nodes", {}):
        raise ValueError(f"--node {node}: not a node of the cluster ({', '.join(state.get('nodes', {}))})")
    return state


def cut(cfg: ClusterConfig, node: str) -> None:
    """Fault: take the bridge side of the node's pair down; nothing crosses in either direction."""
    _recorded(cfg, node)
    _run(["ip", "link", "set", "dev", cfg.host_if(node), "down"])


def heal(cfg: ClusterConfig, node: str) -> None:
    _recorded(cfg, node)
    _run(["ip", "link", "set", "dev", cfg.host_if(node), "up"])


def node_gone(cfg: ClusterConfig, node: str) -> None:
    """Fault: the node is powered off -- its slurmd and every process in its namespace killed
    (SIGKILL, no goodbye), its namespace and veth deleted. slurmctld notices within
    ``slurmd_timeout_s`` (or at once, when it tries to use the node) and marks it DOWN."""
    state = _recorded(cfg, node)
    record = state["pids"].get("slurmd", {}).get(node)
    if alive(record):
        os.kill(int(record["pid"]), signal.SIGKILL)
    ns = cfg.netns(node)
    link.signal_until_gone(lambda: netns_pids(ns), grace_s=5.0, first=signal.SIGKILL)
    node_net_down(cfg, node)


def node_back(cfg: ClusterConfig, node: str, timeout_s: float = 90.0) -> None:
    """Rebuild a node taken by :func:`node_gone` (same address and rate) and start its slurmd; it
    registers and returns to service (``ReturnToService=2``). Waits until it is idle."""
    state = _recorded(cfg, node)
    if alive(state["pids"].get("slurmd", {}).get(node)) and cfg.netns(node) in netns_list():
        return
    node_net_down(cfg, node)
    node_net_up(cfg, node, state.get("rate_mbit"))
    state["pids"]["slurmd"][node] = start_slurmd(cfg, node)
    _write_state(cfg, state)
    # a node slurmctld already marked DOWN returns on registration; one it never saw go is idle
    wait_idle(cfg, [node], timeout_s, state["pids"]["slurmd"])


def status(cfg: ClusterConfig) -> dict:
    """Nodes (address, namespace, link up/cut, tbf rate, slurmd alive, Slurm state), daemons alive."""
    state = read_state(cfg.state_dir)
    cfg = config_of(state, cfg)
    pids = state.get("pids", {})
    have = set(netns_list())
    ctld = alive(pids.get("slurmctld"))
    states = sinfo_states(cfg) if ctld else {}
    nodes = {}
    for name, ip in state.get("nodes", {}).items():
        present, host_if = cfg.netns(name) in have, cfg.host_if(name)
        rate = _tbf_bytes_s(host_if) if present else None
        nodes[name] = {
            "address": ip,
            "netns": cfg.netns(name),
            "netns_present": present,
            "link": ("up" if "UP" in _link_flags(host_if) else "cut") if present and link_exists(host_if) else "absent",
            "rate_mbit": rate * 8 / 1e6 if rate else None,
            "slurmd_alive": alive(pids.get("slurmd", {}).get(name)),
            "slurm_state": states.get(name),
        }
    return {
        "up": bool(state) and healthy(cfg, state),
        "state_dir": cfg.state_dir,
        "conf": state.get("conf"),
        "controller": state.get("controller"),
        "bridge_present": link_exists(cfg.bridge),
        "munged_alive": alive(pids.get("munged")),
        "slurmctld_alive": ctld,
        "nodes": nodes,
    }


def _print_status(s: dict, conf_line: bool = True) -> None:
    ctl = s["controller"] or {}
    print(
        f"cluster {'UP' if s['up'] else 'DOWN'}: controller {ctl.get('host', '-')} {ctl.get('ip', '-')} "
        f"(bridge {'present' if s['bridge_present'] else 'absent'}), "
        f"munged {'alive' if s['munged_alive'] else 'dead'}, "
        f"slurmctld {'alive' if s['slurmctld_alive'] else 'dead'}"
    )
    for name, n in s["nodes"].items():
        rate = f"{n['rate_mbit']:g} Mbit/s" if n["rate_mbit"] else "no limit"
        print(
            f"  {name} {n['address']}: netns {'present' if n['netns_present'] else 'absent'}, "
            f"link {n['link']} ({rate}), "
            f"slurmd {'alive' if n['slurmd_alive'] else 'dead'}, slurm {n['slurm_state'] or '-'}"
        )
    if s["conf"] and conf_line:
        print(f"SLURM_CONF={s['conf']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="build the cluster; the last line printed is SLURM_CONF=<path>")
    p.add_argument("--nodes", type=int, required=True, help=f"number of nodes n1..nN (1-{MAX_NODES})")
    p.add_argument("--rate-mbit", help="bandwidth of each node's link per direction: Mbit/s, or e.g. 1gbit")
    p.add_argument("--cpus-per-node", type=int, default=ClusterConfig.cpus_per_node, help="CPUs each node reports")
    p.add_argument("--real-memory-mb", type=int, default=ClusterConfig.real_memory_mb, help="memory each node reports")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every node to be idle")
    p = sub.add_parser("status")
    p.add_argument("--json", action="store_true")
    sub.add_parser("down", help="remove everything; idempotent")
    for name, text in (
        ("cut", "fault: the node's link down (both directions) until `heal`"),
        ("heal", "undo `cut`"),
        ("node-gone", "fault: kill every process of the node, delete its namespace and veth"),
        ("node-back", "rebuild a node after `node-gone` and start its slurmd"),
    ):
        sub.add_parser(name, help=text).add_argument("--node", required=True, help="node name, e.g. n2")
    return parser


def main(argv: Optional[Sequence[str]] = None, capeff: Optional[int] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            cfg = ClusterConfig(nodes=args.nodes, cpus_per_node=args.cpus_per_node, real_memory_mb=args.real_memory_mb)
            cfg.validate()
            rate = link.parse_rate_mbit(args.rate_mbit) if args.rate_mbit is not None else None
            if not 0 < args.timeout <= 3600:
                raise ValueError(f"--timeout {args.timeout:g}: must be within (0, 3600] seconds")
        else:
            cfg = config_of(read_state())
        if getattr(args, "node", None) is not None and not (args.node[:1] == "n" and args.node[1:].isdigit()):
            raise ValueError(f"--node {args.node!r}: expected a node name n1, n2, ...")
    except ValueError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_USAGE
    problems = missing_requirements(link.effective_caps() if capeff is None else capeff)
    if problems:
        print(refusal_message(problems), file=sys.stderr)
        return EXIT_REFUSED
    try:
        if args.command == "up":
            try:
                ensure_slurm_installed()
            except CommandError as err:
                print(f"{PROG}: {err}", file=sys.stderr)
                return EXIT_REFUSED
            t0 = time.monotonic()
            conf = up(cfg, rate, timeout_s=args.timeout)
            _print_status(status(cfg), conf_line=False)
            print(f"{PROG}: up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            print(f"SLURM_CONF={conf}")
            return 0
        if args.command == "down":
            down(cfg)
        elif args.command == "cut":
            cut(cfg, args.node)
        elif args.command == "heal":
            heal(cfg, args.node)
        elif args.command == "node-gone":
            node_gone(cfg, args.node)
        elif args.command == "node-back":
            node_back(cfg, args.node)
        s = status(cfg)
    except ValueError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (CommandError, subprocess.TimeoutExpired, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_FAILED
    if args.command == "status" and args.json:
        print(json.dumps(s, indent=1))
    else:
        _print_status(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
