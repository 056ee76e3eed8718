"""What the sweep runs: algorithms, tasks, designs (:class:`Plan` and its defaults), staleness
conditions, each run's directory and hydra overrides, and the design id rows carry."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

#: algorithm name -> hydra overrides. Controls: gepo_std (std-normalised advantages), *_nokl
#: (sampler-KL penalty off; presets have 0.005), grpo_tis (verl's decoupled truncated IS, C = 2).
#: The paper's baselines: grpo_paper (no dual clip), gspo_wide (GSPO at clip 0.2); gspo keeps the
#: GSPO paper's 3e-4 / 4e-4 and grpo verl's dual clip (c = 3).
ALGOS: dict[str, list[str]] = {
    "gepo": ["algorithm_preset=gepo"],
    "gspo": ["algorithm_preset=gspo"],
    "gspo_wide": ["algorithm_preset=gspo_wide"],
    "grpo": ["algorithm_preset=grpo"],
    "grpo_paper": ["algorithm_preset=grpo_paper"],
    "dr_grpo": ["algorithm_preset=dr_grpo"],
    "bnpo": ["algorithm_preset=bnpo"],
    "gepo_adaptive": ["algorithm_preset=gepo", "actor_rollout_ref.actor.policy_loss.loss_mode=gepo_adaptive"],
    "gepo_tr": ["algorithm_preset=gepo", "actor_rollout_ref.actor.policy_loss.loss_mode=gepo_tr"],
    "gmpo": ["algorithm_preset=gmpo"],
    "cispo": ["algorithm_preset=cispo"],
    "topr": ["algorithm_preset=topr"],
    "delta_l": ["algorithm_preset=delta_l"],
    "gepo_std": ["algorithm_preset=gepo", "algorithm.norm_adv_by_std_in_grpo=true"],
    "gepo_nokl": ["algorithm_preset=gepo", "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.0"],
    "grpo_nokl": ["algorithm_preset=grpo", "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.0"],
    # (the legacy sweep's grpo_tis was verl's dual-clip grpo + token TIS; its rows are table-only)
    # the frontier: the field's stale-data methods (verl's rollout-correction presets on top of grpo_paper)
    # and the project's variants built for it (docs/study.md section 6c)
    "grpo_tis": ["algorithm_preset=grpo_tis"],
    "grpo_seq_tis": ["algorithm_preset=grpo_seq_tis"],
    "grpo_icepop": ["algorithm_preset=grpo_icepop"],
    "grpo_seq_mis": ["algorithm_preset=grpo_seq_mis"],
    "decoupled_ppo": ["algorithm_preset=decoupled_ppo"],
    "m2po": ["algorithm_preset=m2po"],
    "vespo": ["algorithm_preset=vespo"],
    "gepo_tc": ["algorithm_preset=gepo_tc"],
    "gepo_tc_ess": ["algorithm_preset=gepo_tc_ess"],
}
#: the frontier methods added to the powered study (they join its rows file and its default methods)
FRONTIER_ALGOS = [
    "m2po",
    "vespo",
    "decoupled_ppo",
    "grpo_tis",
    "grpo_seq_tis",
    "grpo_icepop",
    "grpo_seq_mis",
    "gepo_tc",
    "gepo_tc_ess",
]
LEGACY_ALGOS = [
    "gepo",
    "gspo",
    "grpo",
    "dr_grpo",
    "bnpo",
    "gepo_adaptive",
    "gmpo",
    "cispo",
    "topr",
    "delta_l",
    "gepo_std",
    "gepo_nokl",
    "grpo_nokl",
    "grpo_tis",
]


@dataclass(frozen=True)
class TaskSpec:
    """One toy task of the sweep."""

    answer_format: str
    """``task.answer_format``."""
    max_len: int
    """``data.max_response_length`` (a correct answer plus room)."""


TASKS: dict[str, TaskSpec] = {
    "short": TaskSpec("short", 8),
    "long": TaskSpec("scratchpad", 24),
}


@dataclass
class Plan:
    """A sweep design; every field is a default of ``--design`` that a flag can replace."""

    tasks: list[str]
    algos: list[str]
    delays: list
    """staleness conditions: 0, ints (legacy log-normal caps), ``fix<k>``, ``uni<K>``, ``logn<K>``"""
    seeds: list[int]
    steps: int
    lr: float
    test_freq: int
    eval_size: int
    prompts: int
    diagnostics_every: int
    diagnostics_samples: int
    extra: list[str] = field(default_factory=list)
    warm_start_steps: int = 0
    """> 0: the pinned warm start of that many supervised steps (seed 0); 0: none the sweep can
    build -- the legacy design, whose accuracy-window warm start was machine-dependent and is gone,
    so its rows can be tabulated (``--table-only``) but not run."""
    warm_start_sha256: dict = field(default_factory=dict)
    """task -> the weights sha256 (:func:`verl_ext.data.toy.checkpoints.weights_sha256`) of the
    warm start the design's committed rows ran from; empty: whatever this machine builds. The same
    recipe gives other weights on another CPU (torch's CPU kernels sum in a CPU-dependent order,
    docs/study.md), so a pinned design runs only from a warm start with that hash (the package's
    shipped copy, or a build that matches), tabulates with the pin without building anything, and
    refuses to run from other weights."""
    last_evals: int = 0
    """a run's score (``lq_mean``): the mean of its last k evaluations; 0: of the evaluations at
    steps > 0.75 x steps (the legacy "last-quarter mean")."""
    lrs: dict = field(default_factory=dict)
    """algo -> pinned learning rate (overrides ``lr`` and the grid)."""
    lr_grid: list = field(default_factory=list)
    """stage 1: on-policy runs at each of these rates, the rule of
    :func:`research.study.analyse.choose_lrs` picks one."""
    lr_seeds: list = field(default_factory=list)
    """seeds of stage 1."""
    reference: str = "gepo"
    """the method every other one is compared with in the paired tables."""
    variants: list = field(default_factory=lambda: ["gepo_tr", "gepo_tc", "gepo_tc_ess"])
    """methods that also get a paired table against every other one (the project's variants:
    the study asks whether one beats every baseline), when the rows hold them."""
    lr_design: str = ""
    """take each method's rate from this design's stage 1 (its rows in the same rows file) instead
    of a stage 1 of its own: the long runs use the rates the 200-step study chose."""
    design: str = "legacy"

    def main_runs_per_task(self) -> int:
        """Stage-2 runs of one task: each method at its chosen rate, every condition and seed."""
        return len(self.algos) * len(self.delays) * len(self.seeds)


#: supervised steps of the pinned warm start (seed 0) of the designs that run
PINNED_WARM_START_STEPS = 210
#: the weights the powered study's 200-step rows ran from (built on the machines of the earlier
#: sessions; not shipped, and another CPU builds other weights: its rows are tabulated, its cells complete)
POWERED_WARM_START = "e0af1dc20b526b76d0f350bab56dc6cb972a5514438cc30cbbebc7b48d6c7552"
#: the weights every powered_long row runs from: the same recipe built on the machine of
#: 2026-11-25, where the one above could not be rebuilt; shipped with the package
#: (verl_ext.data.toy.checkpoints.PINNED_WARM_STARTS), so warm_start() returns it on any machine
POWERED_LONG_WARM_START = "8e41c3571dc7ea5e80fc02e1e01782d65dc2a5592dd1f6d71b964a24a80ef3f1"

#: the 252-run sweep of docs/results_data/legacy_results.md: table-only (no warm start to run it from)
LEGACY = dict(
    tasks=["long", "short"],
    algos=LEGACY_ALGOS,
    delays=[0, 8, 64],
    seeds=[0, 1, 2],
    steps=60,
    lr=1e-4,
    test_freq=10,
    eval_size=64,
    prompts=8,
    diagnostics_every=10,
    diagnostics_samples=8,
)
QUICK = dict(
    tasks=["long", "short"],
    algos=["gepo", "gspo", "grpo"],
    delays=[0, 64],
    seeds=[0],
    steps=16,
    lr=1e-4,
    test_freq=8,
    eval_size=32,
    prompts=4,
    diagnostics_every=8,
    diagnostics_samples=8,
    warm_start_steps=PINNED_WARM_START_STEPS,
    design="quick",
)
#: the powered study (docs/study.md): 16 prompts x G=8, 200 steps, 512 held-out problems every 20
#: steps, score = mean of the last 5 evaluations, 5 seeds, each method's rate chosen on-policy.
#: The first five methods and the frontier's nine (the methods are not part of the design id: rows of
#: either join one file). Cut to fit the budget (docs/study.md): verl's dual-clip grpo and
#: gepo_adaptive (--algos adds them).
POWERED = dict(
    tasks=["long"],
    algos=["gepo", "grpo_paper", "gspo_wide", "gepo_tr", "gspo", *FRONTIER_ALGOS],
    delays=[0, "fix4", "fix16", "fix64", "uni64", "logn64"],
    seeds=[0, 1, 2, 3, 4],
    steps=200,
    lr=1e-4,
    test_freq=20,
    eval_size=512,
    prompts=16,
    diagnostics_every=0,
    diagnostics_samples=8,
    warm_start_steps=PINNED_WARM_START_STEPS,
    warm_start_sha256={"long": POWERED_WARM_START},
    last_evals=5,
    lr_grid=[5e-5, 1e-4, 2e-4],
    lr_seeds=[0, 1, 2],
    design="powered",
)
#: the harsher condition of the frontier study: every batch 256 versions old needs runs longer than 256 steps,
#: so 600 steps (the last 344 at full staleness; the score is still the mean of the last 5 evaluations)
#: against an on-policy reference of the same length; rates from the powered design's stage 1
POWERED_LONG = dict(
    POWERED,
    delays=[0, "fix256"],
    steps=600,
    test_freq=40,
    lr_grid=[],
    lr_seeds=[],
    lr_design="powered",
    warm_start_sha256={"long": POWERED_LONG_WARM_START},
    design="powered_long",
)
#: the powered pipeline end to end in minutes: tiny settings, same stages and outputs
DRY = dict(
    POWERED,
    algos=["gepo", "grpo_paper", "gspo_wide"],
    delays=[0, "fix4", "uni8"],
    seeds=[0, 1, 2],
    steps=8,
    test_freq=2,
    eval_size=32,
    prompts=4,
    last_evals=2,
    lr_grid=[1e-4, 2e-4],
    lr_seeds=[0],
    warm_start_sha256={},
    design="dry",
)
DESIGNS = {"legacy": LEGACY, "quick": QUICK, "powered": POWERED, "powered_long": POWERED_LONG, "dry": DRY}
"""``powered``: the study (docs/study.md); ``powered_long``: its harsher ``fix256`` condition (600 steps, its own
on-policy reference, each method at the rate ``powered``'s stage 1 chose); ``dry``: its pipeline on tiny settings;
``quick``: a smoke test -- all from the warm start of 210 supervised steps, seed 0, pinned by hash for the first
two; ``legacy``: the 252-run sweep of docs/results_data/legacy_results.md, table-only (its accuracy-window warm
start was machine-dependent and is gone)."""

_COND = re.compile(r"^(fix|uni|logn)(\d+)$")


def parse_condition(label) -> tuple[str, int]:
    """``0`` -> ("on", 0); an int K -> ("logn", K); ``fix16`` -> ("fix", 16); ``uni64``; ``logn64``."""
    if isinstance(label, int) or (isinstance(label, str) and label.isdigit()):
        k = int(label)
        if k < 0:
            raise ValueError(f"staleness condition {label!r}: must be >= 0")
        return ("on", 0) if k == 0 else ("logn", k)
    m = _COND.match(str(label))
    if not m:
        raise ValueError(f"staleness condition {label!r}: expected 0, an int, fix<k>, uni<K> or logn<K>")
    kind, k = m.group(1), int(m.group(2))
    if k < 1:
        raise ValueError(f"staleness condition {label!r}: k must be >= 1 (use 0 for on-policy)")
    return kind, k


def normalize_condition(label):
    """Ints stay ints (0 and the legacy caps), the rest stays a validated str."""
    parse_condition(label)
    return int(label) if isinstance(label, int) or str(label).isdigit() else str(label)


def condition_key(label) -> tuple[int, int, str]:
    """Sort key of conditions: on-policy, then fixed, uniform and log-normal, each by k."""
    kind, k = parse_condition(label)
    return ({"on": 0, "fix": 1, "uni": 2, "logn": 3}[kind], k, str(label))


def condition_overrides(label) -> list[str]:
    """The ``hetero.delay`` / ``hetero.max_delay`` overrides of a staleness condition."""
    kind, k = parse_condition(label)
    if kind in ("on", "logn"):
        return ["hetero.delay.dist=lognormal", "hetero.delay.low=1", "hetero.delay.high=64", f"hetero.max_delay={k}"]
    if kind == "fix":
        return ["hetero.delay.dist=constant", f"hetero.delay.value={k}", f"hetero.max_delay={k}"]
    return [
        "hetero.delay.dist=uniform",
        "hetero.delay.low=0",
        f"hetero.delay.high={k}",
        "hetero.delay.integer=true",
        f"hetero.max_delay={k}",
    ]


def multi_lr(plan: Plan) -> bool:
    """Run directories carry the rate when a design tries or pins per-algorithm rates."""
    return bool(plan.lr_grid or plan.lrs)


def lrs_to_try(plan: Plan, algo: str, chosen: dict | None = None) -> list[float]:
    if algo in plan.lrs:
        return [float(plan.lrs[algo])]
    rates = [float(x) for x in plan.lr_grid] or [float(plan.lr)]
    if chosen and algo in chosen[1]:
        rates.append(chosen[1][algo])
    return sorted(set(rates))


def run_dir(out: Path, plan: Plan, task: str, algo: str, lr: float, delay, seed: int) -> Path:
    """``OUT/runs/<task>/<algo>[@<lr>]/d<condition>/s<seed>/`` (``metrics.jsonl``, ``config.yaml``, ``DONE`` with
    the run's seconds and its warm start's weight hash); ``@<lr>`` where the design tries several rates."""
    name = f"{algo}@{lr:g}" if multi_lr(plan) else algo
    return out / "runs" / task / name / f"d{delay}" / f"s{seed}"


def design_id(plan: Plan) -> str:
    """Hash of the settings a run's outcome depends on besides (task, algo, lr, condition, seed)."""
    keys = dict(
        steps=plan.steps,
        test_freq=plan.test_freq,
        eval_size=plan.eval_size,
        prompts=plan.prompts,
        diagnostics_every=plan.diagnostics_every,
        diagnostics_samples=plan.diagnostics_samples,
        extra=list(plan.extra),
        warm_start_steps=plan.warm_start_steps,
    )
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]


def run_overrides(
    plan: Plan, task: str, algo: str, delay, seed: int, model_path: str, run_dir: Path, lr: float | None = None
) -> list[str]:
    """The hydra overrides of one run (``recipe/gepo/config/gepo_trainer``): the algorithm, the
    condition, replay mode on the embedded engine, the warm start and the design's settings."""
    spec = TASKS[task]
    lr = plan.lr if lr is None else lr
    return (
        ALGOS[algo]
        + condition_overrides(delay)
        + [
            "hetero.engine=embedded",
            "hetero.mode=replay",
            f"hetero.seed={seed}",
            f"actor_rollout_ref.model.path={model_path}",
            f"actor_rollout_ref.actor.optim.lr={lr}",
            f"data.train_batch_size={plan.prompts}",
            f"data.max_response_length={spec.max_len}",
            f"trainer.total_training_steps={plan.steps}",
            f"trainer.test_freq={plan.test_freq}",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={run_dir}",
            f"task.eval_size={plan.eval_size}",
            f"task.answer_format={spec.answer_format}",
            f"task.diagnostics_every={plan.diagnostics_every}",
            f"task.diagnostics_samples={plan.diagnostics_samples}",
        ]
        + plan.extra
    )
