"""``make bench`` (scripts/bench/bench_losses.py) times every loss the project registers and every
verl loss a preset uses, no fewer, and each row runs through the real registry and presets."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import yaml
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

import verl_ext.algos.registry  # noqa: F401 -- registers the project's losses (as the verl plugin does)
from verl_ext.algos.registry import HETERORL_LOSS_MODES

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "recipe" / "gepo" / "config" / "algorithm_preset"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_losses", REPO / "scripts" / "bench" / "bench_losses.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _preset_loss_modes() -> set[str]:
    """The loss modes the recipe's presets set (a preset without one inherits another preset's)."""
    modes = set()
    for path in PRESETS.glob("*.yaml"):
        policy_loss = (
            (yaml.safe_load(path.read_text()) or {})
            .get("actor_rollout_ref", {})
            .get("actor", {})
            .get("policy_loss", {})
        )
        if "loss_mode" in policy_loss:
            modes.add(policy_loss["loss_mode"])
    return modes


def test_the_bench_times_every_project_loss_and_every_loss_a_preset_uses(bench):
    timed = {mode for _, _, mode in bench.LOSSES}
    project = {name for name, fn in POLICY_LOSS_REGISTRY.items() if fn.__module__ == "verl_ext.algos.registry"}
    assert project == set(HETERORL_LOSS_MODES)  # the project's own list is the registry's
    assert timed == project | _preset_loss_modes(), sorted(timed ^ (project | _preset_loss_modes()))
    assert {"gepo_tr", "gepo_tc", "m2po", "vespo"} <= timed
    labels = [label for label, _, _ in bench.LOSSES]
    assert len(set(labels)) == len(labels) and bench.LOSSES[0][2] == "vanilla"  # one row each; ratios to vanilla
    assert all((PRESETS / f"{preset}.yaml").is_file() for _, preset, _ in bench.LOSSES)


def test_a_tiny_run_times_every_row(bench):
    table = bench.main(["--batch", "16", "--length", "32", "--group-size", "8", "--repeats", "1"])
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table.splitlines()[4:]}
    assert list(rows) == [label for label, _, _ in bench.LOSSES]
    assert all(math.isfinite(float(ms)) and float(ms) > 0 for ms, _ in rows.values())
    assert rows["vanilla (GRPO)"][1] == "1.00 |"


@pytest.mark.parametrize(
    "args, message", [(["--batch", "12"], "--batch 12 --group-size 8"), (["--repeats", "0"], "--repeats 0")]
)
def test_bad_sizes_are_refused(bench, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err
