"""Two processes exchange weights and rollouts through a file:// transport; one is SIGKILLed
mid-write and restarted. Nothing is lost, nothing is consumed twice, nothing corrupt is loaded."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.transport import FsspecTransport
from verl_ext.hetero.weights import WeightStore

WORKER = Path(__file__).with_name("exchange_worker.py")
REPO = Path(__file__).resolve().parents[2]
N_GROUPS = 6


def _start(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _kill_when_writing(process, folder: Path, min_committed: int, deadline: float) -> bool:
    """SIGKILL ``process`` as soon as a temporary file shows up in ``folder`` after at least
    ``min_committed`` messages were committed there. True if killed mid-write."""
    while time.monotonic() < deadline and process.poll() is None:
        names = os.listdir(folder) if folder.exists() else []
        committed = sum(name.endswith(".ok") for name in names)
        # a payload temporary (".tmp.<key>.msg.<random>"), not a commit-marker temporary
        if committed >= min_committed and any(name.startswith(".tmp.") and ".msg." in name for name in names):
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            return True
        time.sleep(0.002)
    return False


def _check_nothing_visible_is_corrupt(transport):
    for key in transport.keys("rollouts"):
        try:
            RolloutGroup.from_bytes(transport.get("rollouts", key))  # raises on a bad checksum
        except KeyError:
            pass  # acknowledged and deleted by the learner meanwhile
    store = WeightStore(transport)
    for version in store.versions():
        try:
            assert torch.all(store.get(version)["w"] == float(version))
        except KeyError:
            pass  # pruned meanwhile
    assert transport.stats["corrupt"] == 0 and store.stats["corrupt"] == 0


@pytest.mark.parametrize("victim", ["sampler", pytest.param("learner", marks=pytest.mark.slow)])
def test_kill_mid_write_loses_nothing_and_loads_nothing_corrupt(tmp_path, victim):
    url = f"file://{tmp_path}/shared"
    worker_url = f"slowlink://{tmp_path}/shared"  # same folder, written through a throttled link
    workdir = tmp_path / "work"
    workdir.mkdir()
    learner_args = ("learner", worker_url, workdir, N_GROUPS)
    sampler_args = ("sampler", worker_url, workdir, "s0", N_GROUPS)
    processes = {"learner": _start(*learner_args), "sampler": _start(*sampler_args)}
    try:
        topic = "rollouts" if victim == "sampler" else "weights"
        killed = _kill_when_writing(
            processes[victim], tmp_path / "shared" / topic, min_committed=2, deadline=time.monotonic() + 60
        )
        assert killed, f"{victim} was not caught mid-write (exit code {processes[victim].poll()})"
        assert processes[victim].returncode == -signal.SIGKILL

        transport = FsspecTransport(url)
        leftovers = transport.incomplete(topic)
        assert leftovers, "a kill mid-write leaves a temporary behind"
        assert not set(transport.keys(topic)) & {name.split(".")[2] for name in leftovers if name.startswith(".tmp.")}
        _check_nothing_visible_is_corrupt(transport)

        processes[victim] = _start(*(sampler_args if victim == "sampler" else learner_args))
        for name, process in processes.items():
            _, err = process.communicate(timeout=120)
            assert process.returncode == 0, f"{name} exited {process.returncode}: {err.decode()[-2000:]}"
    finally:  # never leave a worker behind when an assertion fails
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)

    learner = json.loads((workdir / "learner.json").read_text())
    sampler = json.loads((workdir / "s0.json").read_text())
    expected = [f"s0-g{i:03d}" for i in range(N_GROUPS)]
    assert learner["consumed"] == expected  # every group consumed, once (ledger is a map)
    assert learner["counts"]["consumed"] == learner["counts"]["generated"] == N_GROUPS
    assert learner["counts"]["dropped"] == 0 and learner["counts"]["rejected"] == 0
    assert learner["corrupt"] == 0 and sampler["corrupt"] == 0
    assert sampler["loaded"] == sorted(sampler["loaded"])  # versions seen by the sampler never go back
    _check_nothing_visible_is_corrupt(transport)
