#!/usr/bin/env python3
"""Measure the link with one bounded TCP bulk transfer: learner side -> sampler namespace.

    python -m research.testbeds.wan.probe --mbytes 8          # link must be up (research/testbeds/wan/link.py up)

A receiver runs inside the sampler namespace (``ip netns exec``) on the sampler-side address; the
sender in the root namespace connects to it and writes ``--mbytes`` MB. The receiver reports the
seconds from its first to its last byte. Bounded: one transfer, ``--timeout`` seconds at most,
both processes exit by themselves. Traffic only between the link's two addresses.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m research.testbeds.wan.probe ...")
from .link import LinkConfig  # noqa: E402

PORT = 6399

# runs inside the namespace: accept one connection, read until EOF, print {"bytes", "seconds"}
RECEIVER = r"""
import json, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port)); srv.listen(1); srv.settimeout(timeout)
print("ready", flush=True)
conn, _ = srv.accept(); conn.settimeout(timeout)
n, t0 = 0, None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(chunk)
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - (t0 or time.perf_counter())}), flush=True)
"""


def transfer(cfg: LinkConfig, nbytes: int, timeout: float = 60.0, port: int = PORT) -> dict:
    """Send ``nbytes`` over TCP from ``cfg.host_ip`` to a receiver on ``cfg.ns_ip``.

    Returns {"bytes", "seconds", "mbit_s"} as measured by the receiver.
    """
    recv = subprocess.Popen(
        ["ip", "netns", "exec", cfg.netns, sys.executable, "-c", RECEIVER, cfg.ns_ip, str(port), str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"receiver did not start: {recv.stderr.read()}")
        payload = memoryview(bytes(1 << 20))
        deadline = time.monotonic() + timeout
        with socket.create_connection((cfg.ns_ip, port), timeout=timeout, source_address=(cfg.host_ip, 0)) as sock:
            sent = 0
            while sent < nbytes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sent {sent} of {nbytes} bytes in {timeout}s")
                sent += sock.send(payload[: min(len(payload), nbytes - sent)])
        out, err = recv.communicate(timeout=timeout)
        if recv.returncode != 0:
            raise RuntimeError(f"receiver failed: {err}")
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    result["mbit_s"] = result["bytes"] * 8 / 1e6 / max(result["seconds"], 1e-9)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbytes", type=float, default=8.0, help="MB to send (1 MB = 1e6 bytes), at most 1000")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before giving up")
    args = parser.parse_args(argv)
    if not 0 < args.mbytes <= 1000:
        parser.error(f"--mbytes {args.mbytes}: must be in (0, 1000]")
    print(json.dumps(transfer(LinkConfig(), int(args.mbytes * 1e6), timeout=args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
