"""The recipe's run scripts (``recipe/gepo/run_*.sh``, verl's recipe convention): each parses and
passes shellcheck, hands every knob at its top to ``main_gepo`` (a changed variable shows in the
GPU scripts' dry-run plan), the GPU scripts default to the paper's data (MATH train; MATH500, AIME24,
AIME25, AMC23) and say they never ran, and the CPU scripts train: the embedded engine's by default,
the verl engine's (FSDP2, Megatron, SmolLM2) in the slow suite."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.slurm.test_slurm_scripts import assert_shellcheck_clean

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipe" / "gepo"
POOL_SCRIPT = RECIPE / "run_pool.sh"
SCRIPTS = sorted(p for p in RECIPE.glob("run_*.sh") if p != POOL_SCRIPT)
"""The scripts that run ``main_gepo`` (a learner); ``run_pool.sh`` starts a sampler pool."""
GPU_SCRIPTS = [
    "run_qwen3_1p7b_fsdp.sh",
    "run_qwen3_1p7b_megatron.sh",
    "run_qwen3_8b_fsdp.sh",
    "run_qwen3_8b_megatron.sh",
]
SHARED_DATA = ROOT.parent / "shared" / "data"
COMPETITION = ("aime24", "aime25", "amc23")
PAPER_VAL = ("math500", *COMPETITION)


def run_script(
    name: str, *overrides: str, env: dict[str, str] | None = None, timeout: float = 900, script_dir: Path = RECIPE
) -> subprocess.CompletedProcess:
    """``bash <script_dir>/<name> <overrides>`` with this interpreter (unless ``env`` names a
    ``PYTHON``) and one torch thread."""
    full_env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})}
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


@pytest.mark.parametrize("script", [*SCRIPTS, POOL_SCRIPT], ids=lambda p: p.name)
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


@pytest.fixture(scope="module")
def paper_data(tmp_path_factory) -> dict[str, str]:
    """The environment of the paper's data: HETERORL_DATA_DIR with copies of the AIME/AMC files, and
    one DATA_DIR the module's script runs share (the first prepares the parquet files, the rest reuse them)."""
    if not all((SHARED_DATA / f"{name}.jsonl").is_file() for name in COMPETITION):
        pytest.skip(f"no copies of aime24/aime25/amc23.jsonl in {SHARED_DATA}")
    base = tmp_path_factory.mktemp("paper_data")
    (base / "jsonl").mkdir()
    for name in COMPETITION:
        shutil.copy(SHARED_DATA / f"{name}.jsonl", base / "jsonl")
    return {"HETERORL_DATA_DIR": str(base / "jsonl"), "DATA_DIR": str(base / "parquet")}


def hydra_record(folder: Path) -> tuple[str, str]:
    """Overrides that make hydra record the composed config in ``folder/.hydra/config.yaml``."""
    return f"hydra.run.dir={folder}", "hydra.output_subdir=.hydra"


def recording_python(tmp_path: Path) -> tuple[str, Path]:
    """A ``PYTHON`` for the scripts that runs the data preparation for real and writes the arguments
    of the final ``main_gepo`` command to a file instead of running it (the data stage in a second;
    the slow tests below run the command itself)."""
    record = tmp_path / "main_gepo_args"
    stub = tmp_path / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$2" == verl_ext.data.paper_data ]]; then exec {shlex.quote(sys.executable)} "$@"; fi\n'
        f"printf '%s\\n' \"$@\" > {shlex.quote(str(record))}\n"
    )
    stub.chmod(0o755)
    return str(stub), record


def assert_paper_data(train_files, val_files, data_dir: str, thinking: bool = True) -> None:
    """``data.train_files`` is MATH train and ``data.val_files`` MATH500, AIME24, AIME25 and AMC23,
    parquet files under ``data_dir`` holding those sets (``data_source``) in the matching template."""
    template = "qwen3_think" if thinking else "qwen3_nothink"
    folder = Path(data_dir).resolve() / template
    assert train_files == str(folder / "math_train.parquet")
    assert list(val_files) == [str(folder / f"{name}.parquet") for name in PAPER_VAL]
    for name in ("math_train", *PAPER_VAL):
        table = pq.read_table(folder / f"{name}.parquet", columns=["data_source", "extra_info"])
        assert set(table.column("data_source").to_pylist()) == {name}
        assert {row["template"] for row in table.column("extra_info").to_pylist()} == {template}


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_scripts_say_they_never_ran(name):
    header = "".join(line for line in (RECIPE / name).read_text().splitlines(keepends=True) if line.startswith("#"))
    assert "NEVER RUN: this script has never run on a GPU cluster. Only its dry run (hetero.dry_run=true)" in header
    assert "run, on CPU (docs/gpu.md section 4)" in header


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_scripts_prepare_the_papers_data_and_pass_it_on(name, paper_data, tmp_path):
    python, record = recording_python(tmp_path)
    out = run_script(name, "hetero.dry_run=true", env={**paper_data, "PYTHON": python}, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    args = record.read_text().splitlines()
    assert args[:2] == ["-m", "recipe.gepo.main_gepo"] and args[-1] == "hetero.dry_run=true"
    given = dict(arg.split("=", 1) for arg in args if "=" in arg)
    assert_paper_data(given["data.train_files"], yaml.safe_load(given["data.val_files"]), paper_data["DATA_DIR"])
    assert given["+data.apply_chat_template_kwargs.enable_thinking"] == "true"
    assert given["reward.custom_reward_function.path"] == "pkg://verl_ext.rewards.dispatch"
    # one line per set the first run of the module wrote, none once they exist
    assert re.fullmatch(r"(prepared (math500|aime24|aime25|amc23|math_train): \d+ rows .*\n)*", out.stderr)


def test_a_missing_competition_folder_or_file_stops_a_gpu_script_with_one_error_line(tmp_path, paper_data):
    python, record = recording_python(tmp_path)
    env = {"PYTHON": python, "DATA_DIR": str(tmp_path / "parquet"), "HETERORL_DATA_DIR": ""}
    out = run_script("run_qwen3_1p7b_fsdp.sh", env=env, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: HETERORL_DATA_DIR is not set: ") and out.stderr.count("\n") == 1
    jsonl = tmp_path / "jsonl"
    shutil.copytree(paper_data["HETERORL_DATA_DIR"], jsonl)
    (jsonl / "amc23.jsonl").unlink()
    out = run_script("run_qwen3_8b_megatron.sh", env={**env, "HETERORL_DATA_DIR": str(jsonl)}, timeout=60)
    assert out.returncode == 2
    assert (
        out.stderr.startswith(f"error: HETERORL_DATA_DIR={jsonl}: no file {jsonl}/amc23.jsonl")
        and out.stderr.count("\n") == 1
    )
    assert not record.exists() and not (tmp_path / "parquet").exists()  # stopped before any work


def test_files_a_user_gives_win_and_val_sets_leave_the_competition_sets_out(tmp_path):
    python, record = recording_python(tmp_path)
    env = {
        "PYTHON": python,
        "DATA_DIR": str(tmp_path / "parquet"),
        "HETERORL_DATA_DIR": "",
        "TRAIN_FILES": "/data/my_train.parquet",
        "VAL_FILES": "[/data/a.parquet,/data/b.parquet]",
        "THINKING": "false",
    }
    out = run_script("run_qwen3_8b_fsdp.sh", env=env, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    given = dict(arg.split("=", 1) for arg in record.read_text().splitlines() if "=" in arg)
    assert given["data.train_files"] == "/data/my_train.parquet"
    assert given["data.val_files"] == "[/data/a.parquet,/data/b.parquet]"
    assert given["+data.apply_chat_template_kwargs.enable_thinking"] == "false"
    assert not (tmp_path / "parquet").exists()  # nothing prepared
    env.update(TRAIN_FILES="", VAL_FILES="", VAL_SETS="math500")  # no HETERORL_DATA_DIR needed
    out = run_script("run_qwen3_1p7b_megatron.sh", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    given = dict(arg.split("=", 1) for arg in record.read_text().splitlines() if "=" in arg)
    folder = (tmp_path / "parquet" / "qwen3_nothink").resolve()
    assert given["data.train_files"] == str(folder / "math_train.parquet")
    assert given["data.val_files"] == str(folder / "math500.parquet")
    assert sorted(p.name for p in folder.iterdir()) == ["math500.parquet", "math_train.parquet"]


# slow (~10 s each: a full compose and plan); the default run dry-runs one script with changed
# variables below, which also shows that script passes
@pytest.mark.slow
@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_scripts_pass_the_dry_run_with_the_papers_settings(name, paper_data, tmp_path):
    out = run_script(name, "hetero.dry_run=true", *hydra_record(tmp_path), env=paper_data, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    composed = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())  # hydra's record of the config
    assert_paper_data(composed["data"]["train_files"], composed["data"]["val_files"], paper_data["DATA_DIR"])
    assert composed["data"]["apply_chat_template_kwargs"] == {"enable_thinking": True}
    assert composed["reward"]["custom_reward_function"]["path"] == "pkg://verl_ext.rewards.dispatch"
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
def test_changed_variables_of_a_gpu_script_change_its_plan(name, tmp_path):
    env = {
        "TRAIN_FILES": "/data/my_train.parquet",
        "VAL_FILES": "[/data/a.parquet,/data/b.parquet]",
        "THINKING": "false",
        "HETERORL_DATA_DIR": "",
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
    out = run_script(name, "hetero.dry_run=true", *hydra_record(tmp_path), timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "prepared" not in out.stderr  # the files given are used as they are
    data = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())["data"]
    assert data["train_files"] == "/data/my_train.parquet" and data["val_files"] == [
        "/data/a.parquet",
        "/data/b.parquet",
    ]
    assert data["apply_chat_template_kwargs"] == {"enable_thinking": False}
    plan = out.stdout
    assert "model:           /models/my-qwen (not found here; fine if the cluster has it)" in plan
    assert "train /data/my_train.parquet (not found here; fine if the cluster has it)" in plan
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


def test_the_pool_script_needs_the_exchange_makes_its_key_and_reaches_the_pool(tmp_path):
    """run_pool.sh: refused without EXCHANGE_URL; otherwise it makes the pool's key on first use
    (printing the enrol line) and hands its knobs and the extra overrides to ``recipe.gepo.pool``,
    which validates them (``hetero.dry_run=true``: nothing started)."""
    out = run_script("run_pool.sh", script_dir=RECIPE, timeout=120)
    assert out.returncode == 2 and "error: EXCHANGE_URL is empty" in out.stderr
    key = tmp_path / "keys" / "pool-7.key"
    env = {"EXCHANGE_URL": str(tmp_path / "x"), "INDEX": "7", "KEY_FILE": str(key)}
    out = run_script("run_pool.sh", "hetero.dry_run=true", "hetero.max_delay=5", env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert key.is_file() and "enrol <hetero.trust.enrolment_file> pool-7 " in out.stderr
    # the exchange and the extra overrides reach the pool
    assert f"[pool 7] config ok (dry run): exchange {tmp_path / 'x'}, max_delay=5," in out.stdout
