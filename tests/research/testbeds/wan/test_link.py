"""research/testbeds/wan: the parts that need no privileges (argument checks, tbf parameters, refusal,
route-clash detection, the delta encoding). These run in the default suite on any machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.research.testbeds.wan.wan_scripts import load


link = load("link")


@pytest.mark.parametrize(
    "text, mbit",
    [("100", 100.0), ("10mbit", 10.0), ("1gbit", 1000.0), ("500kbit", 0.5), (" 2.5 ", 2.5), (1000, 1000.0)],
)
def test_parse_rate_accepts_numbers_and_units(text, mbit):
    assert link.parse_rate_mbit(text) == pytest.approx(mbit)


@pytest.mark.parametrize("text", ["fast", "", "0", "-5", "1e9", "50kbit", "nan"])
def test_parse_rate_rejects_naming_the_value(text):
    with pytest.raises(ValueError, match="rate"):
        link.parse_rate_mbit(text)


def test_tbf_args_rate_and_burst_scale_with_the_rate():
    slow, fast = link.tbf_args(10), link.tbf_args(1000)
    assert slow[:3] == ["tbf", "rate", "10000kbit"] and fast[:3] == ["tbf", "rate", "1000000kbit"]
    burst = lambda args: int(args[args.index("burst") + 1])  # noqa: E731
    assert burst(slow) == 32 * 1024  # floor: a bucket smaller than a burst of segments starves the link
    assert burst(fast) == int(1000e6 / 8 * 0.004)  # 4 ms of traffic at 1 Gbit/s
    assert "latency" in slow


def test_missing_requirements_names_each_missing_piece():
    every_cap = (1 << link.CAP_NET_ADMIN) | (1 << link.CAP_SYS_ADMIN)
    assert link.missing_requirements(every_cap, which=lambda tool: f"/usr/sbin/{tool}") == []
    problems = link.missing_requirements(0, which=lambda tool: None)
    text = "\n".join(problems)
    for needed in ("CAP_NET_ADMIN", "CAP_SYS_ADMIN", "`ip`", "`tc`"):
        assert needed in text
    only_tc = link.missing_requirements(every_cap, which=lambda tool: None if tool == "tc" else "/x")
    assert len(only_tc) == 1 and "`tc`" in only_tc[0]


def test_effective_caps_reads_capeff(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t0000000000001000\n")
    assert link.effective_caps(str(status)) == 1 << link.CAP_NET_ADMIN
    assert link.effective_caps(str(tmp_path / "missing")) == 0


UNPRIVILEGED_COMMANDS = [
    ["link.py", "up", "--rate-mbit", "10"],
    ["link.py", "set-rate", "--rate-mbit", "10"],
    ["link.py", "status"],
    ["link.py", "cut"],
    ["link.py", "heal"],
    ["link.py", "ns-gone", "--seconds", "1"],
    ["link.py", "down"],
    ["cluster.py", "up", "--rate-mbit", "10"],
    ["cluster.py", "worker-gone", "--seconds", "1"],
    ["cluster.py", "down"],
    ["sync_bench.py", "--rates", "10", "--trials", "1"],
]


@pytest.mark.parametrize("argv", UNPRIVILEGED_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_without_privileges_every_command_refuses_and_changes_nothing(argv):
    """A real unprivileged run: drop every capability with setpriv (as root), or run as is (as a user)."""
    cmd = [
        sys.executable,
        "-m",
        f"research.testbeds.wan.{argv[0].removesuffix('.py')}",
        *argv[1:],
    ]  # from the repository root
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if not setpriv:
            pytest.skip("running as root without setpriv: cannot drop the capabilities")
        cmd = [setpriv, "--inh-caps=-all", "--bounding-set=-all", *cmd]
    has_ip = shutil.which("ip") is not None
    netns_before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if has_ip else ""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == link.EXIT_REFUSED, proc.stderr
    assert "CAP_NET_ADMIN" in proc.stderr and "nothing was changed" in proc.stderr
    if has_ip:
        assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == netns_before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["up"], "--rate-mbit"),
        (["up", "--rate-mbit", "fast"], "rate 'fast'"),
        (["--subnet", "10.213.0.0/24", "status"], "expected an IPv4 /30"),
        (["--subnet", "8.8.8.0/30", "status"], "private"),
        (["--netns", "a/b", "status"], "netns='a/b'"),
        (["ns-gone", "--seconds", "4000"], "--seconds 4000: must be within [0, 600]"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_with_usage_error_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = link.main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == link.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_config_validation_rejects_bad_addresses():
    with pytest.raises(ValueError, match="ns_ip"):
        link.LinkConfig(host_ip="10.213.0.1", ns_ip="10.213.0.9").validate()
    with pytest.raises(ValueError, match="private"):
        link.LinkConfig(host_ip="127.0.0.1", ns_ip="127.0.0.2").validate()
    with pytest.raises(ValueError, match="host_if"):
        link.LinkConfig(host_if="a-very-long-interface-name").validate()
    link.LinkConfig().validate()


def test_conflicting_routes_finds_overlaps_but_not_the_links_own():
    cfg = link.LinkConfig()
    routes = [
        {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
        {"dst": "192.0.2.0/24", "dev": "eth0"},
        {"dst": "10.213.0.0/30", "dev": cfg.host_if},  # ours, from a previous `up`
    ]
    assert link.conflicting_routes(routes, cfg) == []
    routes.append({"dst": "10.0.0.0/8", "dev": "tun0"})
    routes.append({"dst": "10.213.0.2", "dev": "wg0"})
    assert link.conflicting_routes(routes, cfg) == ["10.0.0.0/8 dev tun0", "10.213.0.2 dev wg0"]


def test_cluster_commands_bind_to_the_link_addresses_only():
    cluster = load("cluster")
    cfg, link_cfg = cluster.ClusterConfig(), link.LinkConfig()
    head, worker = cluster.head_command(cfg, link_cfg), cluster.worker_command(cfg, link_cfg)
    assert f"--node-ip-address={link_cfg.host_ip}" in head and '--resources={"learner_node": 1}' in head
    assert f"--temp-dir={cfg.temp_dir}" in head  # never the machine's /tmp/ray (ray_current_cluster)
    assert worker[:4] == ["ip", "netns", "exec", link_cfg.netns]
    assert f"--address={link_cfg.host_ip}:{cfg.port}" in worker and f"--node-ip-address={link_cfg.ns_ip}" in worker
    assert '--resources={"sampler_node": 1}' in worker
    env = cluster.ray_env()
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(cluster.TOKEN_FILE)


def test_xor_delta_reconstructs_bf16_bit_exactly_and_compresses_unchanged_weights():
    sync = load("sync_bench")
    torch.manual_seed(0)
    v0 = {"w": torch.randn(64, 64), "b": torch.randn(64), "step": torch.tensor(3)}
    v1 = {k: (v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v) for k, v in v0.items()}
    v1["w"][:32] = v0["w"][:32]  # half the matrix unchanged
    base, new = sync.bf16_bits(v0), sync.bf16_bits(v1)
    assert base.dtype == np.uint16 and base.shape == (64 * 64 + 64,)  # the int tensor is not a weight
    blob = sync.encode_xor(new, base)
    assert np.array_equal(sync.decode_xor(blob, base), new)
    assert sync.sha256(sync.decode_xor(blob, base)) == sync.sha256(new)
    assert len(blob) < new.nbytes * 0.75  # the unchanged half compresses away
    with pytest.raises(ValueError, match="full version"):
        sync.encode_xor(new[:10], base)


def test_extrapolation_is_bytes_times_params_over_rate():
    sync = load("sync_bench")
    times = sync.extrapolate(2.0)  # bf16: 2 bytes per parameter
    assert times["8B"]["1Gbit"] == pytest.approx(8e9 * 2 * 8 / 1e9)
    assert times["1.7B"]["10Gbit"] == pytest.approx(1.7e9 * 2 * 8 / 10e9)


def test_worker_gone_is_bounded():
    cluster = load("cluster")
    with pytest.raises(ValueError, match="seconds=1000"):
        cluster.worker_gone(cluster.ClusterConfig(), link.LinkConfig(), 1000)


def test_signal_until_gone_kills_what_ignores_sigterm_after_the_grace():
    """The one stop loop of both cluster scripts: a process that exits on SIGTERM is gone at once;
    one that ignores it is SIGKILLed once the grace ends (real child processes, bounded waits)."""
    import signal
    import time

    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stubborn.stdout.readline().strip() == "ready"  # its handler is set before we signal it

        def alive(*procs):
            return [p.pid for p in procs if p.poll() is None]

        t0 = time.monotonic()
        link.signal_until_gone(lambda: alive(polite), grace_s=10.0)
        assert polite.returncode == -signal.SIGTERM and time.monotonic() - t0 < 5.0
        t0 = time.monotonic()
        link.signal_until_gone(lambda: alive(stubborn), grace_s=0.5)
        assert stubborn.returncode == -signal.SIGKILL and 0.5 <= time.monotonic() - t0 < 6.0
    finally:
        for p in (polite, stubborn):
            if p.poll() is None:
                p.kill()
                p.wait()
