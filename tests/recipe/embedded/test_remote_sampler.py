"""``python -m recipe.gepo.remote_sampler``: a sampler in another process (another job, another
cluster) joins a running async learner through its fsspec exchange only.

Fast: the settings it needs are refused by name. Slow: a real learner run (1 local sampler, made
slow) and a remote sampler process on the same exchange folder; the learner trains on the remote
sampler's groups (its uids in the learner's ledger as consumed) and the remote sampler stops by
itself when the learner ends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe.gepo.main_gepo import run
from recipe.gepo.remote_sampler import check_remote_config, compose_config, main
from verl_ext.hetero.seeding import sampler_sampling_seed
from verl_ext.trust import signing as auth

from .helpers import TINY, read_metrics

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "overrides, index, named",
    [
        (["hetero.mode=replay", "hetero.transport=fs", "hetero.transport_url=/x"], 5, "hetero.mode='replay'"),
        (["hetero.mode=async", "hetero.transport=ray", "hetero.transport_url=/x"], 5, "hetero.transport='ray'"),
        (["hetero.mode=async", "hetero.transport=fs"], 5, "hetero.transport_url is empty"),
        (["hetero.mode=async", "hetero.transport=fs", "hetero.transport_url=/x"], -1, "--index -1"),
        (
            ["hetero.mode=async", "hetero.transport=fs", "hetero.transport_url=/x", "hetero.num_samplers=4"],
            3,
            "--index 3: must be in",
        ),
        (["hetero.mode=async", "hetero.transport=fs", "hetero.transport_url=/x"], 64, "--index 64: must be in"),
    ],
)
def test_what_a_remote_sampler_needs_is_refused_by_name(overrides, index, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        check_remote_config(compose_config(overrides), index)


def test_the_documented_indices_reach_a_first_batch():
    """The index the sbatch script starts by default and the README's example both pass the start-up
    check and seed a first batch (the default was once 100: refused by the seed layout at batch 0)."""
    sbatch = (ROOT / "scripts" / "slurm" / "remote_samplers.sbatch").read_text()
    default_base = int(re.search(r'INDEX_BASE="\$\{INDEX_BASE:-(\d+)\}"', sbatch).group(1))
    readme_index = int(re.search(r"remote_sampler --index (\d+)", (ROOT / "README.md").read_text()).group(1))
    cfg = compose_config(["hetero.mode=async", "hetero.transport=fs", "hetero.transport_url=/x"])
    for index in (default_base, default_base + 7, readme_index):  # an 8-task array's last task too
        check_remote_config(cfg, index, key_file="sampler.key")
        assert sampler_sampling_seed(int(cfg.hetero.seed), 0, index) >= 0


def test_the_command_line_names_the_missing_url_and_exits_2(capsys):
    assert main(["--index", "3"]) == 2
    assert "hetero.transport_url is empty" in capsys.readouterr().err


def test_a_signing_remote_sampler_needs_its_own_key(tmp_path, capsys):
    """hetero.trust.sign_records (the default): no --key, another sampler's key, or a key with
    signing off are refused by name before anything starts."""
    url = ["hetero.transport_url=/x"]
    assert main(["--index", "3", *url]) == 2
    assert "give --key <file>" in capsys.readouterr().err
    key_file = tmp_path / "k.key"
    assert auth.main(["keygen", str(key_file), "sampler-4"]) == 0
    capsys.readouterr()
    assert main(["--index", "3", "--key", str(key_file), *url, "hetero.dry_run=true"]) == 2
    assert "is 'sampler-4''s key; this is sampler-3" in capsys.readouterr().err
    assert main(["--index", "3", "--key", str(key_file), *url, "hetero.trust.sign_records=false"]) == 2
    assert "nothing would be signed" in capsys.readouterr().err


@pytest.mark.slow
def test_a_remote_sampler_process_feeds_the_learner_through_the_exchange(tiny_model_path, tmp_path):
    exchange = tmp_path / "exchange"
    # the operator's steps: a key made for the sampler, its public half enrolled where the learner reads
    key_file, enrolment = tmp_path / "sampler-7.key", tmp_path / "enrolment.json"
    public = subprocess.run(
        [sys.executable, "-m", "verl_ext.trust.signing", "keygen", str(key_file), "sampler-7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "verl_ext.trust.signing", "enrol", str(enrolment), "sampler-7", public],
        cwd=ROOT,
        check=True,
    )
    shared = [
        *TINY,
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "hetero.mode=async",
        "hetero.transport=fs",
        f"hetero.transport_url={exchange}",
        "hetero.num_samplers=1",
        "hetero.max_delay=4",
        "hetero.delay.dist=constant",
        "hetero.delay.value=0.0",
        "hetero.wait_timeout_s=120",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    remote = subprocess.Popen(
        [sys.executable, "-m", "recipe.gepo.remote_sampler", "--index", "7", "--key", str(key_file), *shared],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the local sampler is 30x slower than it is: most groups must come from the remote one
        cfg = compose_config(
            [
                *shared,
                "hetero.sampler_speed_factors=[30.0]",
                "trainer.total_training_steps=8",
                f"hetero.trust.enrolment_file={enrolment}",
                "trainer.test_freq=0",
                "trainer.save_freq=8",
                f"trainer.default_local_dir={tmp_path / 'run'}",
            ]
        )
        run(cfg)
        out, err = remote.communicate(timeout=120)  # it stops at the learner's stop marker
    finally:
        if remote.poll() is None:
            remote.kill()
            remote.communicate()
    assert remote.returncode == 0, err[-3000:]
    counters = json.loads(out.strip().splitlines()[-1])
    assert counters["sampler"] == 7 and counters["groups"] > 0
    assert [line["step"] for line in read_metrics(tmp_path / "run")] == list(range(9))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    state = torch.load(ckpt_dir / (ckpt_dir / "latest").read_text().strip(), weights_only=False)
    status = state["buffer"]["ledger"]["status"]
    remote_consumed = [uid for uid, s in status.items() if uid.startswith("r7-") and s == "consumed"]
    assert len(remote_consumed) >= 8, status  # 8 steps x 2 prompts: most from the remote sampler
