"""research/testbeds/slurm_cluster.py: a real SLURM cluster of network-namespace nodes on this box.

The fast tests need no privileges (slurm.conf and hosts rendering, addresses, argument checks,
the refusal without capabilities). The slow one needs root and the Slurm packages:

    nice -n 10 .venv/bin/pytest -q -m slow tests/research/testbeds/test_slurm_cluster.py

It brings up 3 rate-limited nodes, runs ``sbatch --nodes=2 --wait`` whose ``srun`` reports each
node's hostname and address and makes a TCP request from one node to the other, exercises the
faults (cut/heal, node-gone/node-back), then tears down and checks nothing is left.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.slurm.slurm_scripts import SCRIPT, cli as _cli, load_slurm_cluster, running_cluster

lc = load_slurm_cluster()
EVERY_CAP = (1 << lc.link.CAP_NET_ADMIN) | (1 << lc.link.CAP_SYS_ADMIN)


def _conf_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_node_addresses_follow_the_subnet():
    expected = {"n1": "10.214.0.11", "n2": "10.214.0.12", "n3": "10.214.0.13"}
    assert lc.node_addresses(lc.ClusterConfig(nodes=3)) == expected
    cfg = lc.ClusterConfig(nodes=2, subnet="10.77.5.0/24", first_node_host=100)
    assert cfg.controller_ip == "10.77.5.1"
    assert lc.node_addresses(cfg) == {"n1": "10.77.5.100", "n2": "10.77.5.101"}
    assert cfg.netns("n2") == "hrl-slurm-n2" and cfg.host_if("n2") == "hrls-n2"
    assert cfg.bridge != lc.link.LinkConfig().bridge  # never research/testbeds/wan's bridge
    assert not cfg.network.overlaps(lc.link.LinkConfig().subnet)


def test_slurm_conf_has_every_node_the_partition_and_no_gres():
    cfg = lc.ClusterConfig(nodes=3, cpus_per_node=4, real_memory_mb=3000, state_dir="/tmp/x-slurm")
    lines = _conf_lines(lc.render_slurm_conf(cfg, "box"))
    for k, ip in ((1, "10.214.0.11"), (2, "10.214.0.12"), (3, "10.214.0.13")):
        node = next(line for line in lines if line.startswith(f"NodeName=n{k} "))
        assert f"NodeAddr={ip}" in node and f"NodeHostname=n{k}" in node
        assert "CPUs=4" in node and "RealMemory=3000" in node
    part = [line for line in lines if line.startswith("PartitionName=")]
    assert len(part) == 1 and "Nodes=n1,n2,n3" in part[0] and "Default=YES" in part[0] and "MaxTime=" in part[0]
    text = "\n".join(lines)
    assert "gres" not in text.lower() and "gpu" not in text.lower()
    for setting in (
        "SlurmctldHost=box(10.214.0.1)",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "AuthInfo=socket=/tmp/x-slurm/munge/munge.socket",
    ):
        assert setting in lines, setting
    assert "cgroup" not in text
    # every path Slurm writes is under the state dir (never /etc/slurm, /var/spool, /var/log)
    for line in lines:
        key, _, value = line.partition("=")
        if key.endswith(("Location", "SpoolDir", "PidFile", "LogFile")):
            assert value.startswith("/tmp/x-slurm/"), line


def test_hosts_file_names_every_node_and_the_controller():
    hosts = lc.render_hosts(lc.ClusterConfig(nodes=2), "box")
    pairs = [tuple(line.split()[:2]) for line in hosts.splitlines()]
    assert ("10.214.0.1", "box") in pairs and ("10.214.0.11", "n1") in pairs and ("10.214.0.12", "n2") in pairs
    assert ("127.0.0.1", "localhost") in pairs


def test_slurmd_runs_in_the_nodes_namespaces_under_its_own_hostname():
    cfg = lc.ClusterConfig()
    cmd = lc.slurmd_command(cfg, "n2", "/usr/sbin/slurmd")
    assert cmd[:3] == ["nsenter", "--net=/run/netns/hrl-slurm-n2", "--"]  # not `ip netns exec` (/sys)
    assert "--uts" in cmd and "--mount" in cmd and "ip" not in cmd
    script = cmd[cmd.index("-c") + 1]
    assert 'hostname "$h"' in script and "mount --bind" in script and 'exec "$@"' in script
    assert cmd[-4:] == ["/usr/sbin/slurmd", "-D", "-f", str(cfg.conf_path)]
    assert "n2" in cmd and str(cfg.hosts_file) in cmd
    ctld = lc.slurmctld_command(cfg, "/usr/sbin/slurmctld")
    assert "nsenter" not in ctld and "--uts" not in ctld and ctld[-4:-2] == ["/usr/sbin/slurmctld", "-D"]


def test_the_wrapper_sets_hostname_and_execs_in_place(tmp_path):
    """The shell of ``with_cluster_hosts`` run for real, with ``hostname``/``mount`` stubbed."""
    cfg = lc.ClusterConfig(state_dir=str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("hostname", "mount"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {tmp_path}/calls\n')
        (bin_dir / tool).chmod(0o755)
    cmd = lc.with_cluster_hosts(cfg, ["sh", "-c", 'echo "exec $$"'], hostname="n7")
    assert cmd[0] == "unshare"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    proc = subprocess.Popen(cmd[cmd.index("--") + 1 :], stdout=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate(timeout=10)
    assert out.strip() == f"exec {proc.pid}"  # the program is the process that was started
    assert (tmp_path / "calls").read_text().splitlines() == ["hostname n7", f"mount --bind {cfg.hosts_file} /etc/hosts"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nodes": 0}, "--nodes 0: must be within [1, 64]"),
        ({"nodes": 65}, "--nodes 65"),
        ({"cpus_per_node": 0}, "--cpus-per-node 0"),
        ({"real_memory_mb": 10}, "--real-memory-mb 10"),
        ({"subnet": "8.8.8.0/24"}, "private IPv4"),
        ({"subnet": "10.214.0.0/29"}, "no room for 3 nodes"),
        ({"subnet": "10.214.0.1/24"}, "--subnet 10.214.0.1/24"),
        ({"netns_prefix": "a-much-too-long-prefix-"}, "netns name"),
        ({"state_dir": "relative"}, "state_dir"),
    ],
)
def test_config_validation_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        lc.ClusterConfig(**kwargs).validate()
    assert message in str(err.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["up", "--nodes", "0"], "--nodes 0: must be within"),
        (["up", "--nodes", "-2"], "--nodes -2"),
        (["up", "--nodes", "2", "--rate-mbit", "fast"], "rate 'fast'"),
        (["up", "--nodes", "2", "--cpus-per-node", "0"], "--cpus-per-node 0"),
        (["up", "--nodes", "2", "--timeout", "0"], "--timeout 0"),
        (["cut", "--node", "x2"], "--node 'x2'"),
    ],
)
def test_bad_arguments_exit_with_usage_error_naming_them(argv, message, capsys):
    assert lc.main(argv, capeff=EVERY_CAP) == lc.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_missing_requirements_adds_util_linux_to_the_wan_checks():
    assert lc.missing_requirements(EVERY_CAP, which=lambda tool: f"/usr/bin/{tool}") == []
    text = "\n".join(lc.missing_requirements(0, which=lambda tool: None))
    for needed in ("CAP_NET_ADMIN", "CAP_SYS_ADMIN", "`ip`", "`tc`", "`nsenter`", "`unshare`", "`setpriv`"):
        assert needed in text
    only = lc.missing_requirements(EVERY_CAP, which=lambda tool: None if tool == "nsenter" else "/x")
    assert len(only) == 1 and "nsenter" in only[0]


@pytest.mark.parametrize("argv", [["up", "--nodes", "2"], ["down"], ["status"], ["node-gone", "--node", "n1"]])
def test_without_capabilities_every_command_refuses_before_changing_anything(argv, capsys):
    before = Path(lc.STATE_DIR).exists()
    assert lc.main(argv, capeff=1 << lc.link.CAP_NET_ADMIN) == lc.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "- CAP_SYS_ADMIN" in err and "- CAP_NET_ADMIN" not in err and "nothing was changed" in err
    assert Path(lc.STATE_DIR).exists() == before


def test_a_real_unprivileged_up_refuses():
    """A real run without capabilities: setpriv drops them all (as root), or run as is (as a user)."""
    cmd = [sys.executable, str(SCRIPT), "up", "--nodes", "2"]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot drop the capabilities")
        cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", *cmd]
    has_ip = shutil.which("ip") is not None
    netns_before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if has_ip else ""
    state_before = Path(lc.STATE_DIR).exists()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == lc.EXIT_REFUSED, proc.stderr
    assert "CAP_NET_ADMIN" in proc.stderr and "nothing was changed" in proc.stderr and proc.stdout == ""
    assert Path(lc.STATE_DIR).exists() == state_before
    if has_ip:
        assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == netns_before


def test_without_slurm_and_apt_one_line_says_what_to_install():
    with pytest.raises(lc.CommandError) as err:
        lc.ensure_slurm_installed(which=lambda tool: None)
    text = str(err.value)
    assert "\n" not in text and "apt-get is unavailable" in text
    assert "install slurmctld slurmd slurm-client munge" in text
    lc.ensure_slurm_installed(which=lambda tool: f"/usr/bin/{tool}")  # all there: nothing to do


def test_parse_sinfo_and_process_records():
    assert lc.parse_sinfo("n1 idle\nn2 down*\nn1 idle\n\n") == {"n1": "idle", "n2": "down*"}
    me = lc.proc_record(os.getpid())
    assert lc.alive(me)
    assert not lc.alive({**me, "start": me["start"] + 1})  # same id, another process
    assert not lc.alive(None) and not lc.alive({"pid": 2**22 + 1, "start": 5})


def test_config_round_trips_through_the_state_file():
    cfg = lc.ClusterConfig(nodes=5, cpus_per_node=8)
    state = json.loads(json.dumps({"config": lc.asdict(cfg)}))
    assert lc.config_of(state) == cfg
    assert lc.config_of({}) == lc.ClusterConfig()


# --- the real cluster (root, slow) ----------------------------------------------------------------


SLURM_JOB = textwrap.dedent(
    """\
    #!/bin/bash
    # each node's hostname and address, then a TCP request from the second node to the first
    set -euo pipefail
    out="$1"
    srun --nodes=2 --ntasks=2 --ntasks-per-node=1 sh -c 'echo "$(hostname) $(hostname --ip-address)"' > "$out.hosts"
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    first_ip="$(srun -N1 -n1 -w "${nodes[0]}" hostname --ip-address)"
    srun -N1 -n1 -w "${nodes[0]}" timeout 30 python3 -c '
    import socket, sys
    s = socket.create_server((sys.argv[1], 18765)); c, peer = s.accept()
    c.sendall(("from " + peer[0] + " to " + socket.gethostname()).encode()); c.close()
    ' "$first_ip" &
    srun -N1 -n1 -w "${nodes[1]}" timeout 30 python3 -c '
    import socket, sys, time
    for _ in range(100):
        try:
            c = socket.create_connection((sys.argv[1], 18765), timeout=5); break
        except OSError:
            time.sleep(0.1)
    print(c.recv(200).decode())
    ' "$first_ip" > "$out.tcp"
    wait
    """
)


@pytest.fixture
def cluster():
    with running_cluster(3, rate_mbit=50) as (cfg, env, state):
        yield cfg, env
    # and no daemon of the cluster is left
    records = [state.get("pids", {}).get(d) for d in ("munged", "slurmctld")]
    records += list(state.get("pids", {}).get("slurmd", {}).values())
    assert records and not [r for r in records if lc.alive(r)]


def _sinfo(env) -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    return lc.parse_sinfo(out.stdout)


def _reaches(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_namespace_nodes_run_a_two_node_job(cluster, tmp_path):
    cfg, env = cluster
    assert _sinfo(env) == {"n1": "idle", "n2": "idle", "n3": "idle"}
    status = lc.status(cfg)
    assert status["up"] and status["slurmctld_alive"] and status["munged_alive"]
    assert {n: s["rate_mbit"] for n, s in status["nodes"].items()} == {"n1": 50.0, "n2": 50.0, "n3": 50.0}
    assert lc._tbf_bytes_s("eth0", cfg.netns("n1")) == 50e6 / 8  # both ends of the pair

    script = tmp_path / "job.sbatch"
    script.write_text(SLURM_JOB)
    out = tmp_path / "result"  # /tmp is shared by every node: the job writes here
    job = subprocess.run(
        ["sbatch", "--nodes=2", "--wait", "--time=5", f"--output={tmp_path}/job.log", str(script), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=tmp_path,
    )
    log = (tmp_path / "job.log").read_text() if (tmp_path / "job.log").exists() else ""
    assert job.returncode == 0, job.stdout + job.stderr + log
    hosts = dict(line.split() for line in Path(f"{out}.hosts").read_text().splitlines())
    assert len(hosts) == 2 and set(hosts) <= {"n1", "n2", "n3"}
    for name, ip in hosts.items():
        assert ip == lc.node_addresses(cfg)[name]
    first, second = sorted(hosts, key=lambda n: int(n[1:]))
    assert Path(f"{out}.tcp").read_text().split() == ["from", hosts[second], "to", first]

    # fault: n2's link cut and healed (its slurmd's port unreachable, then reachable again)
    n2 = lc.node_addresses(cfg)["n2"]
    assert _reaches(n2, cfg.slurmd_port)
    assert _cli("cut", "--node", "n2").returncode == 0
    assert lc.status(cfg)["nodes"]["n2"]["link"] == "cut" and not _reaches(n2, cfg.slurmd_port)
    assert _cli("heal", "--node", "n2").returncode == 0
    assert _reaches(n2, cfg.slurmd_port)

    # fault: n2 gone (slurmd killed, namespace and veth deleted), then back and idle again
    slurmd = lc.read_state(cfg.state_dir)["pids"]["slurmd"]["n2"]
    assert _cli("node-gone", "--node", "n2").returncode == 0
    gone = lc.status(cfg)["nodes"]["n2"]
    assert not gone["netns_present"] and gone["link"] == "absent" and not lc.alive(slurmd)
    assert not lc.link_exists(cfg.host_if("n2"))
    back = _cli("node-back", "--node", "n2", timeout=120)
    assert back.returncode == 0, back.stderr
    assert _sinfo(env)["n2"] == "idle" and lc.status(cfg)["nodes"]["n2"]["rate_mbit"] == 50.0
    run = subprocess.run(["srun", "-N1", "-w", "n2", "hostname"], capture_output=True, text=True, env=env, timeout=60)
    assert run.stdout.strip() == "n2", run.stderr

    # a job still running at `down` is ended with the nodes (the fixture checks nothing is left)
    subprocess.run(["sbatch", "-N3", "--output=/dev/null", "--wrap", "srun sleep 300"], env=env, timeout=30, check=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(lc.netns_pids(cfg.netns("n3"))) < 2:
        time.sleep(0.5)
    assert len(lc.netns_pids(cfg.netns("n3"))) >= 2  # slurmd and the job's step
