"""The option contract on the verl engine: every (option, verl) pair declared honoured changes
what the engine would hand to verl.

A verl run costs minutes on the CPU, so the observable is the engine's validated plan, taken
as ``hetero.dry_run=true`` takes it (``recipe.gepo.verl_engine.launch_plan``: ``validate`` then
``render``), and the settings ``runner.run`` passes to verl's trainer
(``engine_settings(resolve_task_files(cfg))``). HeteroRL's own sections are left out of those
settings -- they travel to verl's process as they are, so comparing them would count every option
as honoured -- and the files they name (the task's parquet pair, the model's folder) are read:
a ``task:`` option shows in the data or model verl gets, a ``hetero:`` option in the verl keys
derived from it or in the plan. A control pair (the same config twice gives the same observation)
comes first; an option that only acts inside verl's loop points to the named test that shows its
effect there (``OBSERVED_ELSEWHERE``, ``ALSO_IN_VERLS_LOOP``); a planted option declared honoured
but not read is caught (the harness can fail)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipe.gepo import options
from recipe.gepo.sections import HeteroConfig
from tests.recipe.test_options import (
    SECTIONS,
    BehaviourHarness,
    Case,
    _c,
    check_pointers,
    declare_honoured,
    write_case_data,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "recipe" / "gepo" / "config"
BASE = ("+verl_preset=cpu_toy", "hetero.engine=verl", "hetero.dry_run=true")
"""The CPU preset's verl run, planned (with the tiny model's path and a run dir)."""
MATH = ("task.name=math", "task.template=plain")  # a math task (the tiny model's tokenizer is not read)
DELAYS = ("hetero.delay.dist=uniform", "hetero.delay.low=0", "hetero.delay.high=2")

CASES_VERL: dict[str, Case] = {
    # hetero: the plan's delay line (the model's parameters and a seeded summary of its draws)
    "hetero.delay.dist": _c("hetero.delay.dist=none"),
    "hetero.delay.low": _c("hetero.delay.low=0.5"),
    "hetero.delay.high": _c("hetero.delay.high=30.0"),
    "hetero.delay.integer": _c("hetero.delay.integer=true", setup=DELAYS),
    "hetero.delay.confidence": _c("hetero.delay.confidence=0.2"),
    "hetero.delay.offset": _c("hetero.delay.offset=5.0"),
    "hetero.delay.value": _c("hetero.delay.value=1", setup=("hetero.delay.dist=constant",)),
    "hetero.delay.trace_path": _c(
        "hetero.delay.trace_path={data}/ones.txt",
        setup=("hetero.delay.dist=trace", "hetero.delay.trace_path={data}/zeros.txt"),
    ),
    "hetero.delay.trace_column": _c(
        "hetero.delay.trace_column=b",
        setup=("hetero.delay.dist=trace", "hetero.delay.trace_path={data}/delays.csv", "hetero.delay.trace_column=a"),
    ),
    # hetero: the verl keys derived from it, the plan
    "hetero.max_delay": _c("hetero.max_delay=0"),
    "hetero.stale_policy": _c("hetero.stale_policy=wait"),
    "hetero.keep_weight_versions": _c("hetero.keep_weight_versions=9"),
    "hetero.seed": _c("hetero.seed=1"),
    "hetero.export_hf": _c("hetero.export_hf=all", setup=("trainer.save_freq=1",)),
    # hetero: remote pools fill the training batches (the plan's pool lines, verl's agent loop manager)
    "hetero.transport": _c("hetero.transport=fs", "hetero.trust.sign_records=false"),
    "hetero.transport_url": _c(
        "hetero.transport_url={sandbox}/elsewhere", setup=("hetero.transport=fs", "hetero.trust.sign_records=false")
    ),
    # task: the data (and model) verl is given
    "task.digits": _c("task.digits=2"),
    "task.answer_format": _c("task.answer_format=scratchpad"),
    "task.eval_size": _c("task.eval_size=5"),
    "task.warm_start_steps": _c(
        "task.warm_start_steps=4",
        setup=(
            "actor_rollout_ref.model.path=",
            "task.digits=1",
            "task.cache_dir={data}/cache",
            "task.warm_start_steps=3",
        ),
    ),
    "task.cache_dir": _c("task.cache_dir={sandbox}/elsewhere"),
    "task.name": _c(*MATH),
    "task.dataset": _c("task.dataset=gsm8k", setup=MATH),
    "task.dataset_options": _c("+task.dataset_options.levels=[1]", setup=MATH),
    "task.dataset_path": _c(
        "task.dataset_path={data}/aime_b.jsonl",
        setup=(*MATH, "task.dataset=aime24", "task.dataset_path={data}/aime_a.jsonl"),
    ),
    "task.eval_dataset": _c("task.eval_dataset=gsm8k", setup=MATH),
    "task.eval_dataset_options": _c(
        "+task.eval_dataset_options.levels=[1]", setup=(*MATH, "task.eval_dataset=math_train")
    ),
    "task.template": _c("task.template=qwen3_think", setup=MATH),
    # verl_engine: the plan
    "verl_engine.old_log_prob": _c("+verl_engine.old_log_prob=recompute"),
    "verl_engine.node_resources": _c("+verl_engine.node_resources=true"),
    "verl_engine.preset": _c("verl_engine.preset=other"),
}
"""Every (option, verl) pair declared honoured, but the ones in OBSERVED_ELSEWHERE and the runner
selectors: how to see it change the plan or the settings handed to verl."""

OBSERVED_ELSEWHERE = {
    "hetero.dry_run": "tests/recipe/verl_engine/test_presets.py::test_run_with_dry_run_returns_the_plan_and_without_gpus_fails_clearly",
    "task.model": "tests/recipe/verl_engine/test_cpu_smollm2_preset.py::test_both_engines_resolve_task_model_to_the_converted_smollm2",
    "hetero.reissue_stale_prompts": "tests/recipe/verl_engine/test_prompt_reissue.py::test_the_option_sets_the_learners_limit_and_is_refused_without_pools",
}
"""Honoured (option, verl) pairs a plan cannot show: ``dry_run`` is what takes the plan (without it
the engine starts verl's workers), ``task.model`` converts SmolLM2 (a 135M-parameter download's
worth of work), ``reissue_stale_prompts`` acts in the pools' ingress: the test that shows each."""

ALSO_IN_VERLS_LOOP = {
    "hetero.delay.dist": "tests/cpu/test_verl_trainer.py::test_delays_follow_the_model_and_a_resumed_run_loses_no_step",
    "hetero.seed": "tests/cpu/test_verl_trainer.py::test_delays_follow_the_model_and_a_resumed_run_loses_no_step",
    "hetero.max_delay": "tests/cpu/test_verl_trainer.py::test_hetero_engine_verl_does_not_stall_and_keeps_the_bound",
    "hetero.stale_policy": "tests/recipe/verl_engine/test_trainer_registry.py::test_replay_buffer_bound_is_exact_over_weight_versions",
    "hetero.keep_weight_versions": "tests/recipe/verl_engine/test_delayed_sync.py::test_snapshot_budget_drops_the_oldest_and_counts_it_apart_from_supersession",
    "verl_engine.node_resources": "tests/recipe/verl_engine/test_node_placement.py::test_pinned_pools_ask_ray_for_their_roles_node_resource",
}
"""Options the plan shows but whose effect happens inside verl's loop (the trainer reads them from
the ``hetero:`` / ``verl_engine:`` section it is handed): the test that shows that effect."""

SELECTORS = ("hetero.engine", "hetero.mode")
"""They choose the runner itself."""
FAST = ("hetero.max_delay", "task.digits", "verl_engine.old_log_prob")
"""The representative subset of CASES_VERL run by default (the rest: ``-m slow``)."""


def honoured_verl_keys() -> set[str]:
    """Every field of the project's sections the contract declares honoured by the verl engine."""
    return {
        key
        for prefix, cls in SECTIONS
        for key, field, _ in options.option_fields(cls, prefix)
        if options.VERL in options.honoured_by(field)
    }


POOLS = "tests/recipe/verl_engine/test_pools.py"
INGRESS_CASE = f"{POOLS}::test_each_pool_key_the_ingress_reads_changes_its_buffer_or_gate"
LOOP_CASE = f"{POOLS}::test_each_pool_key_a_pool_reads_reaches_its_loop_or_weight_store"
POOL_CASES = {
    "hetero.transport": f"{POOLS}::test_a_learner_killed_and_resumed_trains_every_pool_group_at_most_once_and_loses_none",
    "hetero.transport_url": f"{POOLS}::test_the_plan_of_a_learner_fed_by_pools_names_the_exchange_and_its_checks",
    "hetero.order": INGRESS_CASE,
    "hetero.max_buffered_per_sampler": INGRESS_CASE,
    "hetero.keep_weight_versions": LOOP_CASE,
    "hetero.weights_bf16": LOOP_CASE,
    "hetero.weight_sync": LOOP_CASE,
    "hetero.max_delta_chain": LOOP_CASE,
    "hetero.sampler_skip_stale": LOOP_CASE,
    "hetero.max_queued_groups": LOOP_CASE,
    "hetero.wait_timeout_s": f"{POOLS}::test_the_learner_waits_for_pools_and_stops_after_the_timeout_naming_who_it_heard_from",
    "hetero.trust.sign_records": INGRESS_CASE,
    "hetero.trust.enrolment_file": INGRESS_CASE,
    "hetero.trust.check_rewards": f"{POOLS}::test_the_learner_recomputes_a_pools_rewards_against_its_own_answers",
    "hetero.trust.verify_fraction": f"{POOLS}::test_the_ingress_re_scores_a_pools_q_under_the_version_it_claims",
    "hetero.trust.probation_groups": INGRESS_CASE,
    "hetero.trust.hold_unchecked": INGRESS_CASE,
    "hetero.trust.logprob_tolerance": INGRESS_CASE,
    "hetero.trust.trust_penalty": INGRESS_CASE,
    "hetero.trust.trust_recovery": INGRESS_CASE,
    "hetero.trust.quarantine_below": INGRESS_CASE,
}
"""Every async key the verl engine also honours with sampler pools (``options.POOL_KEYS``): the test
that shows it act there (the ingress's buffer and gate, a pool's loop and weight store, or a run)."""


def test_every_key_honoured_with_pools_has_a_behaviour_case():
    assert set(POOL_CASES) == set(options.POOL_KEYS), "a pool key without its case, or a case for no pool key"
    check_pointers(POOL_CASES)
    ingress = (ROOT / POOLS).read_text()
    for key, where in POOL_CASES.items():  # the parametrized cases name the key itself
        if where in (INGRESS_CASE, LOOP_CASE):
            assert f'"{key}": (' in ingress, f"{key}: no case in {where}"


def test_every_honoured_verl_option_has_a_behaviour_case():
    covered = set(CASES_VERL) | set(OBSERVED_ELSEWHERE) | set(SELECTORS)
    honoured = honoured_verl_keys()
    assert honoured - covered == set(), "declared honoured by the verl engine with no behaviour case"
    assert covered - honoured == set(), "a behaviour case for an option the verl engine does not honour"
    assert set(ALSO_IN_VERLS_LOOP) <= honoured
    check_pointers(OBSERVED_ELSEWHERE)
    check_pointers(ALSO_IN_VERLS_LOOP)


def _table_digest(path: Path) -> str:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def _folder_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


class VerlHarness(BehaviourHarness):
    """Planned verl runs, each in its own sandbox folder (the working directory: the task's cache
    is relative to it), observed as (the plan, the settings handed to verl without the project's
    sections, digests of the data files and the model folder they name, the error)."""

    runner = "by the verl engine"

    def __init__(self, root: Path, model: str):
        super().__init__(root, model)
        self.data = write_case_data(root / "data")
        for name, base in (("aime_a.jsonl", 1), ("aime_b.jsonl", 7)):
            (self.data / name).write_text(
                "".join(
                    json.dumps({"problem": f"What is {i}+{base}?", "answer": str(i + base)}) + "\n" for i in range(5)
                )
            )

    def observe(self, overrides: tuple[str, ...]) -> dict:
        from recipe.gepo.verl_engine.launch_plan import engine_settings, render, validate
        from recipe.gepo.verl_engine.runner import resolve_task_files

        self._n += 1
        sandbox = self.root / f"run{self._n}"
        sandbox.mkdir()
        fill = {"data": self.data, "sandbox": sandbox}
        items = [
            o.format(**fill)
            for o in (
                *BASE,
                f"actor_rollout_ref.model.path={self.model}",
                f"trainer.default_local_dir={sandbox / 'run'}",
                *overrides,
            )
        ]
        plan = settings = None
        files: dict[str, str] = {}
        error = None
        cwd = os.getcwd()
        os.chdir(sandbox)
        try:
            searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
                cfg = compose(config_name="gepo_trainer", overrides=[searchpath, *items])
            plan = render(validate(cfg))
            handed = engine_settings(resolve_task_files(cfg))
            settings = {
                k: v
                for k, v in OmegaConf.to_container(handed, resolve=False).items()
                if k not in options.PROJECT_SECTIONS
            }
            for key in ("data.train_files", "data.val_files"):
                files[key] = _table_digest(Path(str(OmegaConf.select(handed, key))))
            files["actor_rollout_ref.model.path"] = _folder_digest(Path(str(handed.actor_rollout_ref.model.path)))
        except options.OptionNotHonoured:
            raise
        except Exception as err:  # noqa: BLE001 -- an error is an observation
            error = f"{type(err).__name__}: {err}"
        finally:
            os.chdir(cwd)
        text = json.dumps({"plan": plan, "settings": settings, "files": files, "error": error}, default=str)
        return json.loads(text.replace(str(sandbox), "<sandbox>"))

    def check_error(self, key: str, case: Case, changed: dict) -> None:
        """An option is seen in what the engine hands verl, not in a failure to plan."""
        assert changed["error"] is None, f"{key}: {case.change} failed: {changed['error']}"


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> VerlHarness:
    """On the embedded tests' tiny warm start (1 digit, 50 steps; ``tests/recipe/test_options.py``'s
    ``tiny_model``), cached across sessions."""
    from verl_ext.data.toy.checkpoints import warm_start

    cache = Path(os.environ.get("HETERORL_TEST_CACHE", Path(tempfile.gettempdir()) / "heterorl-test-cache"))
    model = warm_start(cache, digits=1, steps=50, n_eval=32, batch_size=32, warmup_steps=5)
    return VerlHarness(tmp_path_factory.mktemp("verl_behaviour"), str(model))


def test_the_control_pair_is_identical(harness):
    """The same config twice: the same plan, settings and files, so a difference below is the option's."""
    first = harness.control(())
    assert first["error"] is None and "HeteroRL verl engine plan" in first["plan"]
    assert set(first["files"]) == {"data.train_files", "data.val_files", "actor_rollout_ref.model.path"}
    assert harness.observe(()) == first


@pytest.mark.parametrize("key", FAST)
def test_a_representative_option_changes_the_verl_plan(harness, key):
    harness.check(key, CASES_VERL[key])


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(set(CASES_VERL) - set(FAST)))
def test_every_honoured_option_changes_the_verl_plan(harness, key):
    harness.check(key, CASES_VERL[key])


def test_the_harness_catches_an_option_declared_honoured_that_is_not_read(harness, monkeypatch):
    """Plant ``hetero.order`` (the embedded engine's buffer order; verl's replay buffer decides its
    own) among the options the verl engine honours: the coverage check and the behaviour check
    both fail."""
    declare_honoured(monkeypatch, HeteroConfig, "order", options.VERL)
    with pytest.raises(AssertionError, match="no behaviour case"):
        test_every_honoured_verl_option_has_a_behaviour_case()
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "hetero.order: declared honoured by the verl engine, but ('hetero.order=newest',) changed nothing"
        ),
    ):
        harness.check("hetero.order", _c("hetero.order=newest"))
