"""What ``hetero.trust`` costs the learner, and how soon it catches a sampler that starts lying.

    python -m research.bench.bench_trust overhead [--steps 60] [--repeats 2] [--fractions 0 0.25 1] [--out FILE]
    python -m research.bench.bench_trust detection [--trials 200] [--fractions 0.05 0.1 0.25 0.5 1] [--out FILE]
    python -m research.bench.bench_trust spread [--batches 20] [--out FILE]
    python -m research.bench.bench_trust ratio [--model toy|smollm2] [--prompts 8] [--checkable] [--out FILE]
    python -m research.bench.bench_trust components [--steps 40] [--lag 2] [--fraction 0.1] [--checkable] [--out FILE]
    python -m research.bench.bench_trust checker-latency [--model toy|smollm2] [--repeats 20] [--out FILE]
    python -m research.bench.bench_trust detection-table [--model toy|smollm2] [--setups fp32 bf16-on-fp32 bf16] [--trials 20]
        [--bounds SETUP=FILE ...] [--lies KIND ...]

Each subcommand is the function of its name (``bench_trust <name> --help`` prints what it measures);
their results are in docs/reliability.md and docs/benchmarks.md. The lies of ``detection-table`` are
``research/soak/lies.py``'s, the ones the soak's liars tell.
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m research.bench.bench_trust ...")


def overhead(args) -> list[str]:
    """Async runs of ``bench_async.py``'s set-up (learner pinned to core 0, one sampler on core 1,
    delay 0, toy addition, GEPO, 8 prompts x G=8), protections off (``sign_records=false
    verify_fraction=0 check_rewards=false``) against protections on at each ``--fraction`` (rewards
    always checked), repeated ``--repeats`` times in alternation. The cost: the CPU seconds the
    learner's poll thread spent in checks (``perf/trust_check_cpu_s_total``) over the CPU seconds of
    its ``train_step`` (``perf/train_cpu_s``), both thread CPU time within one run, so another
    process's load does not enter them; the wall time per step is printed per run beside it."""
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
    """A sampler that passed its probation and then lies on every group (its log-probs times 1.5,
    which every check catches), offered to the real :class:`TrustGate` with the toy model,
    ``--trials`` times per fraction: the lying groups that got into the buffer before the check that
    quarantined it (each would be trained on if a step took it first; the quarantine purges those
    still buffered), against the rule's expectation (1 - f) / f. Groups become seconds through the
    sampler's rate of groups."""
    import torch
    from hydra import compose, initialize_config_dir

    from recipe.gepo.embedded.loop import build_buffer
    from recipe.gepo.embedded.engine_config import EngineConfig
    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from recipe.gepo.embedded.trust_wiring import embedded_gate
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
        gate = embedded_gate(engine, model_path, task, buffer)
        measure_rescores_only(gate)
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
    """The honest difference between a sampler's log-probs (the KV-cache sampler,
    ``verl_ext.sampling.generate``) and the learner's re-scoring of the same tokens (one full forward
    pass), over ``--batches`` x 16 groups of the toy model, fp32 and with the weights rounded to bf16
    on both sides (``hetero.weights_bf16``); and, for scale, how far one Adam-sized step on every
    weight (lr 1e-5, 1e-4) moves the same groups' log-probs. ``hetero.trust.logprob_tolerance``'s
    default comes from this."""
    import torch
    from omegaconf import OmegaConf

    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from verl_ext.trust.verifier import group_log_probs
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
    """In one process, one torch thread, the CPU time of each check per group against the CPU time of
    the learner's ``train_step`` per group, on the same freshly generated groups: the cost of
    ``hetero.trust`` as a function of the fraction, cost(f) = (rewards + f x re-scoring) / training,
    without the run-to-run noise of ``overhead``; for the toy model and for a real pretrained LM
    (SmolLM2-135M-Instruct on cpu_smollm2_math's easy GSM8K problems, plain template), where a
    group's training is much more than one call's overhead."""
    import time

    import torch
    from hydra import compose, initialize_config_dir

    from recipe.gepo.embedded.loop import build_buffer, build_learner
    from recipe.gepo.embedded.engine_config import EngineConfig
    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from recipe.gepo.embedded.trust_wiring import embedded_gate
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
                *(["hetero.trust.checkable_sampling=true"] if args.checkable else []),
            ],
        )
    engine = EngineConfig.from_omegaconf(cfg)
    task = Task(engine.task, 0)
    path = resolve_model_path(engine.settings.model_path, engine.task, 0)
    model, tokenizer = load_policy(path)
    gate = embedded_gate(engine, path, task, build_buffer(engine, task))
    measure_rescores_only(gate)
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
        checkable=args.checkable,
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
        f"({tokens / len(groups) / s.group_size:.0f} per response; generated in {gen_s:.0f} s), one torch thread; "
        f"checkable sampling {'on (the re-scoring includes the token check)' if args.checkable else 'off'}",
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


COMPONENTS = (
    ("signature (Ed25519, the inbox against the enrolment)", "signature"),
    ("content digest (replay books; begin and accepted)", "digest"),
    ("books (ledger, quarantine, draw, awaiting; admit's glue)", "books"),
    ("rewards: prompt decode + re-encode", "prompt_text"),
    ("rewards: responses decoded", "batch_decode"),
    ("rewards: task scoring + comparison", "scoring"),
    ("advantages recomputed", "advantages"),
    ("re-score: a version's weights decoded + loaded", "load"),
    ("re-score: forward + comparison", "forward"),
    ("token check", "token_check"),
    ("CUSUM", "cusum"),
)
"""``components``' rows: (label, counter); every row is thread CPU time inside the gate's code path
of a run with trust on (the record's decoding and validation happen with trust off too: apart)."""


def components(args) -> list[str]:
    """Where the gate's CPU goes per group: honest groups of one sampler, signed and sent as bytes,
    pass the inbox's path (signature, decode, validation, :meth:`TrustGate.admit`,
    :meth:`TrustGate.accepted`) under ``bench_async``'s async settings and trust defaults, while a
    real learner trains on them and publishes a new version every step (the sampler ``--lag``
    versions behind, as a run's staleness of ~2): each re-score then usually needs a version the
    scorer does not hold yet, as in a run. The gate's own functions are wrapped with thread-CPU
    timers (instance attributes and ``verify``'s module names: the code path is the gate's)."""
    import collections
    import time

    import torch
    from hydra import compose, initialize_config_dir

    from .bench_async import COMMON, async_overrides
    from recipe.gepo.embedded.trust_wiring import embedded_gate
    from recipe.gepo.embedded.loop import build_buffer, build_learner
    from recipe.gepo.embedded.engine_config import EngineConfig
    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task, resolve_model_path
    from verl_ext.trust.assignment import gumbel_key
    from verl_ext.trust.signing import SamplerKey
    from verl_ext.hetero.records import RecordRejected, RolloutGroup, validate_group
    from verl_ext.hetero.weights import deserialize_state_dict, serialize_state_dict

    torch.set_num_threads(1)
    overrides = [
        *COMMON,
        *async_overrides(0.0, 1),
        "trainer.logger=[]",
        f"hetero.trust.verify_fraction={args.fraction}",
        *(["hetero.trust.checkable_sampling=true"] if args.checkable else []),
    ]
    with initialize_config_dir(config_dir=str(REPO / "recipe/gepo/config"), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=overrides)
    engine = EngineConfig.from_omegaconf(cfg)
    task = Task(engine.task, 0)
    path = resolve_model_path(engine.settings.model_path, engine.task, 0)
    model, tokenizer = load_policy(path)
    sampler, _ = load_policy(path)
    sampler.eval()
    buffer = build_buffer(engine, task)
    gate = embedded_gate(engine, path, task, buffer)
    learner = build_learner(model, tokenizer.pad_token_id, engine)
    key = SamplerKey.generate("sampler-0")  # sampler-0: its batches' prompts are stream 1's
    gate.enrol("sampler-0", key.public_hex())
    wire = "bf16" if engine.hetero.weights_bf16 else None
    messages = {0: serialize_state_dict(model.state_dict(), 0, wire)}
    gate.remember(0, messages[0])

    spent: collections.Counter = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.thread_time() - start

        return wrapper

    verifier = gate.verifier
    for name in ("check_group_rewards", "_prompt_text", "measure_logprobs", "_load", "token_failure"):
        setattr(verifier, name, timed(name, getattr(verifier, name)))
    verifier.tokenizer.batch_decode = timed("batch_decode", verifier.tokenizer.batch_decode)
    gate.cusum.add = timed("cusum", gate.cusum.add)
    from verl_ext.trust import gate as gate_module, verifier as verifier_module

    patched = [(gate_module, "content_digest"), (verifier_module, "sequence_advantages")]
    originals = [(module, name, getattr(module, name)) for module, name in patched]
    for module, name, fn in originals:
        setattr(module, name, timed(name, fn))
    s = engine.settings
    settings = RolloutSettings(s.group_size, s.temperature, s.max_new_tokens)
    groups_n, rescored, train_cpu, refused = 0, 0, 0.0, collections.Counter()
    try:
        for step in range(args.steps):
            claimed = max(0, step - args.lag)
            sampler.load_state_dict(deserialize_state_dict(messages[claimed])[1])
            groups = generate_groups(
                sampler,
                tokenizer,
                task.train_items(engine.settings.prompts_per_step, stream=1, index=step),
                task.score,
                settings,
                engine.algorithm,
                policy_version=claimed,
                sampler_id="sampler-0",
                seed=step,
                uid_prefix=f"s0-{step}",
                checkable=args.checkable,
                batch_index=step,  # the learner's assignment: batch `step` of sampler-0
                gumbel_key=gumbel_key(gate.ledger.secret) if args.checkable else None,
            )
            admitted = []
            for sent in groups:
                data = key.seal(sent.to_bytes())
                t0 = time.thread_time()
                _, record = gate.enrolment.open(data, sent.group_uid)
                t1 = time.thread_time()
                group = RolloutGroup.from_bytes(record)
                validate_group(group, buffer.spec, learner_version=buffer.learner_version)
                t2 = time.thread_time()
                try:
                    vouched = gate.admit(group)
                    gate.accepted(group, vouched)
                    admitted.append(group)
                    rescored += bool(vouched)
                except RecordRejected as refusal:
                    refused[refusal.reason] += 1
                t3 = time.thread_time()
                spent["signature"] += t1 - t0
                spent["record"] += t2 - t1
                spent["gate"] += t3 - t2
                groups_n += 1
            start = time.thread_time()
            learner.train_step(admitted or groups)
            train_cpu += time.thread_time() - start if step else 0.0  # the first allocates the optimizer state
            buffer.set_learner_version(step + 1)
            messages[step + 1] = serialize_state_dict(model.state_dict(), step + 1, wire)
            gate.remember(step + 1, messages[step + 1])
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    rewards = spent["check_group_rewards"]
    part = {
        "signature": spent["signature"],
        "digest": spent["content_digest"],
        "prompt_text": spent["_prompt_text"],
        "batch_decode": spent["batch_decode"],
        "advantages": spent["sequence_advantages"],
        "scoring": rewards - spent["_prompt_text"] - spent["batch_decode"] - spent["sequence_advantages"],
        "load": spent["_load"],
        "forward": spent["measure_logprobs"] - spent["_load"] - spent["token_failure"],
        "token_check": spent["token_failure"],
        "cusum": spent["cusum"],
    }
    part["books"] = spent["gate"] - rewards - spent["measure_logprobs"] - spent["content_digest"] - spent["cusum"]
    total = sum(part.values())
    per_step_groups = groups_n / max(args.steps, 1)
    train_per_group = train_cpu / max((args.steps - 1) * per_step_groups, 1)
    lines = [
        f"toy model, bench_async's async settings, {args.steps} learner steps x {per_step_groups:.0f} groups of "
        f"G={s.group_size} from one sampler {args.lag} versions behind (a new version every step), verify_fraction "
        f"{args.fraction:g}, checkable sampling {'on' if args.checkable else 'off'}, one torch thread; "
        f"{groups_n} groups through the gate, {rescored} re-scored and vouched for (probation included), "
        f"refused: {dict(refused) or 'none'}",
        "",
        "| component | CPU ms / group | share of the gate |",
        "|---|---:|---:|",
    ]
    for label, name in COMPONENTS:
        lines.append(f"| {label} | {1000 * part[name] / groups_n:.3f} | {100 * part[name] / total:.1f}% |")
    lines += [
        f"| **the gate, all** | **{1000 * total / groups_n:.3f}** | 100% |",
        f"| (record decoded + validated: also with trust off) | {1000 * spent['record'] / groups_n:.3f} | - |",
        f"| (learner train_step, for scale) | {1000 * train_per_group:.2f} | "
        f"gate = {100 * total / groups_n / train_per_group:.1f}% of it |",
    ]
    kept = getattr(verifier, "_advantages", None)
    if kept is not None:
        lines.append(f"(advantages: {len(kept)} distinct (rewards, mask) inputs among {groups_n} groups)")
    return lines


def checker_latency(args) -> list[str]:
    """A verdict's round trip to a real :class:`~recipe.gepo.embedded.checker.TrustChecker` (a Ray
    actor at nice 10 on the system core, as in a run): one group re-scored under its version and
    its rewards checked, per call, as the learner's :class:`OffloadedChecks` sends it. Three
    conditions: the system core idle; a nice-0 busy process held to it (a stand-in for a sampler
    generating there, as in ``bench_async``'s two-core set-up); and the same with the learner's core
    lent to the checker first (``lend_cores``, what a learner blocked on verdicts does; the lend's
    own round trip is reported apart)."""
    import os
    import statistics
    import subprocess
    import sys
    import time

    import ray

    from recipe.gepo.embedded.checker import CHECKER_NICE, launch_checker

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("checker-latency needs two cores: the learner's and a system core")
    learner_core, system_core = cores[:2]
    os.sched_setaffinity(0, [learner_core])  # this process is the learner's side
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    lab = _Lab(
        args.model,
        "fp32",
        None,
        seed=0,
        overrides=[
            f"hetero.learner_cpus=[{learner_core}]",
            f"hetero.system_cpus=[{system_core}]",
            f"hetero.trust.checkable_sampling={str(args.checkable).lower()}",  # the run's default: off
        ],
    )
    checker = launch_checker(lab.engine, lab.path)
    where = ray.get(checker.describe.remote())
    assert where["nice"] == [CHECKER_NICE] and where["cpus"] == [[system_core]], where
    weights = {0: [ray.put(np.frombuffer(lab.publish(0), dtype=np.uint8))]}
    groups = lab.assigned_groups(args.prompts, "sampler-2")  # the checker holds groups to their assignment
    ray.get(checker.check.remote([(groups[0], True, True, False)], weights))  # warm: version 0 loaded

    def round_trips(lend: bool) -> tuple[list[float], list[float]]:
        checks, lends = [], []
        for i in range(args.repeats):
            if lend:
                t = time.perf_counter()
                ray.get(checker.lend_cores.remote([learner_core]))
                lends.append(time.perf_counter() - t)
            t = time.perf_counter()
            ray.get(checker.check.remote([(groups[i % len(groups)], True, True, False)], weights))
            checks.append(time.perf_counter() - t)
            if lend:
                ray.get(checker.lend_cores.remote([]))
            time.sleep(0.02)
        return checks, lends

    def busy_system_core() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", f"import os; os.sched_setaffinity(0, [{system_core}])\nwhile True: pass"]
        )

    def summary(seconds: list[float]) -> str:
        ms = [1000 * x for x in seconds]
        return f"{statistics.median(ms):.1f} | {min(ms):.1f} - {max(ms):.1f}"

    rows = [("system core idle", *round_trips(False))]
    hog = busy_system_core()
    try:
        time.sleep(1.0)
        rows.append(("a nice-0 process busy on the system core", *round_trips(False)))
        rows.append(("the same, the learner's core lent first", *round_trips(True)))
    finally:
        hog.kill()
        ray.shutdown()
    tokens = int(sum(int(g.response_mask.sum()) for g in groups[: args.repeats]))
    lines = [
        f"A verdict's round trip, one group a call (re-scored under its version, rewards checked"
        f"{', tokens checked' if args.checkable else ''}): "
        f"{args.model}, G={lab.engine.settings.group_size}, {args.repeats} calls per condition over "
        f"{min(args.repeats, len(groups))} groups ({tokens} response tokens); learner's side on core "
        f"{learner_core}, checker at nice {CHECKER_NICE} on core {system_core}",
        "",
        "| condition | round trip ms, median | min - max | the lend's own round trip ms, median |",
        "|---|---:|---:|---:|",
    ]
    for name, checks, lends in rows:
        lend = f"{1000 * statistics.median(lends):.1f}" if lends else "-"
        lines.append(f"| {name} | {summary(checks)} | {lend} |")
    return lines


DETECTION_MODELS = {
    "toy": [],
    "smollm2": [*SMOLLM2_TASK, "data.max_response_length=32"],
}
"""``detection-table --model``: the task overrides (smollm2: bench_precision's task and lengths)."""

TABLE_LIES = (
    ("q x 1.5", "scaled", 1.5),
    ("q x 1.05", "scaled", 1.05),
    ("q x 1.02", "scaled", 1.02),
    ("q x 1.01", "scaled", 1.01),
    ("q at T=0.9, drawn at 1.0", "temperature", 0.9),
    ("q at T=0.95, drawn at 1.0", "temperature", 0.95),
    ("drawn from other weights (each weight +-1e-3), q true to its tokens", "other_weights", 1e-3),
    ("drawn from other weights (each weight +-1e-4), q true to its tokens", "other_weights", 1e-4),
    ("drawn from top-k 2, q true to its tokens", "top_k", 2),
    ("drawn from top-p 0.9, q true to its tokens", "top_p", 0.9),
    ("q x 1.5 claiming the version being published (its weights reach the gate 20 ms after the group)", "bump", 1.5),
    ("near copy of an accepted group (rows rotated, one log q + 1e-5)", "near_copy", None),
)
"""``detection-table``'s lies: (row label, kind, size); every kind but ``bump`` and ``near_copy``
is a function of ``research/soak/lies.py`` applied to an honest group."""


DETECTION_SETUPS = {
    "fp32": ("fp32", "fp32"),
    "bf16-on-fp32": ("bf16", "fp32"),
    "bf16": ("bf16", "bf16"),
}
"""``detection-table --setups``: name -> (the sampler's precision, ``hetero.sampler_precision`` of the
learner, whose gate re-scores in it). ``bf16-on-fp32``: a bf16 sampler (vLLM's default) declaring
bf16 to a learner of the default fp32 config (the soak's honest bf16 sampler); ``bf16``: samplers and
scorer in bf16, the same CPU arithmetic on both sides."""


class _Lab:
    """One learner's trust gate (checkable sampling on, the run's other trust defaults, its scorer in
    the set-up's ``hetero.sampler_precision``) and one honest sampler in the set-up's precision, of the
    engine's own loading, with the weights of version 0 as the learner publishes them."""

    def __init__(self, model_name: str, setup: str, fraction, seed: int, bounds_file: str = "", overrides=()):
        import dataclasses

        from hydra import compose, initialize_config_dir

        from recipe.gepo.embedded.loop import build_buffer
        from recipe.gepo.embedded.engine_config import EngineConfig
        from recipe.gepo.embedded.model_placement import Placement
        from recipe.gepo.embedded.policy import load_policy
        from recipe.gepo.embedded.tasks import Task, resolve_model_path
        from recipe.gepo.embedded.trust_wiring import embedded_gate
        from verl_ext.hetero.weights import deserialize_state_dict, serialize_state_dict

        overrides = [
            "hetero.mode=async",
            "trainer.logger=[]",
            "hetero.trust.checkable_sampling=true",
            f"hetero.sampler_precision={DETECTION_SETUPS[setup][1]}",
            f"hetero.seed={seed}",
            f"hetero.trust.bounds_file={bounds_file or 'table'}",  # "": the table's bounds, on purpose
            *DETECTION_MODELS[model_name],
            *overrides,
        ]
        if fraction is not None:
            overrides.append(f"hetero.trust.verify_fraction={fraction}")
        with initialize_config_dir(config_dir=str(REPO / "recipe/gepo/config"), version_base=None):
            cfg = compose(config_name="gepo_trainer", overrides=overrides)
        self.engine = engine = EngineConfig.from_omegaconf(cfg)
        self.task = Task(engine.task, 0)
        self.path = resolve_model_path(engine.settings.model_path, engine.task, 0)
        self.learner, self.tokenizer = load_policy(self.path)
        self.learner.eval()
        self.gate = embedded_gate(engine, self.path, self.task, build_buffer(engine, self.task))
        measure_rescores_only(self.gate)
        self.gate.version_wait_s = 5.0
        self.wire = "bf16" if engine.hetero.weights_bf16 else None
        self.serialize = serialize_state_dict
        message = serialize_state_dict(self.learner.state_dict(), 0, self.wire)
        self.gate.remember(0, message)
        self.newest = 0
        self.placement = dataclasses.replace(Placement.of(engine.hetero), sampler_precision=DETECTION_SETUPS[setup][0])
        self.sampler, _ = self.placement.load_sampler(self.path)
        self.sampler.load_state_dict(deserialize_state_dict(message)[1])
        self.sampler.eval()

    def groups(self, n: int, stream: int, index: int, sampler_id: str = "x", model=None) -> list:
        """``n`` groups of batch ``index`` of prompt stream ``stream`` (not an assignment: the lab's
        gate does not check one, :func:`measure_rescores_only`)."""
        from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups

        s = self.engine.settings
        return generate_groups(
            model or self.sampler,
            self.tokenizer,
            self.task.train_items(n, stream=stream, index=index),
            self.task.score,
            RolloutSettings(s.group_size, s.temperature, s.max_new_tokens),
            self.engine.algorithm,
            policy_version=0,
            sampler_id=sampler_id,
            seed=1000 * stream + index,
            uid_prefix=f"{sampler_id}-{stream}-{index}",
            checkable=True,
        )

    def assigned_groups(self, n: int, sampler_id: str) -> list:
        """``n`` groups of the prompts the learner assigns ``sampler_id`` (its batches from 0, a
        batch's prompts at a time), for a checker that holds groups to their assignment."""
        from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
        from verl_ext.trust.assignment import prompt_stream

        s, groups, batch = self.engine.settings, [], 0
        while len(groups) < n:
            items = self.task.train_items(s.prompts_per_step, stream=prompt_stream(sampler_id), index=batch)
            groups += generate_groups(
                self.sampler, self.tokenizer, items[: n - len(groups)], self.task.score,
                RolloutSettings(s.group_size, s.temperature, s.max_new_tokens), self.engine.algorithm,
                policy_version=0, sampler_id=sampler_id, seed=batch, uid_prefix=f"{sampler_id}-b{batch}",
                checkable=True, batch_index=batch,
            )  # fmt: skip
            batch += 1
        return groups

    def drawer(self, weight_step: float = 0.0):
        """A second sampler model of the same loading (its own object: a truncation hook on it
        leaves the honest one alone), every weight moved by +-``weight_step`` (in fp32, then
        rounded to the sampler's precision as its loading does)."""
        import torch

        state = {k: v.float().clone() for k, v in self.learner.state_dict().items()}
        if weight_step:
            generator = torch.Generator().manual_seed(7)
            for v in state.values():
                if v.is_floating_point():
                    v.add_(weight_step * torch.sign(torch.randn(v.shape, generator=generator)))
        model, _ = self.placement.load_sampler(self.path)
        model.load_state_dict(state)
        return model.eval()

    def publish(self, version: int) -> bytes:
        """Version ``version``: the same weights under a new number (the weight store's message)."""
        return self.serialize(self.learner.state_dict(), version, self.wire)


def _lie_maker(lab: "_Lab", kind: str, size):
    """A function honest group -> lying group for ``kind`` (see :data:`TABLE_LIES`)."""
    import contextlib

    from ..soak import lies

    s = lab.engine.settings
    if kind in ("scaled", "bump"):
        return lambda g: lies.scaled_q(g, size)
    if kind == "temperature":
        return lambda g: lies.q_at_temperature(g, lab.sampler, size)
    drawer = lab.drawer(size if kind == "other_weights" else 0.0)
    truncation = {"top_k": dict(top_k=int(size)), "top_p": dict(top_p=float(size))}.get(kind)

    def redraw(g):
        with lies.truncated(drawer, **truncation) if truncation else contextlib.nullcontext():
            return lies.redrawn(
                g,
                drawer,
                lab.sampler,
                lab.tokenizer,
                lab.task.score,
                s.temperature,
                s.max_new_tokens,
                lab.engine.algorithm,
            )

    return redraw


def measure_rescores_only(gate) -> None:
    """Turn off the assignment of prompts, seeds and slots (``verl_ext.trust.assignment``) on a
    bench's gate: it offers one pool of groups under many sampler ids and slots, and measures the
    re-score and rewards checks, which the assignment would pre-empt on every such group."""
    gate.check_assignment = False
    if gate.verifier is not None:
        gate.verifier.check_assignment = False


def _lying_trial(lab: "_Lab", sampler: str, pool: list, start: int, lie, bump: bool, cap: int):
    """A sampler that passes its probation honestly, then lies on every group (``lie`` of the
    pool's next group) until the gate refuses one: (lying groups admitted before that, the reason
    it gave or None when ``cap`` were admitted, a probation group's refusal reason or None, groups
    used, lying groups a check passed, lying groups vouched for). Vouched for: what a learner with
    ``hetero.trust.hold_unchecked`` may take, the lies a passed check came after (its own or a
    later lie's; in arrival order, as the gate releases them); the rest are purged at the quarantine."""
    import dataclasses
    import threading

    from verl_ext.hetero.records import RecordRejected

    gate, probation = lab.gate, lab.engine.hetero.trust.probation_groups
    measure_rescores_only(gate)
    admitted, used, timer, vouched_lies, released, withheld = 0, 0, None, 0, 0, 0
    while admitted < cap:
        group = pool[(start + used) % len(pool)]
        used += 1
        books = gate.ledger.samplers.get(sampler)
        honest = books is None or books.checks < probation
        if timer is not None:
            timer.join()  # the last bump's weights are in: honest groups claim the newest version
        if honest:
            offered = dataclasses.replace(group, policy_version=lab.newest)
        else:
            offered = dataclasses.replace(lie(group), policy_version=lab.newest + 1 if bump else lab.newest)
            if bump:  # the learner publishes the version the group claims, and hands it to the gate just after
                lab.newest += 1
                timer = threading.Timer(0.02, gate.remember, (lab.newest, lab.publish(lab.newest)))
                timer.start()
        offered = dataclasses.replace(offered, group_uid=f"{sampler}-g{used}", sampler_id=sampler)
        gate._contents.clear()  # the pool is reused: replays are not what this measures
        try:
            vouched = gate.admit(offered)
        except RecordRejected as refusal:
            if timer is not None:
                timer.join()
            if honest:
                return admitted, None, refusal.reason, used, vouched_lies, released
            return admitted, refusal.reason, None, used, vouched_lies, released
        gate.accepted(offered, vouched)  # (not added to the buffer: only the gate's verdicts count)
        admitted += not honest
        vouched_lies += bool(vouched) and not honest
        if not honest:
            withheld += 1
            if vouched:  # this lie's check passed: it and every lie before it are vouched for
                released, withheld = released + withheld, 0
    if timer is not None:
        timer.join()
    return admitted, None, None, used, vouched_lies, released


def detection_table(args) -> list[str]:
    """Detection against false alarms, per set-up of sampler and scorer precision
    (:data:`DETECTION_SETUPS`: fp32; a bf16 sampler with the default fp32 learner; both in bf16,
    ``hetero.sampler_precision=bf16``), with checkable sampling on. Honest groups from several
    samplers, every one re-scored (``verify_fraction`` 1): the honest groups rejected. Then, for each
    lie of :data:`TABLE_LIES` (``research/soak/lies.py``, the soak's liars), ``--trials`` liars, each
    honest through its probation and then lying on every group: the lying groups the real
    :class:`TrustGate` admitted before the one it refused (the quarantine), at the run's
    ``verify_fraction``; a trial ends uncaught after ``--cap`` admitted. ``--bounds SETUP=FILE``: that
    set-up's gate uses a calibration (``hetero.trust.bounds_file``, ``python -m recipe.gepo.calibrate``
    with the set-up's overrides) in place of the table's bf16 bounds."""
    import collections
    import dataclasses

    import torch

    from ..soak.lies import near_copy
    from verl_ext.hetero.records import RecordRejected

    torch.set_num_threads(1)
    honest_lines = [
        "| sampler / scorer | honest groups (checked: all) | rejected (false alarms) | refused as replayed "
        "(no blame) | tokens checked | near ties | largest CUSUM, % of its limit (mean \\|Δ\\|; bias; near ties) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lie_lines = [
        "| sampler / scorer | lie, on every group after an honest probation | pool groups it changes "
        "| lying groups admitted before quarantine: mean | median | max | trials not caught within the cap "
        "| checked lying groups refused | refused by | vouched for (hold_unchecked: trained on): mean | max |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    bounds = dict(item.split("=", 1) for item in args.bounds)
    unknown = sorted(set(bounds) - set(DETECTION_SETUPS))
    if unknown:
        raise SystemExit(
            f"--bounds: unknown set-up(s) {unknown}; expected SETUP=FILE with SETUP one of {list(DETECTION_SETUPS)}"
        )
    for setup in args.setups:
        precision, scorer = DETECTION_SETUPS[setup]
        name = f"{precision} / {scorer}" + (" (calibrated)" if setup in bounds else "")
        # false alarms: honest groups from several samplers, every one checked (verify_fraction 1)
        lab = _Lab(args.model, setup, 1.0, args.seed, bounds.get(setup, ""))
        tol = lab.gate.verifier.tolerance(precision)
        reasons: collections.Counter = collections.Counter()
        peak, peak_bias, peak_ties, offered = 0.0, 0.0, 0.0, 0
        for b in range(-(-args.honest // args.prompts)):
            for i, group in enumerate(lab.groups(args.prompts, stream=11, index=b)):
                sampler = f"honest-{(b * args.prompts + i) % args.honest_samplers}"
                group = dataclasses.replace(group, sampler_id=sampler, group_uid=f"{sampler}-{b}-{i}")
                offered += 1
                try:
                    lab.gate.accepted(group, lab.gate.admit(group))
                except RecordRejected as refusal:
                    reasons[refusal.reason] += 1
                peak = max(peak, lab.gate.cusum.sums.get(sampler, 0.0) / tol.cusum_limit)
                peak_bias = max(peak_bias, max(lab.gate.cusum.bias.get(sampler, (0.0, 0.0))) / tol.bias_limit)
                if tol.near_tie_limit:  # a calibration's near-tie test
                    peak_ties = max(peak_ties, lab.gate.cusum.ties.get(sampler, 0.0) / tol.near_tie_limit)
        counts = lab.gate.verifier.token_counts
        false_alarms = sum(n for r, n in reasons.items() if r != "replayed")
        honest_lines.append(
            f"| {name} | {offered} | {false_alarms}"
            + (f" ({dict(reasons)})" if false_alarms else "")
            + f" | {reasons['replayed']} | {counts['tokens_checked']} | {counts['token_near_ties']} "
            f"| {100 * peak:.0f}%; {100 * peak_bias:.0f}%; "
            + (f"{100 * peak_ties:.0f}% |" if tol.near_tie_limit else "- |")
        )
        print(honest_lines[-1], flush=True)
        # lies: a fresh liar each trial, at the run's verify_fraction (or --fraction)
        lab = _Lab(args.model, setup, args.fraction, args.seed, bounds.get(setup, ""))
        pool = lab.groups(args.pool, stream=3, index=0)
        start = 0
        for label, kind, size in [lie for lie in TABLE_LIES if not args.lies or lie[1] in args.lies]:
            if kind == "near_copy":
                admitted, refused_by = [], collections.Counter()
                for t in range(args.trials):
                    source = dataclasses.replace(
                        pool[t % len(pool)], group_uid=f"orig-{t}", sampler_id="honest", policy_version=lab.newest
                    )
                    lab.gate._contents.clear()
                    lab.gate.accepted(source, lab.gate.admit(source))
                    try:
                        copy = near_copy(source, f"copier-{t}", "copier")
                        lab.gate.accepted(copy, lab.gate.admit(copy))
                        admitted.append(1)
                    except RecordRejected as refusal:
                        admitted.append(0)
                        refused_by[refusal.reason] += 1
                a = np.asarray(admitted)
                lie_lines.append(
                    f"| {name} | {label} | all (rows, one q) | {a.mean():.2f} (a copy) | {np.median(a):.0f} "
                    f"| {a.max()} | - | {len(a) - a.sum()} of {len(a)} | {dict(refused_by)} | - | - |"
                )
                print(lie_lines[-1], flush=True)
                continue
            lie = _lie_maker(lab, kind, size)
            cache: dict[int, object] = {}

            def lying(group, lie=lie, cache=cache):
                key = id(group)
                if key not in cache:
                    cache[key] = lie(group)
                return cache[key]

            admitted, refused_by, not_caught, honest_refused = [], collections.Counter(), 0, collections.Counter()
            passed, trained = 0, []
            for t in range(args.trials):
                n, reason, honest_reason, used, vouched, released = _lying_trial(
                    lab, f"{kind}-{size}-{t}", pool, start, lying, kind == "bump", args.cap
                )
                start += used
                passed += vouched
                if honest_reason is not None:
                    honest_refused[honest_reason] += 1
                    continue
                admitted.append(n)
                trained.append(released)
                if reason is None:
                    not_caught += 1
                else:
                    refused_by[reason] += 1
            a, h = np.asarray(admitted or [0]), np.asarray(trained or [0])
            caught = sum(refused_by.values())
            changed = (
                f"{100 * np.mean([not np.array_equal(g.response_ids, cache[id(g)].response_ids) for g in pool if id(g) in cache]):.0f}%"
                if kind in ("other_weights", "top_k", "top_p")
                else "all (q)"
            )
            lie_lines.append(
                f"| {name} | {label} | {changed} | {a.mean():.1f} | {np.median(a):.0f} | {a.max()} "
                f"| {not_caught} of {len(admitted)} | {caught} of {caught + passed} | {dict(refused_by) or '-'}"
                + (f"; honest probation groups refused: {dict(honest_refused)}" if honest_refused else "")
                + f" | {h.mean():.1f} | {h.max()} |"
            )
            print(lie_lines[-1], flush=True)
    fraction = lab.engine.hetero.trust.verify_fraction
    return [
        f"{args.model}: the real TrustGate, checkable sampling on, the sampler (its precision declared) and the "
        "gate's scorer (hetero.sampler_precision) in the precisions named; one torch thread",
        "",
        f"Honest samplers: {args.honest} groups from {args.honest_samplers} samplers, every group re-scored "
        "(verify_fraction 1: the most a false alarm can get)",
        "",
        *honest_lines,
        "",
        f"Lies: {args.trials} trials a lie, a fresh liar each (probation {lab.engine.hetero.trust.probation_groups} "
        f"honest groups, then the lie on every group), verify_fraction {fraction:g}, at most {args.cap} lying "
        f"groups a trial; a pool of {args.pool} honest groups lied about",
        "",
        *lie_lines,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="part", required=True)
    raw = argparse.RawDescriptionHelpFormatter
    o = sub.add_parser("overhead", description=inspect.cleandoc(overhead.__doc__), formatter_class=raw)
    o.add_argument("--steps", type=int, default=60)
    o.add_argument("--warmup", type=int, default=5)
    o.add_argument("--repeats", type=int, default=2)
    o.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 1.0])
    d = sub.add_parser("detection", description=inspect.cleandoc(detection.__doc__), formatter_class=raw)
    d.add_argument("--trials", type=int, default=200)
    d.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5, 1.0])
    dt = sub.add_parser("detection-table", description=inspect.cleandoc(detection_table.__doc__), formatter_class=raw)
    dt.add_argument("--model", choices=sorted(DETECTION_MODELS), default="toy")
    dt.add_argument("--setups", nargs="+", choices=list(DETECTION_SETUPS), default=list(DETECTION_SETUPS))
    dt.add_argument("--honest", type=int, default=256, help="honest groups offered, every one checked")
    dt.add_argument("--honest-samplers", type=int, default=4)
    dt.add_argument("--prompts", type=int, default=16, help="groups generated at a time")
    dt.add_argument("--pool", type=int, default=32, help="honest groups the lies are told about (reused)")
    dt.add_argument("--trials", type=int, default=20, help="liars per lie")
    dt.add_argument("--cap", type=int, default=100, help="lying groups admitted that end a trial uncaught")
    dt.add_argument("--fraction", type=float, default=None, help="verify_fraction (default: the config's)")
    dt.add_argument("--seed", type=int, default=0)
    dt.add_argument(
        "--lies", nargs="*", default=[], choices=sorted({kind for _, kind, _ in TABLE_LIES}), help="only these kinds"
    )
    dt.add_argument(
        "--bounds", nargs="*", default=[], metavar="SETUP=FILE", help="a set-up's bf16 bounds from a calibration file"
    )
    sp = sub.add_parser("spread", description=inspect.cleandoc(spread.__doc__), formatter_class=raw)
    sp.add_argument("--batches", type=int, default=20)
    ra = sub.add_parser("ratio", description=inspect.cleandoc(ratio.__doc__), formatter_class=raw)
    ra.add_argument("--model", choices=sorted(RATIO_MODELS), default="toy")
    ra.add_argument("--prompts", type=int, default=8)
    ra.add_argument(
        "--checkable", action="store_true", help="hetero.trust.checkable_sampling on (seeded groups, the token check)"
    )
    co = sub.add_parser("components", description=inspect.cleandoc(components.__doc__), formatter_class=raw)
    co.add_argument("--steps", type=int, default=40)
    co.add_argument("--lag", type=int, default=2, help="versions the sampler is behind the learner")
    co.add_argument("--fraction", type=float, default=0.1, help="hetero.trust.verify_fraction")
    co.add_argument("--checkable", action="store_true", help="hetero.trust.checkable_sampling on")
    cl = sub.add_parser("checker-latency", description=inspect.cleandoc(checker_latency.__doc__), formatter_class=raw)
    cl.add_argument("--model", choices=sorted(DETECTION_MODELS), default="toy")
    cl.add_argument("--prompts", type=int, default=4, help="groups generated (the calls cycle through them)")
    cl.add_argument("--repeats", type=int, default=20, help="calls per condition")
    cl.add_argument("--checkable", action="store_true", help="hetero.trust.checkable_sampling on (the token check too)")
    for p in (o, d, dt, sp, ra, co, cl):
        p.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from .bench_async import emit, loadavg

    part = {
        "overhead": overhead,
        "detection": detection,
        "detection-table": detection_table,
        "spread": spread,
        "ratio": ratio,
        "components": components,
        "checker-latency": checker_latency,
    }[args.part]
    emit([f"(load at the start: {loadavg()})", *part(args)], args.out)


if __name__ == "__main__":
    main()
