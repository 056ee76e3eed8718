"""A copy of the recipe runs its own code: ``recipe/gepo`` copied to ``recipe/mygepo`` in a
temporary tree, one thing edited in the copy, its run script run for 2 steps. The edit shows in the
run, and Python's import log shows that no module of ``recipe.gepo`` was imported (the editable
install would still find the original, so only the log can prove it was not used)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL = ROOT / "recipe" / "gepo"


def copy_recipe(tree: Path, name: str = "mygepo") -> Path:
    """``tree/recipe/<name>``: the recipe copied as a user would (``cp -r recipe/gepo recipe/<name>``),
    in a tree that has the repository's ``configs/`` beside it and no ``recipe/gepo``."""
    (tree / "recipe").mkdir(parents=True)
    shutil.copy(ROOT / "recipe" / "__init__.py", tree / "recipe" / "__init__.py")
    copy = tree / "recipe" / name
    shutil.copytree(ORIGINAL, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    return copy


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {path}"
    path.write_text(text.replace(old, new))


def run_copy(copy: Path, script: str, *overrides: str, env: dict[str, str], timeout: float):
    """The copy's run script with the temporary tree first on the path and Python's import log on
    (``-X importtime`` for this process and every one it starts)."""
    full_env = dict(
        os.environ,
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        PYTHONPROFILEIMPORTTIME="1",
        PYTHONPATH=str(copy.parents[1]),
        **env,
    )
    return subprocess.run(
        ["bash", str(copy / script), *overrides],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=copy.parents[1],
    )


def imported_recipe_modules(stderr: str) -> set[str]:
    """Modules of any ``recipe.*`` package named in ``-X importtime``'s log."""
    return set(re.findall(r"^import time:.*\|\s+(recipe\.[\w.]+)\s*$", stderr, flags=re.M))


def log(out: subprocess.CompletedProcess) -> str:
    """The run's output without the import log, for failure messages."""
    err = "\n".join(line for line in out.stderr.splitlines() if not line.startswith("import time:"))
    return out.stdout[-2000:] + err[-6000:]


def test_a_copied_recipe_runs_its_own_modules_and_configs(tmp_path):
    copy = copy_recipe(tmp_path)
    # code: the copy's report writer; config: a value of the copy's algorithm preset
    edit(copy / "run_report.py", 'f"# Run report: {name}"', 'f"# MyGEPO run report: {name}"')
    edit(copy / "config" / "algorithm_preset" / "gepo.yaml", "sampler_kl_coef: 0.005", "sampler_kl_coef: 0.0075")
    run_dir = tmp_path / "run"
    out = run_copy(
        copy,
        "run_embedded_toy.sh",
        env={"MODE": "replay", "TOTAL_STEPS": "2", "TEST_FREQ": "2", "EVAL_SIZE": "16", "RUN_DIR": str(run_dir)},
        timeout=600,
    )
    assert out.returncode == 0, log(out)
    assert (run_dir / "report.md").read_text().startswith("# MyGEPO run report: run")
    assert "sampler_kl_coef: 0.0075" in (run_dir / "config.yaml").read_text()
    modules = imported_recipe_modules(out.stderr)
    assert {
        "recipe.mygepo",
        "recipe.mygepo.embedded.replay",
        "recipe.mygepo.run_report",
    } <= modules  # main_gepo runs as __main__
    assert not {m for m in modules if m == "recipe.gepo" or m.startswith("recipe.gepo.")}, modules
    # the original's report writer was not edited: the copy did not change it
    assert 'f"# Run report: {name}"' in (ORIGINAL / "run_report.py").read_text()


@pytest.mark.slow  # ~10 s: the copy's own-code run stays in the default suite
def test_a_copied_recipe_plans_with_its_own_trainer_name(tmp_path):
    """The verl engine registers the copy's trainer under a name of its own (verl's registry is one
    per process), and the copy's config defaults reach the plan."""
    copy = copy_recipe(tmp_path)
    edit(copy / "config" / "gepo_trainer.yaml", "  seq_reduction: mean\n", "  seq_reduction: sum\n")
    out = run_copy(copy, "run_cpu_toy.sh", "hetero.dry_run=true", env={}, timeout=300)
    assert out.returncode == 0, log(out)
    assert "trainer_mode=hetero_separate_async_recipe_mygepo " in out.stdout
    assert "seq_reduction=sum" in out.stdout
    modules = imported_recipe_modules(out.stderr)
    assert "recipe.mygepo.verl_engine.launch_plan" in modules
    assert not {m for m in modules if m.startswith("recipe.gepo.")}, modules


@pytest.mark.slow  # ~10 s: the copy's own-code run stays in the default suite
def test_two_recipes_register_two_trainers_in_one_process(tmp_path):
    """The original and a copy imported side by side: each trainer under its own name in verl's
    registry, no clash."""
    copy_recipe(tmp_path)
    code = (
        "import importlib.util, sys\n"
        "import recipe.mygepo.verl_engine.trainer as mine\n"
        # the original package under its own name, from the repository
        "spec = importlib.util.spec_from_file_location('recipe.gepo', sys.argv[2] + '/__init__.py',"
        " submodule_search_locations=[sys.argv[2]])\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['recipe.gepo'] = mod; spec.loader.exec_module(mod)\n"
        "import recipe.gepo.verl_engine.trainer as original\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "assert get_trainer_cls('hetero_separate_async') is original.HeteroSeparateAsyncTrainer\n"
        "assert get_trainer_cls('hetero_separate_async_recipe_mygepo') is mine.HeteroSeparateAsyncTrainer\n"
        "assert original.HeteroSeparateAsyncTrainer is not mine.HeteroSeparateAsyncTrainer\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(ORIGINAL)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path)),
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
