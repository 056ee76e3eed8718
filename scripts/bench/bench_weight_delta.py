"""Bytes per weight version, full against XOR delta, over real GEPO learner steps.

    python -m scripts.bench.bench_weight_delta --model toy --steps 5 [--lr 1e-6 | --lr qwen3_1p7b_fsdp]
    python -m scripts.bench.bench_weight_delta --model smollm2 --steps 5 [--out runs/bench/delta.json]

Runs the embedded engine's learner (``recipe.gepo.embedded.loop.LearnerRuntime``, replay mode at
staleness 0: sample, the learner's advantages, the configured loss (GEPO), AdamW) on the toy task's
warm start or SmolLM2-135M-Instruct (the ``cpu_smollm2_math`` preset's task, temperature and
reward weights), and publishes every version through the engine's ``WeightStore`` (bf16 wire, delta on) into an
in-memory transport. Per step: the fraction of bf16 (and fp32) elements whose bits changed, the
bytes of the full bf16 version, of the engine's delta message and of its compressed XOR alone;
each delta is applied back (``apply_delta``) and its bits compared with the version's. ``--lr``:
a number or a preset's name (default: the model's preset), read from the preset files. Prints a
markdown table (or JSON lines) to stdout; ``--out``: all of it as JSON. Results: docs/network.md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

from verl_ext.hetero.protocol import version_key
from verl_ext.hetero.transport import FsspecTransport
from verl_ext.hetero.weights import (
    WeightStore,
    apply_delta,
    encode_xor,
    floating_bits,
    serialize_state_dict,
    wire_sha256,
    wire_tensors,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "recipe" / "gepo" / "config"
PRESET_DIR = REPO / "configs" / "verl_preset"
#: the preset each model's lr, task and sampling temperature come from
MODEL_PRESETS = {"toy": "cpu_toy", "smollm2": "cpu_smollm2_math"}
_memory_ids = itertools.count()


# --- configuration ------------------------------------------------------------------------------


def _compose(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=overrides)


def preset_config(name: str) -> DictConfig:
    """``gepo_trainer.yaml`` with ``+verl_preset=<name>`` composed as the command line composes it
    (``--config-dir configs``), defaults chain included (the qwen3 presets' ``paper_online``)."""
    if not (PRESET_DIR / f"{name}.yaml").is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise SystemExit(f"--lr {name}: neither a number nor a preset in {PRESET_DIR} ({', '.join(known)})")
    return _compose([f"+verl_preset={name}", f"hydra.searchpath=[pkg://verl.trainer.config,file://{REPO / 'configs'}]"])


def resolve_lr(value: str | None, model: str) -> tuple[float, str]:
    """(lr, where it came from): a number as given, else the named preset's (default: the
    model's preset, :data:`MODEL_PRESETS`) ``actor_rollout_ref.actor.optim.lr``."""
    if value is not None:
        try:
            return float(value), "--lr"
        except ValueError:
            pass
    name = value or MODEL_PRESETS[model]
    return float(preset_config(name).actor_rollout_ref.actor.optim.lr), f"configs/verl_preset/{name}.yaml"


def preset_reward_kwargs(model: str) -> dict[str, Any]:
    """The model's preset's ``reward.custom_reward_function.reward_kwargs`` (cpu_smollm2_math:
    ``boxed_weight: 0.1``, the format term that gives this weak model's groups a reward spread)."""
    kwargs = OmegaConf.select(preset_config(MODEL_PRESETS[model]), "reward.custom_reward_function.reward_kwargs")
    return dict(OmegaConf.to_container(kwargs, resolve=True)) if kwargs else {}


def use_reward_kwargs(task: Any, kwargs: dict[str, Any]) -> None:
    """Score ``task``'s responses with the reward dispatch and ``kwargs`` (the embedded engine's
    ``Task.score`` passes none), capped at the top of ``task.reward_range`` so the buffer admits
    every group (a correct boxed answer scores 1.0, not 1.1)."""
    from verl_ext.rewards.dispatch import compute_score

    high = task.reward_range[1]

    def score(response: str, item: dict) -> float:
        return min(high, float(compute_score(task.data_source, response, item["answer"], **kwargs)["score"]))

    task.score = score


def engine_cfg(args: argparse.Namespace, lr: float, run_dir: Path) -> DictConfig:
    """The embedded engine's config: replay mode at staleness 0, ``args``' batch shape and lr; for
    smollm2 the preset's ``task:`` section and sampling temperature."""
    overrides = [
        "hetero.mode=replay",
        "hetero.delay.dist=none",
        "hetero.max_delay=0",  # one snapshot kept, each batch sampled by the current version
        f"hetero.seed={args.seed}",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.group_size}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.logger=[]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]
    if args.model_path:
        overrides.append(f"actor_rollout_ref.model.path={args.model_path}")
    cfg = _compose(overrides)
    preset = preset_config(MODEL_PRESETS[args.model]) if args.model != "toy" else None
    with open_dict(cfg):
        if preset is not None:
            cfg.task = OmegaConf.merge(cfg.task, preset.task)
            cfg.actor_rollout_ref.rollout.temperature = preset.actor_rollout_ref.rollout.temperature
            cfg.data.max_response_length = preset.data.max_response_length
        if args.max_response_length is not None:
            cfg.data.max_response_length = args.max_response_length
    return cfg


# --- the measurement ----------------------------------------------------------------------------


class DeltaMeter:
    """Publishes each version through the engine's :class:`WeightStore` (bf16 wire, deltas on)
    and measures it against the version before (:meth:`publish`; ``rows``: one per version after
    the first)."""

    def __init__(self):
        self.transport = FsspecTransport(f"memory://bench-weight-delta-{os.getpid()}-{next(_memory_ids)}")
        self.store = WeightStore(self.transport, keep_last=2, wire_dtype="bf16", delta=True)
        self.rows: list[dict[str, Any]] = []
        self.full_fp32_bytes: int | None = None
        self.params = 0
        self._prev: tuple[int, dict[str, torch.Tensor], np.ndarray, np.ndarray] | None = None

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        full = self.store.publish(version, weights)  # the full bf16 message, as samplers receive it
        publish_s = time.perf_counter() - t0
        wire, _ = wire_tensors(weights, "bf16")
        bits = floating_bits(wire).view(np.uint16)  # bf16 bit patterns, one per element
        fp32 = floating_bits(weights, "fp32").view(np.uint32)  # the learner's master weights' bits
        if self._prev is None:
            self.params = int(bits.size)
            self.full_fp32_bytes = len(serialize_state_dict(weights, version))
        else:
            base_version, base_wire, base_bits, base_fp32 = self._prev
            delta = self.transport.get(self.store.delta_topic, version_key(version))
            got, target, _, sha = apply_delta(delta, base_wire)
            exact = (
                got == version
                and sha == wire_sha256(wire)
                and np.array_equal(floating_bits(target).view(np.uint16), bits)
                and all(torch.equal(target[n], t) for n, t in wire.items() if not t.is_floating_point())
            )
            self.rows.append(
                {
                    "version": version,
                    "base_version": base_version,
                    "bf16_changed_frac": float(np.count_nonzero(bits != base_bits)) / bits.size,
                    "fp32_changed_frac": float(np.count_nonzero(fp32 != base_fp32)) / fp32.size,
                    "full_bf16_bytes": len(full),
                    "full_bf16_bytes_serialize": len(serialize_state_dict(weights, version, "bf16")),
                    "delta_bytes": len(delta),
                    "xor_bytes": len(encode_xor(bits, base_bits)),
                    "delta_exact": bool(exact),
                    "publish_s": publish_s,
                }
            )
        self._prev = (version, {n: t.clone() for n, t in wire.items()}, bits, fp32)


class _Publishing:
    """The replay source, with every published version also handed to ``on_publish``."""

    def __init__(self, source: Any, on_publish: Callable[[dict, int], None]):
        self.source, self.on_publish = source, on_publish

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.source.publish(weights, version)
        self.on_publish(weights, version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def loadavg() -> str:
    """The 1/5/15-minute load averages (``/proc/loadavg``)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        )
        return out.stdout.strip() or "n/a"
    except OSError:
        return "n/a"


def run(args: argparse.Namespace, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Train ``args.steps`` learner steps and measure every version; returns ``{"meta", "rows"}``."""
    from recipe.gepo.embedded.engine_config import EngineConfig
    from recipe.gepo.embedded.loop import LearnerRuntime
    from recipe.gepo.embedded.replay import ReplaySource
    from recipe.gepo.embedded.tasks import resolve_model_path
    from verl_ext.hetero.seeding import seed_process
    from verl_ext.torch_threads import set_torch_threads

    lr, lr_source = resolve_lr(args.lr, args.model)
    load_before, started = loadavg(), time.perf_counter()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="bench-weight-delta-") as run_dir:
        engine = EngineConfig.from_omegaconf(engine_cfg(args, lr, Path(run_dir)))
        model_path = resolve_model_path(engine.settings.model_path, engine.task, engine.hetero.seed)
        seed_process(args.seed)
        threads = set_torch_threads(2)  # the engine's rule: OMP_NUM_THREADS wins
        meter = DeltaMeter()
        runtime = LearnerRuntime(engine, model_path, lambda rt: _Publishing(ReplaySource(rt), meter.publish))
        reward_kwargs = preset_reward_kwargs(args.model) if args.model != "toy" else {}
        if reward_kwargs:
            use_reward_kwargs(runtime.task, reward_kwargs)  # the replay source scores through runtime.task
        try:
            runtime.start(None)  # publishes version 0
            for step in range(args.steps):
                metrics = runtime.step(step)
                row = meter.rows[-1]
                row.update(
                    {
                        "step": step + 1,
                        "reward_mean": metrics["reward/mean"],
                        "grad_norm": metrics["actor/grad_norm"],
                        "loss": metrics["actor/loss"],
                        "step_s": metrics["perf/step_s"],
                        "train_s": metrics["perf/train_s"],
                    }
                )
                progress(json.dumps(row))
        finally:
            runtime.shutdown()
    meta = {
        "model": args.model,
        "model_path": model_path,
        "params": meter.params,
        "full_fp32_bytes": meter.full_fp32_bytes,
        "loss_mode": engine.actor.policy_loss.loss_mode,
        "lr": lr,
        "lr_source": lr_source,
        "steps": args.steps,
        "seed": args.seed,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_response_length": engine.settings.max_new_tokens,
        "temperature": engine.settings.temperature,
        "reward_kwargs": reward_kwargs,
        "wire": "bf16",
        "torch_threads": threads,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "commit": git_commit(),
        "date": date,  # the start
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "wall_s": time.perf_counter() - started,
        "command": " ".join(sys.argv),
    }
    return {"meta": meta, "rows": meter.rows}


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown table, one row per learner step."""
    m = result["meta"]
    lines = [
        (
            f"{m['model']} ({m['params']:,} parameters), {m['loss_mode']}, lr {m['lr']:g} ({m['lr_source']}), "
            f"{m['prompts']} prompts x G={m['group_size']}, responses <= {m['max_response_length']} tokens; "
            f"full fp32 {m['full_fp32_bytes']:,} bytes"
        ),
        "",
        (
            "| step | bf16 changed | fp32 changed | full bf16 bytes | delta bytes | XOR bytes | delta / full "
            "| exact | reward | grad norm | step s |"
        ),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['step']} | {r['bf16_changed_frac']:.2%} | {r['fp32_changed_frac']:.1%} | {r['full_bf16_bytes']:,} "
            f"| {r['delta_bytes']:,} | {r['xor_bytes']:,} | {r['delta_bytes'] / r['full_bf16_bytes']:.1%} "
            f"| {'yes' if r['delta_exact'] else 'NO'} | {r['reward_mean']:.3f} | {r['grad_norm']:.3g} "
            f"| {r['step_s']:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench.bench_weight_delta",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_PRESETS),
        default="toy",
        help="toy: the toy task's shipped warm start (3-digit addition, ~1M parameters); smollm2: "
        "SmolLM2-135M-Instruct on the cpu_smollm2_math preset's GSM8K task (converted once into task.cache_dir)",
    )
    parser.add_argument(
        "--lr",
        default=None,
        help="learning rate: a number, or a preset name in configs/verl_preset/ whose "
        "actor_rollout_ref.actor.optim.lr is used (qwen3_1p7b_fsdp: 1e-6); default: the model's preset "
        f"({', '.join(f'{k}: {v}' for k, v in MODEL_PRESETS.items())})",
    )
    parser.add_argument("--steps", type=int, default=5, help="learner steps (versions published after version 0)")
    parser.add_argument("--seed", type=int, default=0, help="hetero.seed: prompts, sampling and the torch generator")
    parser.add_argument("--prompts", type=int, default=2, help="prompts (groups) per learner step")
    parser.add_argument("--group-size", type=int, default=4, help="G, responses per prompt")
    parser.add_argument(
        "--max-response-length",
        type=int,
        default=None,
        help="response token limit; default: the preset's (toy 8, smollm2 160)",
    )
    parser.add_argument(
        "--model-path", default="", help="train this HF folder instead (its architecture must suit the --model task)"
    )
    parser.add_argument("--format", choices=["table", "jsonl"], default="table", help="what goes to stdout")
    parser.add_argument("--out", type=Path, default=None, help="also write {meta, rows} to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines on stderr")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    progress = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    result = run(args, progress)
    if args.format == "jsonl":
        for row in result["rows"]:
            print(json.dumps({**row, "lr": result["meta"]["lr"], "model": args.model}))
    else:
        print(markdown(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
