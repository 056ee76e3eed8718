#!/usr/bin/env python3
"""What one weight publication costs the learner, piece by piece (docs/benchmarks.md).

    OMP_NUM_THREADS=1 python -m research.bench.bench_publish [--model PATH] [--repeats 30]

The toy warm start's state dict (or ``--model``): safetensors serialisation (fp32 and bf16),
SHA-256 of the message, one ``RayTransport.put`` round trip (the mailbox actor on core 1, this
process on core 0, as with ``hetero.system_cpus``), and ``WeightStore.publish`` waiting for the
mailbox and pipelined (``put_nowait``), fp32 and bf16. Milliseconds per call, means over
``--repeats`` after one warm-up call. Starts and stops its own local Ray.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def mean_ms(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the cached toy warm start)")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from verl_ext.hetero.transport import RayTransport
    from verl_ext.hetero.weights import WeightStore, serialize_state_dict

    path = args.model or next(iter(sorted(glob.glob(str(REPO / ".cache/heterorl/toy_add3*")))), None)
    if path is None:
        p.error("no cached toy model under .cache/heterorl; pass --model")
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    torch.set_num_threads(1)
    data = serialize_state_dict(state, 1)
    rows = [
        ("serialise fp32", mean_ms(lambda: serialize_state_dict(state, 1), args.repeats)),
        ("serialise bf16", mean_ms(lambda: serialize_state_dict(state, 1, "bf16"), args.repeats)),
        (f"SHA-256 of {len(data)} bytes", mean_ms(lambda: hashlib.sha256(data).digest(), args.repeats)),
    ]
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[1:] or cores)  # Ray's processes (and the mailbox) off core 0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    os.sched_setaffinity(0, cores[:1])
    try:
        transport = RayTransport(name="bench-publish", namespace="bench-publish")
        rows.append(
            ("RayTransport.put (waits for the mailbox)", mean_ms(lambda: transport.put("w", "k", data), args.repeats))
        )
        version = [0]
        for wire in (None, "bf16"):
            for pipelined in (False, True):
                store = WeightStore(
                    transport, keep_last=4, wire_dtype=wire, topic=f"w-{wire}-{pipelined}", pipelined=pipelined
                )

                def publish(store=store):
                    version[0] += 1
                    store.publish(version[0], state)

                rows.append(
                    (
                        f"WeightStore.publish {wire or 'fp32'}{', pipelined' if pipelined else ''}",
                        mean_ms(publish, args.repeats),
                    )
                )
                store.flush()
        ray.kill(transport._mailbox)
    finally:
        ray.shutdown()
    print(f"model {path}; load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    for name, ms in rows:
        print(f"{name:45s} {ms:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
