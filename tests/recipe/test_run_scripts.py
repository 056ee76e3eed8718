"""The recipe's run scripts (``recipe/gepo/run_*.sh``, verl's recipe convention): each parses and
passes shellcheck, hands every knob at its top to ``main_gepo`` (a changed variable shows in the
GPU scripts' dry-run plan), and the CPU scripts train: the embedded engine's by default, the verl
engine's (FSDP2, Megatron, SmolLM2) in the slow suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.test_slurm_scripts import assert_shellcheck_clean

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipe" / "gepo"
SCRIPTS = sorted(RECIPE.glob("run_*.sh"))
GPU_SCRIPTS = [
    "run_qwen3_1p7b_fsdp.sh",
    "run_qwen3_1p7b_megatron.sh",
    "run_qwen3_8b_fsdp.sh",
    "run_qwen3_8b_megatron.sh",
]


def run_script(
    name: str, *overrides: str, env: dict[str, str] | None = None, timeout: float = 900, script_dir: Path = RECIPE
) -> subprocess.CompletedProcess:
    """``bash <script_dir>/<name> <overrides>`` with this interpreter and one torch thread."""
    full_env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        ["bash", str(script_dir / name), *overrides], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def knobs(script: Path) -> list[str]:
    """The variables a user edits: ``NAME=${NAME:-default}`` lines at the script's top."""
    return re.findall(r"^([A-Z][A-Z0-9_]*)=\$\{\1:-", script.read_text(), flags=re.M)


def test_every_setting_a_user_starts_from_has_a_script():
    assert {p.name for p in SCRIPTS} == {
        *GPU_SCRIPTS,
        "run_cpu_toy.sh",
        "run_cpu_toy_megatron.sh",
        "run_cpu_smollm2.sh",
        "run_embedded_toy.sh",
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert_shellcheck_clean(script)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_knob_is_commented_and_reaches_the_command(script):
    """Every variable is used after its definition (in the command or an optional override), has a
    comment above it (or above its block of siblings), and the script ends in the one
    ``python -m <this recipe>.main_gepo`` command with the extra arguments passed through."""
    text = script.read_text()
    lines = text.splitlines()
    names = knobs(script)
    expected = {
        "MODEL_PATH",
        "ALGORITHM",
        "CLIP_RATIO_LOW",
        "CLIP_RATIO_HIGH",
        "LR",
        "MAX_DELAY",
        "LOGGER",
        "RUN_DIR",
        "TRAIN_BATCH_SIZE",
        "N_RESP_PER_PROMPT",
        "MAX_RESPONSE_LENGTH",
    }
    assert expected <= set(names), expected - set(names)
    for name in names:
        definition = next(i for i, line in enumerate(lines) if line.startswith(f"{name}=${{{name}:-"))
        assert f"${name}" in "\n".join(lines[definition + 1 :]), f"{script.name}: {name} is never used"
        above = definition - 1
        while not lines[above].startswith("#") and re.match(r"^[A-Z_0-9]+=\$\{", lines[above]):
            above -= 1  # a block of siblings shares one comment
        assert lines[above].startswith("#"), f"{script.name}: {name} has no comment"
    assert 'RECIPE=recipe.$(basename "$RECIPE_DIR")' in text
    assert re.search(r'^exec "\$PYTHON" -m "\$RECIPE\.main_gepo"', text, flags=re.M)
    assert text.rstrip().endswith('"${optional[@]}" "$@"')


# slow (~10 s each: a full compose and plan); the default run dry-runs one script with changed
# variables below, which also shows that script passes
@pytest.mark.slow
@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_scripts_pass_the_dry_run_with_the_papers_settings(name):
    out = run_script(name, "hetero.dry_run=true", timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    plan = out.stdout
    preset = name[len("run_") : -len(".sh")]
    assert f"preset:          {preset}" in plan and "trainer_mode=hetero_separate_async " in plan
    size = "8B" if "8b" in name else "1.7B"
    assert f"model:           Qwen/Qwen3-{size}" in plan
    assert "32 prompts x G=8 = 256 responses/step" in plan and "lr 1e-06" in plan
    assert "staleness bound: 8 versions" in plan
    offset = "offset=400"  # the paper's delays: 1.7B L=60 s, 8B L=400 s, both 400 s subtracted
    assert (
        "lognormal(low=400, high=3600" if "8b" in name else "lognormal(low=60, high=1920"
    ) in plan and offset in plan


@pytest.mark.slow  # ~12 s a script: test_each_knob_is_commented_and_reaches_the_command stays in the default run
@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_changed_variables_of_a_gpu_script_change_its_plan(name):
    env = {
        "MODEL_PATH": "/models/my-qwen",
        "TRAIN_BATCH_SIZE": "16",
        "PPO_MINI_BATCH_SIZE": "16",
        "N_RESP_PER_PROMPT": "4",
        "LR": "3e-6",
        "ALGORITHM": "gspo",
        "CLIP_RATIO_LOW": "0.1",
        "CLIP_RATIO_HIGH": "0.3",
        "DELAY": "none",
        "MAX_DELAY": "64",
        "LEARNER_NNODES": "1",
        "LEARNER_GPUS_PER_NODE": "4",
        "SAMPLER_NNODES": "1",
        "SAMPLER_GPUS_PER_NODE": "2",
        "MAX_RESPONSE_LENGTH": "1024",
        "LEARNER_TP": "2",
        "LEARNER_PP": "2",
    }
    out = run_script(name, "hetero.dry_run=true", timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    plan = out.stdout
    assert "model:           /models/my-qwen" in plan
    assert "16 prompts x G=4 = 64 responses/step" in plan and "lr 3e-06" in plan and "response <= 1024" in plan
    assert "loss_mode=gspo" in plan and "clip=[0.1, 0.3]" in plan
    assert "delay (weights): none" in plan and "staleness bound: 64 versions" in plan
    assert re.search(r"learner: +1 node\(s\) x 4 GPU", plan) and re.search(r"samplers: +1 node\(s\) x 2 GPU", plan)
    if "megatron" in name:
        assert "Megatron TP=2 PP=2" in plan


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow  # ~12 s; the demo test trains the embedded engine, the knob test reads this script
def test_the_embedded_script_trains_two_steps(tmp_path):
    run_dir = tmp_path / "run"
    out = run_script(
        "run_embedded_toy.sh",
        env={
            "MODE": "replay",
            "TOTAL_STEPS": "2",
            "TEST_FREQ": "2",
            "EVAL_SIZE": "16",
            "ALGORITHM": "grpo",
            "RUN_DIR": str(run_dir),
        },
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    steps = {row["step"] for row in metrics_rows(run_dir) if "reward/mean" in row}
    assert steps == {1, 2}
    assert (run_dir / "report.md").is_file()
    assert "loss_mode: vanilla" in (run_dir / "config.yaml").read_text()  # ALGORITHM=grpo reached the run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["run_cpu_toy.sh", "run_cpu_toy_megatron.sh"])
def test_the_verl_engine_cpu_scripts_train_two_steps(tmp_path, name):
    run_dir = tmp_path / "run"
    out = run_script(name, env={"TOTAL_STEPS": "2", "RUN_DIR": str(run_dir), "DELAY_DIST": "none"}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [row for row in metrics_rows(run_dir) if "is/group_log_denominator_mean" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert (run_dir / "report.md").is_file()


@pytest.mark.slow
def test_the_smollm2_script_trains_two_steps(tmp_path):
    """SmolLM2-135M-Instruct through verl's trainer: ~15 GB of memory, ~6 minutes on 2 cores."""
    available = (
        next(
            (
                int(line.split()[1])
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemAvailable:")
            ),
            0,
        )
        / 2**20
    )
    if available < 16:
        pytest.skip(f"needs ~16 GB of free memory (peak 15.5 GB measured), {available:.1f} GB available")
    run_dir = tmp_path / "run"
    out = run_script(
        "run_cpu_smollm2.sh", env={"TOTAL_STEPS": "2", "SAVE_FREQ": "-1", "RUN_DIR": str(run_dir)}, timeout=1800
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert [row["step"] for row in metrics_rows(run_dir) if "is/group_log_denominator_mean" in row] == [1, 2]
