"""An exchange on a real network server: OpenSSH's sshd serving SFTP, for ``sftp://`` exchanges.

Why SFTP: it is a server every machine has (Debian's ``openssh-server``), fsspec speaks it through
paramiko with an atomic rename (``posix_rename``, which the exchange's commit protocol needs), and
it is not a mock of anything. The server runs with its own config, host key, client key and
authorised keys under ``state_dir``: key login only, on one address and port (loopback, or a
network namespace the test bed made), never the machine's own sshd or ``~/.ssh``.

Clients find the key through fsspec's own environment configuration (:meth:`SftpServer.client_env`):
``FSSPEC_SFTP='{"key_filename": ..., ...}'``, set before fsspec is imported.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

SSHD = "/usr/sbin/sshd"


def missing_requirements() -> list[str]:
    """What this machine lacks to run the server, each with how to get it."""
    problems = []
    if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        problems.append("OpenSSH's server (apt-get install openssh-server)")
    try:
        import paramiko  # noqa: F401
    except ImportError:
        problems.append("paramiko, fsspec's SFTP client (pip install paramiko)")
    if os.geteuid() != 0:
        problems.append("root (sshd checks its files and switches users)")
    return problems


def _descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (sshd forks one child per connection)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class SftpServer:
    """sshd serving SFTP on ``address:port`` (inside ``netns`` when given), files under ``root``.

    Args:
        state_dir: config, keys, log and pid file (made here; removed by :meth:`remove`).
        address, port: where the server listens.
        netns: network namespace to run it in (``ip netns exec``), or None for this one.
    """

    def __init__(self, state_dir: str | os.PathLike, address: str = "127.0.0.1", port: int = 2222,
                 netns: Optional[str] = None):  # fmt: skip
        self.state_dir, self.address, self.port, self.netns = Path(state_dir), address, port, netns
        self.proc: Optional[subprocess.Popen] = None

    @property
    def client_key(self) -> Path:
        return self.state_dir / "client_ed25519"

    def url(self, path: str) -> str:
        """The ``sftp://`` URL of absolute ``path`` on this server."""
        return f"sftp://root@{self.address}:{self.port}{path}"

    def client_options(self) -> dict:
        """paramiko's connect arguments for this server: its client key and nothing else."""
        return {"key_filename": str(self.client_key), "look_for_keys": False, "allow_agent": False, "timeout": 10}

    def client_env(self) -> dict[str, str]:
        """Environment for a client process (fsspec reads ``FSSPEC_SFTP`` when it is imported)."""
        return {"FSSPEC_SFTP": json.dumps(self.client_options())}

    def _prepare(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        for name in ("host_ed25519", "client_ed25519"):
            if not (self.state_dir / name).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.state_dir / name)],
                               check=True, capture_output=True)  # fmt: skip
        (self.state_dir / "authorized_keys").write_text((self.state_dir / "client_ed25519.pub").read_text())
        config = self.state_dir / "sshd_config"
        config.write_text(
            "\n".join([
                f"ListenAddress {self.address}", f"Port {self.port}",
                f"HostKey {self.state_dir / 'host_ed25519'}", f"PidFile {self.state_dir / 'sshd.pid'}",
                f"AuthorizedKeysFile {self.state_dir / 'authorized_keys'}",
                "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                "Subsystem sftp internal-sftp", "MaxStartups 100", "MaxSessions 100", "LogLevel ERROR", "",
            ])
        )  # fmt: skip
        return config

    def start(self, timeout_s: float = 20.0) -> None:
        """Start sshd and wait until it accepts connections."""
        config = self._prepare()
        cmd = [SSHD, "-D", "-e", "-f", str(config)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        log = open(self.state_dir / "sshd.log", "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited (rc={self.proc.returncode}): {self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"sshd did not answer on {self.address}:{self.port} within {timeout_s} s")

    def _answers(self) -> bool:
        cmd = ["ip", "netns", "exec", self.netns] if self.netns else []
        probe = f"import socket; socket.create_connection(({self.address!r}, {self.port}), 1).close()"
        if not self.netns:
            try:
                socket.create_connection((self.address, self.port), 1).close()
                return True
            except OSError:
                return False
        return subprocess.run([*cmd, "python3", "-c", probe], capture_output=True).returncode == 0

    def stop(self) -> None:
        """End the server and every connection it serves (what a server restart does to clients)."""
        if self.proc is None:
            return
        pids = _descendants(self.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down ``down_s`` seconds, start again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join((self.state_dir / "sshd.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.state_dir, ignore_errors=True)
