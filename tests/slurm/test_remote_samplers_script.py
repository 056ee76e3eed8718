"""``scripts/slurm/remote_samplers.sbatch`` run by bash on this machine, without SLURM (the array
task id is an environment variable): its key handling with the real ``verl_ext.trust.signing`` CLI,
and the command it assembles. ``SAMPLER_CMD=echo ...`` stands in for the sampler program (the
documented knob), so the tests see the exact arguments without starting a sampler; one test runs
the real ``recipe.gepo.remote_sampler`` in dry-run mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hetero.factories import build_group
from tests.slurm.test_slurm_scripts import assert_shellcheck_clean
from verl_ext.trust.signing import Enrolment, SamplerKey

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "remote_samplers.sbatch"
VENV = Path(sys.executable).parent.parent  # the script runs $VENV/bin/python
SETTINGS = (
    "EXCHANGE_URL",
    "RECIPE",
    "KEY_DIR",
    "ENROLMENT_FILE",
    "NO_SIGN",
    "SAMPLER_CMD",
    "POOL",
    "INDEX_BASE",
    "PRESET_ARGS",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_SUBMIT_DIR",
    "REPO",
    "VENV",
)


def run_script(tmp_path: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update(HOME=str(tmp_path / "home"), REPO=str(ROOT), VENV=str(VENV), EXCHANGE_URL=str(tmp_path / "exchange"))
    env.update(settings)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def public_of(key_file: Path) -> str:
    return SamplerKey.load(key_file).public_hex()


def accepts(enrol_file: Path, key_file: Path, sampler_id: str) -> bool:
    """Would a learner reading ``enrol_file`` accept a record this key signs?"""
    record = build_group("g0", 0, sampler=sampler_id).to_bytes()
    return Enrolment.load(enrol_file).open(SamplerKey.load(key_file).seal(record)) == (sampler_id, record)


def test_shellcheck_clean():
    assert_shellcheck_clean(SCRIPT)


def test_an_existing_key_is_enrolled_on_every_start(tmp_path):
    """The key outlives the learner (KEY_DIR persists): a later learner's enrolment file gets it too."""
    keys = tmp_path / "keys"
    key_file = keys / "sampler-34.key"
    first_file, second_file = tmp_path / "run1-enrolment.json", tmp_path / "run2-enrolment.json"
    common = dict(KEY_DIR=str(keys), SAMPLER_CMD="echo sampler", SLURM_ARRAY_TASK_ID="2")

    first = run_script(tmp_path, ENROLMENT_FILE=str(first_file), **common)
    assert first.returncode == 0, first.stderr
    assert key_file.stat().st_mode & 0o777 == 0o600
    key_bytes = key_file.read_bytes()
    assert f"sampler-34 public key: {public_of(key_file)}" in first.stdout
    assert accepts(first_file, key_file, "sampler-34")

    # a new learner, a new enrolment file: the key exists and is enrolled there as well (the bug: it was not)
    second = run_script(tmp_path, ENROLMENT_FILE=str(second_file), **common)
    assert second.returncode == 0, second.stderr
    assert key_file.read_bytes() == key_bytes  # the same key, not a new one
    assert f"sampler-34 enrolled in {second_file}" in second.stdout
    assert accepts(second_file, key_file, "sampler-34")

    # and again into the same file: nothing changes
    text = second_file.read_text()
    again = run_script(tmp_path, ENROLMENT_FILE=str(second_file), **common)
    assert again.returncode == 0, again.stderr
    assert second_file.read_text() == text
    assert list(Enrolment.load(second_file).keys) == ["sampler-34"]
    assert list(Enrolment.load(second_file).keys["sampler-34"].values()) == [public_of(key_file)]


def test_without_enrolment_file_the_enrol_line_is_printed_for_an_existing_key_too(tmp_path):
    for _ in range(2):
        result = run_script(tmp_path, SAMPLER_CMD="echo sampler")
        assert result.returncode == 0, result.stderr
        key_file = tmp_path / "home" / ".heterorl" / "keys" / "sampler-32.key"  # the default KEY_DIR
        assert (
            f"enrol it: python -m verl_ext.trust.signing enrol <the learner's hetero.trust.enrolment_file> "
            f"sampler-32 {public_of(key_file)}" in result.stdout
        )


def test_sampler_cmd_replaces_only_the_program(tmp_path):
    keys = tmp_path / "keys"
    result = run_script(
        tmp_path,
        "a=1",
        "b.c=x y",
        SAMPLER_CMD="echo my-sampler --flag",
        KEY_DIR=str(keys),
        INDEX_BASE="7",
        SLURM_ARRAY_TASK_ID="3",
        PRESET_ARGS="algorithm_preset=gepo hetero.seed=3",
    )
    assert result.returncode == 0, result.stderr
    args = (
        f"my-sampler --flag --index 10 --key {keys / 'sampler-10.key'} hetero.transport_url={tmp_path / 'exchange'} "
        "algorithm_preset=gepo hetero.seed=3 a=1 b.c=x y"
    )
    lines = result.stdout.splitlines()
    assert f"{args} hetero.dry_run=true" in lines  # the validation run
    assert lines[-1] == args  # the run itself (exec)
    assert (keys / "sampler-10.key").is_file()


def test_no_sign_passes_no_key_and_makes_none(tmp_path):
    result = run_script(tmp_path, SAMPLER_CMD="echo s", NO_SIGN="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"s --index 32 hetero.transport_url={tmp_path / 'exchange'}"
    assert not (tmp_path / "home" / ".heterorl").exists()


@pytest.mark.slow  # ~17 s: two dry runs of the real program; the default run checks the command line with SAMPLER_CMD
def test_the_real_remote_sampler_accepts_the_command_and_the_enrolled_key(tmp_path):
    """The default program, ``recipe.gepo.remote_sampler``, checks its config and the key in dry
    runs (the extra ``hetero.dry_run=true`` makes the final exec a dry run as well)."""
    keys, enrol_file = tmp_path / "keys", tmp_path / "enrolment.json"
    keys.mkdir(mode=0o700)
    key_file = keys / "sampler-32.key"
    SamplerKey.generate("sampler-32").save(key_file)  # a key left by an earlier run
    result = run_script(tmp_path, "hetero.dry_run=true", KEY_DIR=str(keys), ENROLMENT_FILE=str(enrol_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("[heterorl] remote sampler-32: config ok (dry run)") == 2
    assert accepts(enrol_file, key_file, "sampler-32")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"INDEX_BASE": "abc"}, "INDEX_BASE=abc: must be a non-negative integer"),
        ({"INDEX_BASE": "-1"}, "INDEX_BASE=-1: must be a non-negative integer"),
        ({"NO_SIGN": "yes"}, "NO_SIGN=yes: must be 1"),
        ({"NO_SIGN": "1", "ENROLMENT_FILE": "/x/e.json"}, "ENROLMENT_FILE=/x/e.json is set but NO_SIGN=1"),
        ({"NO_SIGN": "1", "KEY_DIR": "/x/keys"}, "KEY_DIR=/x/keys is set but NO_SIGN=1"),
        ({"ENROLMENT_FILE": "s3://bucket/e.json"}, "ENROLMENT_FILE=s3://bucket/e.json: must be a file path"),
        ({"ENROLMENT_FILE": "/no/such/dir/e.json"}, "ENROLMENT_FILE=/no/such/dir/e.json: its directory does not exist"),
        ({"SAMPLER_CMD": "   "}, "SAMPLER_CMD='   ': no program in it"),
    ],
)
def test_bad_settings_are_refused_naming_them(tmp_path, settings, message):
    result = run_script(tmp_path, **{"SAMPLER_CMD": "echo s", **settings})
    assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr
    assert "--index" not in result.stdout  # nothing was started


def test_a_key_of_another_sampler_is_refused_before_enrolling_it(tmp_path):
    keys, enrol_file = tmp_path / "keys", tmp_path / "enrolment.json"
    keys.mkdir()
    SamplerKey.generate("sampler-7").save(keys / "sampler-32.key")
    result = run_script(tmp_path, SAMPLER_CMD="echo s", KEY_DIR=str(keys), ENROLMENT_FILE=str(enrol_file))
    assert result.returncode == 2
    assert "is 'sampler-7''s key, not --sampler-id 'sampler-32''s" in result.stderr
    assert not enrol_file.exists() and "--index" not in result.stdout


@pytest.mark.slow  # ~14 s; the default run checks a copied recipe's own code in tests/recipe/test_recipe_copy.py
def test_recipe_names_a_copied_recipe_whose_sampler_runs(tmp_path):
    """RECIPE=recipe.mygepo runs the copy's remote sampler from REPO: the copy's edited message is
    printed by both dry runs (validation and the final exec), the original's is not."""
    import shutil

    tree = tmp_path / "repo"
    (tree / "recipe").mkdir(parents=True)
    shutil.copy(ROOT / "recipe" / "__init__.py", tree / "recipe" / "__init__.py")
    shutil.copytree(ROOT / "recipe" / "gepo", tree / "recipe" / "mygepo", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    sampler = tree / "recipe" / "mygepo" / "remote_sampler.py"
    text = sampler.read_text()
    message = "[heterorl] remote sampler-{index}: config ok"
    assert text.count(message) == 1
    sampler.write_text(text.replace(message, "[mygepo] remote sampler-{index}: config ok"))
    result = run_script(
        tmp_path,
        "hetero.dry_run=true",
        "hetero.trust.sign_records=false",
        REPO=str(tree),
        RECIPE="recipe.mygepo",
        NO_SIGN="1",
        PYTHONPATH="",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("[mygepo] remote sampler-32: config ok (dry run)") == 2
    assert "[heterorl] remote sampler-32: config ok" not in result.stdout


def test_pool_tasks_sign_as_pools_and_run_the_pool_program(tmp_path):
    """POOL=1: the key is pool-INDEX's (what recipe.gepo.pool checks), and the default program is
    the recipe's pool; anything but 0/1 is refused."""
    keys = tmp_path / "keys"
    result = run_script(tmp_path, "+verl_preset=cpu_toy", POOL="1", KEY_DIR=str(keys), SAMPLER_CMD="echo pool")
    assert result.returncode == 0, result.stderr
    key_file = keys / "pool-32.key"
    assert SamplerKey.load(key_file).sampler_id == "pool-32"
    assert f"pool-32 public key: {public_of(key_file)}" in result.stdout
    assert (
        f"pool --index 32 --key {key_file} hetero.transport_url={tmp_path / 'exchange'} +verl_preset=cpu_toy"
        in result.stdout
    )
    assert "pool 32 -> " in result.stdout
    # without SAMPLER_CMD: $VENV/bin/python -m $RECIPE.pool (a stub python echoes what it is asked to run)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text(
        f'#!/usr/bin/env bash\nif [[ "$2" == verl_ext.trust.signing ]]; then exec {sys.executable} "$@"; fi\necho RUN "$@"\n'
    )
    stub.chmod(0o755)
    result = run_script(tmp_path, POOL="1", KEY_DIR=str(keys), VENV=str(venv))
    assert result.returncode == 0, result.stderr
    assert f"RUN -m recipe.gepo.pool --index 32 --key {key_file} " in result.stdout
    refused = run_script(tmp_path, POOL="yes", SAMPLER_CMD="echo pool")
    assert refused.returncode == 2 and "POOL=yes: must be 1" in refused.stderr
