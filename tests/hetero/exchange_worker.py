"""A learner or a sampler process exchanging weights and rollouts through an fsspec transport.

Run by test_hetero_kill.py as ``python exchange_worker.py ROLE URL WORKDIR ...``; either
process may be SIGKILLed at any moment and restarted with the same arguments. A ``slowlink://``
URL is the local disk written through a throttled link (see SlowLinkFileSystem).

- learner: resumes from WORKDIR/learner.ckpt if present; loop: read rollouts into the buffer,
  consume what is there, bump the version, publish weights (every value == version), checkpoint
  (buffer state + version, temp + rename), acknowledge. Stops when the checkpointed ledger has
  consumed every expected group; writes WORKDIR/learner.json.
- sampler: resumes after the last uid in WORKDIR/<id>.progress; loop: load the latest weights and
  check every value equals its version (a corrupt load exits with code 3), send one group made
  with that version, append its uid to the progress file. Writes WORKDIR/<id>.json.
"""

import json
import os
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.exchange import RolloutInbox, send_group
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.transport import FsspecTransport
from verl_ext.hetero.weights import WeightStore

WEIGHT_NUMEL = 1_000_000  # 4 MB of float32 per version
RESPONSE_LEN = 50_000  # ~2.6 MB per rollout group (G=4)
CORRUPT_LOAD_EXIT = 3


class SlowLinkFileSystem(LocalFileSystem):
    """The local disk behind a slow link (WAN, busy NFS): files are written in 64 KiB chunks
    with a pause after each, so a write lasts long enough for the test to interrupt it."""

    protocol = ("slowlink",)
    chunk_bytes, pause_s = 64 * 1024, 0.004

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        with self.open(path, "wb", **kwargs) as handle:
            for start in range(0, len(value), self.chunk_bytes):
                handle.write(value[start : start + self.chunk_bytes])
                handle.flush()
                time.sleep(self.pause_s)


fsspec.register_implementation("slowlink", SlowLinkFileSystem, clobber=True)


def atomic_save(obj, path: Path) -> None:
    temp = path.with_suffix(".tmp")
    torch.save(obj, temp)
    os.replace(temp, path)


def learner(url: str, workdir: Path, expected: int) -> None:
    transport = FsspecTransport(url)
    store = WeightStore(transport, keep_last=2)
    buffer = RolloutBuffer(max_delay=10_000)
    checkpoint = workdir / "learner.ckpt"
    version = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        buffer.load_state_dict(state["buffer"])
        version = state["version"]
    inbox = RolloutInbox(transport, buffer)
    if store.latest_version() is None:
        store.publish(version, {"w": torch.full((WEIGHT_NUMEL,), float(version))})
    deadline = time.monotonic() + 90
    while buffer.ledger.counts()["consumed"] < expected:
        if time.monotonic() > deadline:
            raise SystemExit("learner: timed out")
        inbox.poll()
        if len(buffer) == 0:
            time.sleep(0.02)
            continue
        buffer.take(len(buffer), version)
        version += 1
        buffer.set_learner_version(version)  # before publishing, so groups of `version` are not "future"
        store.publish(version, {"w": torch.full((WEIGHT_NUMEL,), float(version))})
        state = buffer.state_dict()
        atomic_save({"buffer": state, "version": version}, checkpoint)
        inbox.acknowledge(state)
    (workdir / "learner.json").write_text(
        json.dumps(
            {
                "version": version,
                "counts": buffer.ledger.counts(),
                "corrupt": inbox.stats["corrupt"],
                "consumed": sorted(buffer.ledger.uids("consumed")),
            }
        )
    )


def sampler(url: str, workdir: Path, sampler_id: str, n_groups: int) -> None:
    transport = FsspecTransport(url)
    store = WeightStore(transport)
    progress = workdir / f"{sampler_id}.progress"
    done = progress.read_text().split() if progress.exists() else []
    loaded = []
    rng = np.random.default_rng(len(done))
    for index in range(len(done), n_groups):
        latest = None
        while latest is None:
            latest = store.latest()
        version, state = latest
        if not torch.all(state["w"] == float(version)):
            sys.exit(CORRUPT_LOAD_EXIT)
        loaded.append(version)
        uid = f"{sampler_id}-g{index:03d}"
        mask = np.ones((4, RESPONSE_LEN), dtype=np.int8)
        group = RolloutGroup(
            group_uid=uid,
            prompt_ids=np.arange(8, dtype=np.int64),
            response_ids=rng.integers(0, 50_000, size=(4, RESPONSE_LEN)).astype(np.int64),
            response_mask=mask,
            sampler_logprobs=-rng.random((4, RESPONSE_LEN), dtype=np.float32),
            rewards=np.ones(4, np.float32),
            advantages=np.zeros(4, np.float32),
            policy_version=version,
            sampler_id=sampler_id,
        )
        send_group(transport, group)
        with progress.open("a") as handle:
            handle.write(uid + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    (workdir / f"{sampler_id}.json").write_text(json.dumps({"loaded": loaded, "corrupt": store.stats["corrupt"]}))


if __name__ == "__main__":
    role, url, workdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if role == "learner":
        learner(url, workdir, expected=int(sys.argv[4]))
    else:
        sampler(url, workdir, sampler_id=sys.argv[4], n_groups=int(sys.argv[5]))
