"""What ``hetero.trust`` costs the learner, and how soon it catches a sampler that starts lying.

    python -m scripts.bench.bench_trust overhead [--steps 60] [--repeats 2] [--fractions 0 0.25 1] [--out FILE]
    python -m scripts.bench.bench_trust detection [--trials 200] [--fractions 0.05 0.1 0.25 0.5 1] [--out FILE]
    python -m scripts.bench.bench_trust spread [--batches 20] [--out FILE]
    python -m scripts.bench.bench_trust ratio [--model toy|smollm2] [--prompts 8] [--out FILE]

``ratio``: in one process, one torch thread, the CPU time of each check per group against the CPU
time of the learner's ``train_step`` per group, on the same freshly generated groups: the cost of
``hetero.trust`` as a function of the fraction, cost(f) = (rewards + f x re-scoring) / training,
without the run-to-run noise of ``overhead``; for the toy model and for a real pretrained LM
(SmolLM2-135M-Instruct on cpu_smollm2_math's easy GSM8K problems, plain template), where a group's training is
much more than one call's overhead.

``spread``: the honest difference between a sampler's log-probs (the KV-cache sampler,
``verl_ext.sampling.generate``) and the learner's re-scoring of the same tokens (one full forward
pass), over ``--batches`` x 16 groups of the toy model, fp32 and with the weights rounded to bf16
on both sides (``hetero.weights_bf16``); and, for scale, how far one Adam-sized step on every
weight (lr 1e-5, 1e-4) moves the same groups' log-probs. ``hetero.trust.logprob_tolerance``'s
default comes from this.

``overhead``: async runs of ``bench_async.py``'s set-up (learner pinned to core 0, one sampler on
core 1, delay 0, toy addition, GEPO, 8 prompts x G=8), protections off (``sign_records=false
verify_fraction=0 check_rewards=false``) against protections on at each ``--fraction`` (rewards
always checked), repeated ``--repeats`` times in alternation. The cost: the CPU seconds the
learner's poll thread spent in checks (``perf/trust_check_cpu_s_total``) over the CPU seconds of
its ``train_step`` (``perf/train_cpu_s``), both thread CPU time within one run, so another
process's load does not enter them. The wall time per step is printed per run beside it (on two
shared cores it moves by ~10% from run to run, more than the effect).

``detection``: a sampler that passed its probation and then lies on every group (its log-probs
times 1.5, which every check catches), offered to the real :class:`TrustGate` with the toy model,
``--trials`` times per fraction: the lying groups that got into the buffer before the check that
quarantined it (each would be trained on if a step took it first; the quarantine purges those
still buffered), against the rule's expectation (1 - f) / f. Groups become seconds through the
sampler's rate of groups.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m scripts.bench.bench_trust ...")


def overhead(args) -> list[str]:
    from .bench_async import COMMON, TRUST_OFF, async_overrides, loadavg, run

    from verl_ext.rundir import read_metric_rows

    base = COMMON + [
        "hetero.learner_cpus=[0]",
        "hetero.sampler_cpus=[1]",
        f"trainer.total_training_steps={args.steps}",
        *async_overrides(0.0, 1),
    ]
    settings = {
        "off": TRUST_OFF,
        **{f"on, fraction {f:g}": [f"hetero.trust.verify_fraction={f}"] for f in args.fractions},
    }
    results: dict[str, list[dict]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, extra in settings.items():
                run_dir = Path(tmp) / f"{repeat}-{name.replace(' ', '_').replace(',', '')}"
                r = run(base + extra, run_dir, args.warmup)
                rows = [row for row in read_metric_rows(run_dir) if "perf/step_s" in row]
                r["check_cpu_s"] = float(rows[-1].get("perf/trust_check_cpu_s_total", 0.0))
                r["train_cpu_s"] = float(sum(row["perf/train_cpu_s"] for row in rows))
                r["checked"] = float(rows[-1].get("trust/checked", 0.0))
                r["rejected"] = float(rows[-1].get("hetero/rejected_total", 0.0))
                results[name].append(r)
                print(
                    f"[bench_trust] {name} run {repeat}: wall/step {r['wall_s'] / r['steps']:.3f} s, check CPU "
                    f"{r['check_cpu_s']:.2f} s / train CPU {r['train_cpu_s']:.2f} s, load {r['load']}",
                    flush=True,
                )
    lines = [
        f"{args.steps} learner steps (first {args.warmup} apart), learner on core 0, one sampler on core 1, "
        f"delay 0; {args.repeats} run(s) each, in alternation",
        "",
        "| protections | check CPU / train_step CPU (whole run) | wall s / step, each run | q re-scored "
        "| groups rejected | load before -> after, each run |",
        "|---|---:|---|---:|---:|---|",
    ]
    for name, rs in results.items():
        share = sum(r["check_cpu_s"] for r in rs) / sum(r["train_cpu_s"] for r in rs)
        walls = ", ".join(f"{r['wall_s'] / r['steps']:.3f}" for r in rs)
        loads = "; ".join(r["load"] for r in rs)
        lines.append(
            f"| {name} | {100 * share:.1f}% | {walls} | {np.mean([r['checked'] for r in rs]):.0f} "
            f"| {np.mean([r['rejected'] for r in rs]):.0f} | {loads} |"
        )
    lines.append(f"(machine load at the end: {loadavg()})")
    return lines


def detection(args) -> list[str]:
    import torch
    from hydra import compose, initialize_config_dir

    from recipe.gepo.embedded.driver import build_buffer
    from recipe.gepo.embedded.engine import EngineConfig
    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from recipe.gepo.embedded.verify import TrustGate
    from verl_ext.hetero.records import RecordRejected
    from verl_ext.hetero.weights import serialize_state_dict

    torch.set_num_threads(1)
    lines = [
        f"A sampler past its probation lies on every group (q x 1.5); {args.trials} trials per fraction, "
        "the real TrustGate and toy model",
        "",
        "| verify_fraction | lying groups admitted before quarantine: mean | median | 95th pct | max "
        "| expected (1-f)/f | check CPU ms / re-scored group |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with initialize_config_dir(config_dir=str(REPO / "recipe/gepo/config"), version_base=None):
        base = compose(config_name="gepo_trainer", overrides=["hetero.mode=async", "trainer.logger=[]"])
    model_path = resolve_model_path("", EngineConfig.from_omegaconf(base).task, 0)
    model, tokenizer = load_policy(model_path)
    model.eval()
    for fraction in args.fractions:
        with initialize_config_dir(config_dir=str(REPO / "recipe/gepo/config"), version_base=None):
            cfg = compose(
                config_name="gepo_trainer",
                overrides=[
                    "hetero.mode=async",
                    "trainer.logger=[]",
                    f"hetero.trust.verify_fraction={fraction}",
                    f"hetero.seed={int(fraction * 1000)}",
                    "hetero.max_delay=0",
                ],
            )
        engine = EngineConfig.from_omegaconf(cfg)
        task = Task(engine.task, 0)
        buffer = build_buffer(engine, task)
        gate = TrustGate(engine, model_path, task, buffer)
        gate.remember(0, serialize_state_dict(model.state_dict(), 0))
        s = engine.settings
        settings = RolloutSettings(s.group_size, s.temperature, s.max_new_tokens)
        pool = generate_groups(
            model,
            tokenizer,
            task.train_items(64, stream=3, index=0),
            task.score,
            settings,
            engine.algorithm,
            policy_version=0,
            sampler_id="x",
            seed=0,
            uid_prefix="pool",
        )
        admitted, counter = [], 0
        for trial in range(args.trials):
            sampler = f"sampler-{trial}"
            lying = 0
            while True:
                counter += 1
                group = pool[counter % len(pool)]
                honest = (
                    gate.ledger.samplers.get(sampler) is None
                    or gate.ledger.samplers[sampler].checks < engine.hetero.trust.probation_groups
                )
                edited = type(group)(
                    **{
                        **group.__dict__,
                        "group_uid": f"{sampler}-g{counter}",
                        "sampler_id": sampler,
                        "sampler_logprobs": group.sampler_logprobs * (1.0 if honest else 1.5),
                    }
                )
                gate._contents.clear()  # the pool is reused: replays are not what this measures
                try:
                    vouched = gate.admit(edited)
                    gate.accepted(edited, vouched)  # (not added to the buffer: only the gate's verdicts are counted)
                    lying += not honest
                except RecordRejected:
                    break
            admitted.append(lying)
        checked = gate.ledger.counts["checked"]
        ms = 1000 * gate.check_cpu_s / max(checked, 1)
        a = np.asarray(admitted)
        expected = (1 - fraction) / fraction
        lines.append(
            f"| {fraction:g} | {a.mean():.2f} | {np.median(a):.0f} | {np.percentile(a, 95):.0f} | {a.max()} "
            f"| {expected:.2f} | {ms:.1f} |"
        )
        print(lines[-1], flush=True)
    return lines


def spread(args) -> list[str]:
    import torch
    from omegaconf import OmegaConf

    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from recipe.gepo.embedded.verify import group_log_probs
    from recipe.gepo.sections import TaskConfig

    torch.set_num_threads(1)
    task_config = TaskConfig()
    path = resolve_model_path("", task_config, 0)
    task = Task(task_config, 0)
    algorithm = OmegaConf.create({"adv_estimator": "grpo"})

    def worst(model, groups):
        return [
            float(np.abs(group_log_probs(model, g, 1.0) - g.sampler_logprobs)[g.response_mask.astype(bool)].max())
            for g in groups
        ]

    lines = [
        f"{args.batches} x 16 groups of G=8 (toy addition, 3 digits, T=1); per group the largest |log q sampler "
        "- log q re-scored| over its tokens",
        "",
        "| weights | max over groups | median | 99th pct |",
        "|---|---:|---:|---:|",
    ]
    fp32_groups: list = []
    for label, rounding in (("fp32", False), ("bf16 on the wire (both sides)", True)):
        sampler, tokenizer = load_policy(path)
        if rounding:
            sampler.load_state_dict({k: v.to(torch.bfloat16).to(v.dtype) for k, v in sampler.state_dict().items()})
        sampler.eval()
        scorer, _ = load_policy(path)
        scorer.load_state_dict(sampler.state_dict())
        scorer.eval()
        groups = []
        for b in range(args.batches):
            groups += generate_groups(
                sampler,
                tokenizer,
                task.train_items(16, stream=1, index=b),
                task.score,
                RolloutSettings(8, 1.0, 16),
                algorithm,
                0,
                "s",
                seed=b,
                uid_prefix=f"b{b}",
            )
        honest = np.asarray(worst(scorer, groups))
        fp32_groups = groups if not rounding else fp32_groups
        lines.append(f"| {label} | {honest.max():.2g} | {np.median(honest):.2g} | {np.percentile(honest, 99):.2g} |")
    lines += ["", "| one step of size lr on every weight | min over groups | median | max |", "|---|---:|---:|---:|"]
    for lr in (1e-5, 1e-4):
        other, _ = load_policy(path)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(lr * torch.sign(torch.randn_like(p)))
        other.eval()
        drift = np.asarray(worst(other, fp32_groups))  # against the fp32 sampler's groups
        lines.append(f"| {lr:g} | {drift.min():.2g} | {np.median(drift):.2g} | {drift.max():.2g} |")
    return lines


# SmolLM2-135M-Instruct on a few short GSM8K problems, G=4 (bench_precision.py measures on the same task)
SMOLLM2_TASK = [
    "task.name=math",
    "task.model=smollm2-135m-instruct",
    "task.dataset=gsm8k",
    "task.template=plain",
    "+task.dataset_options.split=train",
    "+task.dataset_options.max_steps=2",
    "+task.dataset_options.max_answer=100",
    "+task.dataset_options.max_question_chars=200",
    "task.eval_dataset=gsm8k",
    "task.eval_size=4",
    "actor_rollout_ref.rollout.n=4",
]

RATIO_MODELS = {
    "toy": [],
    "smollm2": [
        *SMOLLM2_TASK,
        "data.max_response_length=128",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.actor.optim.lr=1e-5",
    ],
}
"""``ratio --model``: the task overrides (smollm2: cpu_smollm2_math's task, G and lengths)."""


def ratio(args) -> list[str]:
    import time

    import torch
    from hydra import compose, initialize_config_dir

    from recipe.gepo.embedded.driver import build_buffer, build_learner
    from recipe.gepo.embedded.engine import EngineConfig
    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from recipe.gepo.embedded.verify import TrustGate
    from verl_ext.hetero.weights import serialize_state_dict

    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(REPO / "recipe/gepo/config"), version_base=None):
        cfg = compose(
            config_name="gepo_trainer",
            overrides=[
                "hetero.mode=async",
                "trainer.logger=[]",
                f"data.train_batch_size={args.prompts}",
                *RATIO_MODELS[args.model],
            ],
        )
    engine = EngineConfig.from_omegaconf(cfg)
    task = Task(engine.task, 0)
    path = resolve_model_path(engine.settings.model_path, engine.task, 0)
    model, tokenizer = load_policy(path)
    gate = TrustGate(engine, path, task, build_buffer(engine, task))
    gate.remember(0, serialize_state_dict(model.state_dict(), 0))
    s = engine.settings
    model.eval()
    t0 = time.perf_counter()
    groups = generate_groups(
        model,
        tokenizer,
        task.train_items(args.prompts, stream=1, index=0),
        task.score,
        RolloutSettings(s.group_size, s.temperature, s.max_new_tokens),
        engine.algorithm,
        policy_version=0,
        sampler_id="x",
        seed=0,
        uid_prefix="r",
    )
    gen_s = time.perf_counter() - t0
    tokens = sum(int(g.response_mask.sum()) for g in groups)

    def cpu(fn) -> float:
        start = time.thread_time()
        fn()
        return time.thread_time() - start

    verifier = gate.verifier
    rewards = cpu(lambda: [verifier.check_group_rewards(g) for g in groups]) / len(groups)
    verifier.rescore(groups[0])  # the version's weights decoded and loaded once (a check of a new version pays it)
    rescore = cpu(lambda: [verifier.check_logprobs(g) for g in groups]) / len(groups)
    verifier._loaded = None
    with verifier._lock:
        load = cpu(lambda: verifier._load(0))
    learner = build_learner(model, tokenizer.pad_token_id, engine)
    learner.train_step(groups)  # first step: optimizer state allocated
    train = cpu(lambda: learner.train_step(groups)) / len(groups)
    share = lambda f: 100 * (rewards + f * rescore) / train  # noqa: E731
    lines = [
        f"{args.model}: {args.prompts} groups of G={s.group_size}, {tokens} response tokens "
        f"({tokens / len(groups) / s.group_size:.0f} per response; generated in {gen_s:.0f} s), one torch thread",
        "",
        "| CPU ms per group | train_step | rewards check | re-scoring | loading a version's weights (once per version) |",
        "|---|---:|---:|---:|---:|",
        f"| {args.model} | {1000 * train:.1f} | {1000 * rewards:.2f} | {1000 * rescore:.1f} | {1000 * load:.1f} |",
        "",
        "| verify_fraction | 0 | 0.05 | 0.1 | 0.25 | 1 |",
        "|---|---:|---:|---:|---:|---:|",
        f"| cost, % of training CPU | {share(0):.1f} | {share(0.05):.1f} | {share(0.1):.1f} | {share(0.25):.1f} "
        f"| {share(1):.1f} |",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="part", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--steps", type=int, default=60)
    o.add_argument("--warmup", type=int, default=5)
    o.add_argument("--repeats", type=int, default=2)
    o.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 1.0])
    d = sub.add_parser("detection")
    d.add_argument("--trials", type=int, default=200)
    d.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5, 1.0])
    sp = sub.add_parser("spread")
    sp.add_argument("--batches", type=int, default=20)
    ra = sub.add_parser("ratio")
    ra.add_argument("--model", choices=sorted(RATIO_MODELS), default="toy")
    ra.add_argument("--prompts", type=int, default=8)
    for p in (o, d, sp, ra):
        p.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from .bench_async import emit, loadavg

    part = {"overhead": overhead, "detection": detection, "spread": spread, "ratio": ratio}[args.part]
    emit([f"(load at the start: {loadavg()})", *part(args)], args.out)


if __name__ == "__main__":
    main()
