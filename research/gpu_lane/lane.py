#!/usr/bin/env python3
"""The GPU lane: install from the packed parts, then measure the project on one GPU, in one table.

    python research/gpu_lane/lane.py --parts-dir /tmp/hrl_parts --device cuda --out "$OUT"   # on the GPU machine
    python research/gpu_lane/lane.py --device cpu --quick --parts loss_precision,logprob_spread   # here, from the venv

Install (only with ``--parts-dir``, which holds ``manifest.json`` and the parts of ``pack.py``): every
part's size and sha256 checked, each group re-joined, its wheels installed into ``--site``
(``pip install --no-index --no-deps --target``), and ``--site`` put first on ``sys.path`` and
``PYTHONPATH``; ``--no-install`` reuses the ``--site`` of an earlier run. Then the parts of ``--parts``
(:data:`PARTS`, each described in :data:`PART_NAMES` and docs/gpu.md; default :data:`DEFAULT_ORDER`,
the cheap checks first) run in the order given, each in its own process with its own budget, all
within ``--budget-s`` counted from the start: a part without time left gets a ``skipped: budget`` row,
a failing part writes its error in its row and the others go on. After every part the lane writes
``lane.json`` (rows of ``part, name, status, values, note``) and ``lane.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PART_NAMES = {
    "loss_precision": "losses in fp32 and bf16 against float64",
    "loss_speed": "loss forward+backward cost",
    "embedded_toy": "embedded engine, GEPO on the toy",
    "embedded_smollm2": "SmolLM2-135M GEPO on easy GSM8K",
    "logprob_spread": "sampler/learner log-prob spread",
    "verl_toy": "verl engine, 3 steps",
}
#: seconds each part may take (full, --quick); all of them within --budget-s. The full sizes took, on an
#: H200 on 2026-11-28: 22, 51, 19, ~110 (three runs; async alone 69), 135 and (verl_toy) not yet known
PART_BUDGET_S = {
    "loss_precision": (30, 90),
    "loss_speed": (70, 120),
    "logprob_spread": (30, 90),
    "embedded_toy": (130, 240),
    "embedded_smollm2": (150, 300),
    "verl_toy": (120, 300),
}
#: the default order: the cheap checks first, the SmolLM2 training (which takes what is left) last
DEFAULT_ORDER = "loss_precision,logprob_spread,loss_speed,embedded_toy,verl_toy,embedded_smollm2"
#: a part is started only with at least this much time left
MIN_PART_S = 10
#: kept back at the end for the table
RESERVE_S = 5

Row = dict[str, Any]


def make_row(part: str, name: str, status: str = "ok", note: str = "", **values: Any) -> Row:
    return {"part": part, "name": name, "status": status, "values": values, "note": note}


# ---------------------------------------------------------------------------------------------
# install


def install(parts_dir: Path, site: Path, stage: Path) -> list[str]:
    """Install the packed groups of ``parts_dir`` into ``site``; lines saying what was done."""
    sys.path.insert(0, str(HERE))
    from pack import PackError, rejoin, write_project_metadata  # noqa: E402  (this folder's packer)

    manifest = json.loads((parts_dir / "manifest.json").read_text())
    log, wheels, copied = [], [], 0
    groups = [g["group"] for g in manifest["groups"]]
    for group in groups:
        try:
            unpacked = rejoin(parts_dir, manifest, group, stage)
        except PackError as exc:
            log.append(f"group {group}: not installed: {exc}")
            continue
        wheels += sorted((unpacked / "wheels").glob("*.whl"))
        site_files = unpacked / "site"
        if site_files.is_dir():
            for src in site_files.rglob("*"):
                if src.is_file():
                    dst = site / src.relative_to(site_files)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
                    copied += 1
        log.append(
            f"group {group}: {sum(p['bytes'] for p in next(g for g in manifest['groups'] if g['group'] == group)['parts']) / 2**20:.1f} MiB, sha256 ok"
        )
    site.mkdir(parents=True, exist_ok=True)
    if "code" not in groups:
        # the project's code is this checkout (on the path through PYTHONPATH): only its metadata,
        # for the entry points verl loads the project's plugins from
        info = write_project_metadata(ROOT, site)
        log.append(f"project: this checkout, its entry points in {info.name}")
    site.mkdir(parents=True, exist_ok=True)
    if wheels:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *map(str, wheels),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install --target {site} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    log.append(f"{len(wheels)} wheels and {copied} data files into {site}")
    return log


def use_site(site: Path) -> None:
    sys.path.insert(0, str(site))
    parts = [str(site), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


# ---------------------------------------------------------------------------------------------
# helpers of the parts (run in the part's own process)


def _device(name: str):
    import torch

    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device here")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dev


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed_ms(fn: Callable[[], None], dev) -> float:
    import torch

    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(dev)
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(dev, nbytes: int) -> float:
    """Bytes a second a device-to-device copy moves, counting bytes read and written."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    _sync(dev)
    ms = statistics.median(_timed_ms(lambda: dst.copy_(src), dev) for _ in range(5))
    return 2 * src.numel() * 4 / (ms / 1e3)


def _bench_losses():
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_losses

    return bench_losses


def selected_losses(workdir: Path) -> list[tuple[str, Any, Any]]:
    """[(label, loss function, ActorConfig)] of bench_losses.LOSSES (``--losses`` picks labels; the
    first, vanilla, always comes: the baseline of loss_speed's ratios), the
    configs composed once per lane run (hydra's compose takes seconds) and shared through ``workdir``."""
    import pickle

    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import verl_ext.algos.registry  # noqa: F401  registers the project's losses

    bl = _bench_losses()
    wanted = os.environ.get("LANE_LOSSES", "all")
    labels = [label for label, _, _ in bl.LOSSES]
    if wanted != "all":
        picked = [w.strip() for w in wanted.split(",") if w.strip()]
        unknown = [w for w in picked if w not in labels]
        if unknown:
            raise ValueError(f"--losses {unknown}: not in scripts/bench/bench_losses.py's list {labels}")
        labels = [label for label in labels if label in picked or label == labels[0]]  # the baseline stays
    cache = workdir / "actor_configs.pkl"
    configs = pickle.loads(cache.read_bytes()) if cache.is_file() else {}
    out = []
    for label, preset, mode in bl.LOSSES:
        if label not in labels:
            continue
        if label not in configs:
            configs[label] = bl.actor_config(preset, mode, 8)
        out.append((label, get_policy_loss_fn(mode), configs[label]))
    cache.write_bytes(pickle.dumps(configs))
    return out


def loss_inputs(batch: int, length: int, group: int, seed: int = 0):
    """float64 CPU tensors: log p, log q (log p = log q + 0.3 noise: clipping is active), advantages
    constant within each of batch/group groups, a mask with lengths uniform in [T/4, T]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    log_q = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    log_p = log_q + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(batch // group, 1, generator=gen, dtype=torch.float64).repeat_interleave(group, 0)
    return log_p, log_q, adv.expand(-1, length).contiguous(), mask


def _call_loss(fn, cfg, log_p, log_q, adv, mask):
    """(loss, d loss / d log p) of one verl-signature loss, as ``ppo_loss`` calls it."""
    log_p = log_p.detach().clone().requires_grad_(True)
    loss, _ = fn(
        old_log_prob=log_q,
        log_prob=log_p,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=cfg.loss_agg_mode,
        config=cfg,
    )
    loss.backward()
    return loss.detach(), log_p.grad.detach()


def _rel(x, ref) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / max(float(ref.norm()), 1e-30))


# ---------------------------------------------------------------------------------------------
# the parts: part(device, quick, emit, workdir)


def loss_precision(device: str, quick: bool, emit: Callable[[Row], None], workdir: Path) -> None:
    import torch

    dev = _device(device)
    group = 8
    batch, length = (32, 64) if quick else (64, 512)
    ref_inputs = loss_inputs(batch, length, group)
    for label, fn, cfg in selected_losses(workdir):
        try:
            loss64, grad64 = _call_loss(fn, cfg, *ref_inputs)
        except Exception as exc:  # noqa: BLE001 -- the error is the row
            emit(
                make_row(
                    "loss_precision", label, "error", f"float64 reference on cpu: {type(exc).__name__}: {exc}"[:300]
                )
            )
            continue
        values, errors = {}, []
        for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                inputs = [t.to(dev, dtype) if t.is_floating_point() else t.to(dev) for t in ref_inputs]
                loss, grad = _call_loss(fn, cfg, *inputs)
                values[f"{tag}_loss_rel"] = _rel(loss.reshape(1), loss64.reshape(1))
                values[f"{tag}_grad_rel"] = _rel(grad, grad64)
                if not bool(torch.isfinite(grad).all()):
                    errors.append(f"{tag}: non-finite gradient")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{tag} on {dev}: {type(exc).__name__}: {exc}"[:300])
        emit(
            make_row(
                "loss_precision", label, "error" if errors else "ok", "; ".join(errors), B=batch, T=length, **values
            )
        )


def loss_speed(device: str, quick: bool, emit: Callable[[Row], None], workdir: Path) -> None:
    dev = _device(device)
    bandwidth = copy_bandwidth(dev, (64 if quick else 1024) * 2**20)
    emit(
        make_row(
            "loss_speed",
            f"copy bandwidth on {dev}",
            note="device-to-device copy, bytes read + written",
            GB_per_s=bandwidth / 1e9,
        )
    )
    bl = _bench_losses()
    losses = selected_losses(workdir)
    shapes = [(32, 128)] if quick else [(256, 4096), (1024, 8192)]
    repeats = 3 if quick else 20
    for batch, length in shapes:
        old, new, adv, mask = (t.to(dev) for t in bl.make_batch(batch, length))
        entries, failed = [], []
        for label, fn, cfg in losses:

            def once(fn=fn, cfg=cfg):
                _call_loss(fn, cfg, new, old, adv, mask)

            try:
                for _ in range(2):
                    once()
                entries.append((label, once))
            except Exception as exc:  # noqa: BLE001
                failed.append(
                    make_row(
                        "loss_speed", f"{label} B={batch} T={length}", "error", f"{type(exc).__name__}: {exc}"[:300]
                    )
                )
        times: dict[str, list[float]] = {label: [] for label, _ in entries}
        for _ in range(repeats):  # round-robin: drift hits every loss alike
            for label, once in entries:
                times[label].append(_timed_ms(once, dev))
        base = statistics.median(times[losses[0][0]]) if losses and losses[0][0] in times else float("nan")
        floor_ms = 20 * batch * length / bandwidth * 1e3
        for label, _ in entries:
            ms = statistics.median(times[label])
            emit(
                make_row(
                    "loss_speed",
                    f"{label} B={batch} T={length}",
                    note=f"eager fp32, median of {repeats}",
                    ms=ms,
                    x_vanilla=ms / base,
                    x_floor=ms / floor_ms,
                )
            )
        for row in failed:
            emit(row)
    gpu_bench = ROOT / "scripts" / "bench" / "bench_losses_gpu.py"
    if gpu_bench.is_file():
        # eager and torch.compile'd, the pure losses of the GEPO family against vanilla in the same mode,
        # in a process of its own, stopped with the time the part has left (compiling takes a while)
        left = float(os.environ.get("LANE_PART_BUDGET_S", "100")) - (time.time() - START) - 3
        try:
            for r in _run_gpu_bench(gpu_bench, device, quick, bandwidth, workdir, left):
                r = dict(r)
                error = r.pop("error", None)
                name = f"{r.pop('loss', '?')} B={r.pop('B', '?')} T={r.pop('T', '?')}, eager / compiled"
                values = {
                    k: float(v)
                    for k, v in r.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("repeats", "bandwidth_tbs")
                }
                note = f"bench_losses_gpu.py, {r.get('backend')}, median of {r.get('repeats')}; floor at the copy bandwidth"
                emit(
                    make_row(
                        "loss_speed", name, "error" if error else "ok", f"{error}; {note}" if error else note, **values
                    )
                )
        except Exception as exc:  # noqa: BLE001 -- the rows above stand
            emit(make_row("loss_speed", "bench_losses_gpu.py", "error", f"{type(exc).__name__}: {exc}"[:400]))


def _run_gpu_bench(path: Path, device: str, quick: bool, bandwidth: float, workdir: Path, timeout: float) -> list[dict]:
    """``scripts/bench/bench_losses_gpu.py``'s rows (its ``--json``), at the measured bandwidth, for
    the losses of ``--losses`` it has (vanilla always); full sizes: the largest shape only (each
    shape compiles every loss again)."""
    if timeout < 5:
        raise TimeoutError(f"not started: {max(timeout, 0):.0f} s left of the part's budget")
    out = workdir / "bench_losses_gpu.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(path),
        "--device",
        device,
        "--bandwidth-tbs",
        f"{bandwidth / 1e12:.6g}",
        "--json",
        str(out),
    ]
    cmd += ["--quick"] if quick else ["--shapes", "1024x8192"]
    wanted = os.environ.get("LANE_LOSSES", "all")
    if wanted != "all":
        picked = {w.strip() for w in wanted.split(",")}
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_losses_gpu", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # only to read its list of losses
        cmd += ["--losses", ",".join(k for k in module.LOSSES if k == "vanilla" or k in picked)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"bench_losses_gpu.py stopped after the {timeout:.0f} s the part had left") from None
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"bench_losses_gpu.py exit {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}")
    rows = json.loads(out.read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError("bench_losses_gpu.py --json holds no list of row dicts")
    return rows


def logprob_spread(device: str, quick: bool, emit: Callable[[Row], None], workdir: Path) -> None:
    import numpy as np
    import torch

    dev = _device(device)

    from recipe.gepo.embedded.policy import load_policy, sample_groups
    from verl_ext.sampling import sequence_token_log_probs
    from verl_ext.data.task_model import resolve_task_model
    from verl_ext.data.toy.problems import make_problems

    try:
        from recipe.gepo.sections import TrustConfig

        tolerance = float(TrustConfig().logprob_tolerance)
    except Exception:  # noqa: BLE001 -- the spread is measured all the same
        tolerance = 1e-3
    from recipe.gepo.sections import TaskConfig

    path = resolve_task_model("", TaskConfig(), 0)
    group, groups, batches, new_tokens = (4, 4, 1, 8) if quick else (8, 16, 8, 16)
    cpu = torch.device("cpu")
    if dev.type == "cpu":
        cases = [((cpu, "fp32"), (cpu, "fp32")), ((cpu, "bf16"), (cpu, "fp32")), ((cpu, "bf16"), (cpu, "bf16"))]
    else:
        cases = [
            ((cpu, "fp32"), (cpu, "fp32")),
            ((cpu, "bf16"), (cpu, "fp32")),
            ((dev, "fp32"), (dev, "fp32")),
            ((dev, "fp32"), (cpu, "fp32")),
            ((dev, "bf16"), (dev, "fp32")),
            ((dev, "bf16"), (dev, "bf16")),
        ]
    models: dict = {}

    def model_on(where, dtype):
        # sampler bf16: the model in bf16 (hetero.sampler_precision); learner bf16: fp32 weights under
        # bf16 autocast (hetero.learner_precision) -- the same fp32 model serves both
        key = (str(where), dtype)
        if key not in models:
            model, tok = load_policy(path, torch.bfloat16 if dtype == "bf16-weights" else torch.float32)
            models[key] = (model.to(where).eval(), tok)
        return models[key]

    problems = make_problems(groups * batches, digits=3, seed=7)
    temperature = 1.0
    for (s_dev, s_prec), (l_dev, l_prec) in cases:
        sampler, tok = model_on(s_dev, "bf16-weights" if s_prec == "bf16" else "fp32")
        learner, _ = model_on(l_dev, "fp32")
        worst, mean_abs = [], []
        for b in range(batches):
            # the embedded engine's own sampling (tokens and masked log q back on the CPU)
            batch = sample_groups(
                sampler,
                tok,
                [p["problem"] for p in problems[b * groups : (b + 1) * groups]],
                group,
                temperature,
                new_tokens,
                seed=b,
            )
            rmask = batch.response_mask
            autocast = torch.autocast(l_dev.type, dtype=torch.bfloat16, enabled=l_prec == "bf16")
            with torch.no_grad(), autocast:
                log_p = sequence_token_log_probs(
                    learner,
                    batch.prompt_ids.to(l_dev),
                    batch.prompt_mask.to(l_dev),
                    batch.response_ids.to(l_dev),
                    rmask.to(l_dev),
                    temperature,
                )
            diff = (log_p.float().cpu() - batch.sampler_logprobs.float()).abs() * rmask
            for g in range(0, diff.shape[0], group):
                worst.append(float(diff[g : g + group].max()))
                mean_abs.append(float(diff[g : g + group].sum() / rmask[g : g + group].sum().clamp(min=1)))
        w = np.asarray(worst)
        emit(
            make_row(
                "logprob_spread",
                f"toy: sampler {s_dev.type} {s_prec} / learner {l_dev.type} {l_prec}",
                note=f"{len(w)} groups of {group}, {new_tokens} new tokens; tolerance {tolerance:g}",
                max=float(w.max()),
                median=float(np.median(w)),
                p99=float(np.percentile(w, 99)),
                frac_over_tol=float((w > tolerance).mean()),
                mean_abs_token=float(np.mean(mean_abs)),
            )
        )


def _main_gepo(
    overrides: Sequence[str],
    workdir: Path,
    timeout: float,
    config_dir: bool = False,
    env: Optional[dict[str, str]] = None,
) -> tuple[int, str]:
    """Run ``python -m recipe.gepo.main_gepo`` with ``overrides``; (exit status, last output)."""
    cmd = (
        [sys.executable, "-m", "recipe.gepo.main_gepo"]
        + (["--config-dir", "configs"] if config_dir else [])
        + list(overrides)
    )
    log = workdir / f"main_gepo_{int(time.time() * 1e3)}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, **(env or {})),
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    text = log.read_text(errors="replace")
    return rc, text[-1500:]


def _engine_row(part: str, name: str, run_dir: Path, rc: int, tail: str, wall: float, note: str) -> Row:
    from verl_ext.rundir import read_metric_rows

    rows = read_metric_rows(run_dir, missing_ok=True, warn=False) if run_dir.is_dir() else []
    evals = [(r["step"], r["eval/acc_mean"]) for r in rows if "eval/acc_mean" in r]
    rewards = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    if rc != 0 or not rewards:
        lines = [ln for ln in tail.strip().splitlines() if ln.strip()]
        why = "timed out (part budget)" if rc == -9 else f"exit {rc}"
        return make_row(part, name, "error", f"{why}: {' | '.join(lines[-3:])}"[:400], steps_done=float(len(rewards)))
    values: dict[str, Any] = {
        "steps": float(rewards[-1][0]),
        "wall_s": wall,
        "reward_first": float(rewards[0][1]),
        "reward_last": float(rewards[-1][1]),
    }
    if len(evals) >= 2:
        values["acc_before"], values["acc_after"] = float(evals[0][1]), float(evals[-1][1])
    # the embedded engine's step time, or verl's
    step_times = [
        r.get("perf/step_s", r.get("timing_s/step")) for r in rows if "perf/step_s" in r or "timing_s/step" in r
    ]
    if step_times:
        values["step_s_median"] = float(statistics.median(step_times))
    idle = [r["perf/learner_idle_frac"] for r in rows if "perf/learner_idle_frac" in r]
    if idle:
        values["learner_idle_frac"] = float(statistics.mean(idle))
    curve = " ".join(f"{v:.2f}" for _, v in rewards[:: max(1, len(rewards) // 10)])
    return make_row(part, name, note=f"{note}; reward curve {curve}", **values)


def embedded_toy(device: str, quick: bool, emit: Callable[[Row], None], workdir: Path) -> None:
    steps, eval_size = (3, 16) if quick else (20, 256)
    budget = float(os.environ.get("LANE_PART_BUDGET_S", "120"))
    runs = [("replay", "fp32", "fp32"), ("async", "fp32", "fp32")] + ([] if quick else [("replay", "bf16", "bf16")])
    wanted = os.environ.get("LANE_TOY_RUNS", "all")
    if wanted != "all":
        runs = [r for r in runs if "-".join(r[:2]) in wanted.split(",")]
    for i, (mode, lp, sp) in enumerate(runs):
        run_dir = workdir / f"embedded_toy_{mode}_{lp}"
        overrides = [
            "algorithm_preset=gepo",
            f"hetero.mode={mode}",
            f"hetero.device={device}",
            f"hetero.learner_precision={lp}",
            f"hetero.sampler_precision={sp}",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={steps}",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            f"task.eval_size={eval_size}",
            "hetero.max_delay=4",
            f"trainer.default_local_dir={run_dir}",
        ]
        if mode == "async":
            overrides += ["hetero.num_samplers=2", "hetero.delay.low=0.1", "hetero.delay.high=1.0"]
        else:
            overrides += ["hetero.delay.low=1", "hetero.delay.high=4"]
        t0 = time.time()
        left = budget - (time.time() - START)
        rc, tail = _main_gepo(overrides, workdir, timeout=max(5.0, left / (len(runs) - i)))
        emit(
            _engine_row(
                "embedded_toy",
                f"{mode}, learner {lp}, samplers {sp}, {device}",
                run_dir,
                rc,
                tail,
                time.time() - t0,
                f"GEPO, toy 3-digit addition, {eval_size} held-out",
            )
        )


def embedded_smollm2(device: str, quick: bool, emit: Callable[[Row], None], workdir: Path) -> None:
    # held-out: 128 of the 133 easy GSM8K test problems (one sample each; the initial accuracy with
    # chat_1shot is ~1.6%: 1 of 64 samples on CPU, 16 problems x 4, T=0.5, 160 tokens)
    steps, eval_size, response, batch, group = (2, 8, 32, 2, 4) if quick else (10, 128, 160, 8, 8)
    run_dir = workdir / "embedded_smollm2"
    overrides = [
        "algorithm_preset=gepo",
        "hetero.mode=replay",
        f"hetero.device={device}",
        "hetero.delay.low=1",
        "hetero.delay.high=2",
        "hetero.max_delay=2",
        "task.name=math",
        "task.model=smollm2-135m-instruct",
        "task.dataset=gsm8k",
        *(
            f"+task.{key}.{k}={v}"
            for key, split in (("dataset_options", "train"), ("eval_dataset_options", "test"))
            for k, v in (("split", split), ("max_steps", 2), ("max_answer", 100), ("max_question_chars", 200))
        ),
        "task.eval_dataset=gsm8k",
        f"task.eval_size={eval_size}",
        "task.eval_temperature=0.5",
        "task.template=chat_1shot",
        "actor_rollout_ref.rollout.temperature=0.5",
        f"actor_rollout_ref.rollout.n={group}",
        f"data.train_batch_size={batch}",
        f"data.max_response_length={response}",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]
    budget = float(os.environ.get("LANE_PART_BUDGET_S", "150"))
    t0 = time.time()
    rc, tail = _main_gepo(overrides, workdir, timeout=max(5.0, budget - (t0 - START)))
    emit(
        _engine_row(
            "embedded_smollm2",
            f"replay, {device}, {steps} steps, G={group}, {batch} prompts a step",
            run_dir,
            rc,
            tail,
            time.time() - t0,
            f"math_verify accuracy on {eval_size} easy GSM8K test problems, T=0.5, "
            "SmolLM2's own chat template with one worked example (chat_1shot, as cpu_smollm2_math)",
        )
    )


#: the verl engine on one GPU: cpu_toy's settings with the device switched (a first attempt: this
#: combination has not run on a GPU yet, and its row says what happened). Two logical GPUs on the
#: one card (the learner's pool and the samplers' pool ask for one each), and Ray told to leave
#: CUDA_VISIBLE_DEVICES alone so both see the card. The hf_cpu rollout server's model goes to the
#: device of its replica's worker (verl_ext/cpu/rollout.py worker_placement), so on CUDA here. A
#: risk this cannot check on CPU: under that Ray setting verl's Worker calls set_device(<its Ray GPU
#: id>), and one of the two pools holds logical GPU 1, which a one-GPU machine does not have.
VERL_GPU_OVERRIDES = [
    "trainer.device=cuda",
    "ray_kwargs.ray_init.num_gpus=2",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
]
VERL_GPU_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def verl_toy(device: str, quick: bool, emit: Callable[[Row], None], workdir: Path) -> None:
    run_dir = workdir / "verl_toy"
    overrides = [
        "+verl_preset=cpu_toy",
        "hetero.engine=verl",
        "algorithm_preset=gepo",
        "trainer.total_training_steps=3",
        f"trainer.default_local_dir={run_dir}",
        f"task.cache_dir={workdir / 'cache'}",
        "trainer.resume_mode=disable",
    ]
    if device != "cpu":
        overrides += VERL_GPU_OVERRIDES
    budget = float(os.environ.get("LANE_PART_BUDGET_S", "150"))
    t0 = time.time()
    rc, tail = _main_gepo(
        overrides,
        workdir,
        timeout=max(5.0, budget - (t0 - START)),
        config_dir=True,
        env=VERL_GPU_ENV if device != "cpu" else None,
    )
    emit(
        _engine_row(
            "verl_toy",
            f"verl engine, GEPO, delayed sync, {device}",
            run_dir,
            rc,
            tail,
            time.time() - t0,
            "FSDP2 learner on the device, hf_cpu rollout server on its replica worker's device, toy",
        )
    )


PARTS: dict[str, Callable[..., None]] = {
    "loss_precision": loss_precision,
    "loss_speed": loss_speed,
    "embedded_toy": embedded_toy,
    "embedded_smollm2": embedded_smollm2,
    "logprob_spread": logprob_spread,
    "verl_toy": verl_toy,
}
START = time.time()


# ---------------------------------------------------------------------------------------------
# the driver


def run_part(part: str, args, budget: float, workdir: Path) -> list[Row]:
    """One part in its own process, killed (with what it started) at ``budget`` seconds."""
    rows_file = workdir / f"rows_{part}.jsonl"
    rows_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        part,
        "--device",
        args.device,
        "--rows-file",
        str(rows_file),
        "--workdir",
        str(workdir),
    ] + (["--quick"] if args.quick else [])
    env = dict(
        os.environ,
        LANE_PART_BUDGET_S=f"{budget:.0f}",
        LANE_LOSSES=args.losses,
        LANE_TOY_RUNS=args.toy_runs,
        PYTHONUNBUFFERED="1",
    )
    log = workdir / f"part_{part}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    rows = (
        [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()] if rows_file.is_file() else []
    )
    if rc is None:
        rows.append(
            make_row(
                part,
                "(part)",
                "error",
                f"timed out after its budget of {budget:.0f} s; rows above are what it finished",
            )
        )
    elif rc != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-4:]
        rows.append(make_row(part, "(part)", "error", f"exit {rc}: {' | '.join(tail)}"[:500]))
    elif not rows:
        rows.append(make_row(part, "(part)", "error", "finished without a row"))
    return rows


def child(part: str, device: str, quick: bool, rows_file: Path, workdir: Path) -> int:
    def emit(row: Row) -> None:
        with open(rows_file, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    try:
        PARTS[part](device, quick, emit, workdir)
    except Exception as exc:  # noqa: BLE001 -- the part's error becomes its row
        traceback.print_exc()
        emit(make_row(part, "(part)", "error", f"{type(exc).__name__}: {exc}"[:500]))
    return 0


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value or math.isinf(value):
            return str(value)
        if value == 0 or 1e-2 <= abs(value) < 1e4:
            return f"{value:.3g}"
        return f"{value:.1e}"
    return str(value)


def render(result: dict) -> str:
    lines = [
        f"GPU lane on {result['device_name']} ({result['device']}), torch {result['torch']}, "
        f"{'quick' if result['quick'] else 'full'} sizes, {result['wall_s']:.0f} s in all",
        "",
        "| part | row | status | numbers | note |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        numbers = ", ".join(f"{k} {_fmt(v)}" for k, v in row["values"].items())
        note = str(row["note"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {row['part']} | {row['name']} | {row['status']} | {numbers} | {note} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts",
        default=DEFAULT_ORDER,
        help=f"comma-separated, run in the order given, of: {', '.join(PARTS)} (default all, the cheap ones "
        f"first: {DEFAULT_ORDER.replace(',', ', ')})",
    )
    parser.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (the CPU run of the test suite)")
    parser.add_argument(
        "--losses",
        default="all",
        help="loss_precision, loss_speed: comma-separated labels of scripts/bench/bench_losses.py's list (default all)",
    )
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds for everything, install included")
    parser.add_argument(
        "--part-s",
        default="",
        help="seconds for some parts instead of their defaults, e.g. verl_toy=200,embedded_smollm2=150",
    )
    parser.add_argument(
        "--toy-runs",
        default="all",
        help="embedded_toy: comma-separated runs of replay-fp32, async-fp32, replay-bf16 (default all)",
    )
    parser.add_argument("--parts-dir", type=Path, default=None, help="packed parts + manifest.json: install them first")
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="install nothing: use this Python, plus --site if an earlier run installed there",
    )
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "heterorl_site")
    parser.add_argument("--out", type=Path, default=None, help="lane.json + lane.md (default $OUT, else lane_out)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.device, args.quick, args.rows_file, args.workdir)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}: choose from {','.join(PARTS)}")
    part_s = {}
    for item in filter(None, (i.strip() for i in args.part_s.split(","))):
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--part-s {item!r}: expected PART=SECONDS with PART one of {','.join(PARTS)}")
        part_s[name] = float(seconds)
    out = args.out or Path(os.environ.get("OUT") or "lane_out")
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + args.budget_s
    rows: list[Row] = []
    if args.no_install:
        if args.site.is_dir():
            use_site(args.site)
            rows.append(make_row("install", "(install)", "ok", f"none: {args.site} from an earlier run"))
    elif args.parts_dir is not None:
        try:
            for line in install(args.parts_dir, args.site, Path(tempfile.gettempdir()) / "heterorl_stage"):
                rows.append(make_row("install", line.split(":")[0], "ok", line))
        except Exception as exc:  # noqa: BLE001 -- the parts still run, and say what they miss
            rows.append(make_row("install", "(install)", "error", f"{type(exc).__name__}: {exc}"[:500]))
        use_site(args.site)
        rows.append(make_row("install", "time", "ok", wall_s=time.time() - start))
    import torch

    device_name = (
        torch.cuda.get_device_name(0)
        if args.device.startswith("cuda") and torch.cuda.is_available()
        else (platform.processor() or platform.machine())
    )
    print(f"lane: {device_name}, torch {torch.__version__}, parts {','.join(parts)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="heterorl_lane_") as tmp:
        workdir = Path(tmp)
        for part in parts:
            left = deadline - time.time() - RESERVE_S
            budget = min(part_s.get(part, PART_BUDGET_S[part][1 if args.quick else 0]), left)
            if budget < MIN_PART_S:
                rows.append(
                    make_row(
                        part,
                        PART_NAMES[part],
                        "skipped: budget",
                        f"{max(budget, 0):.0f} s for it ({max(left, 0):.0f} s left of {args.budget_s:.0f})",
                    )
                )
                continue
            t0 = time.time()
            part_rows = run_part(part, args, budget, workdir)
            rows += part_rows
            print(f"part {part} ({PART_NAMES[part]}): {len(part_rows)} row(s), {time.time() - t0:.0f} s", flush=True)
            for r in part_rows:
                print("  ", json.dumps(r)[:400], flush=True)
            write_result(out, args, device_name, parts, start, rows)  # after each part: a killed lane keeps its rows
    table = write_result(out, args, device_name, parts, start, rows)
    print("\n" + table, flush=True)
    return 0


def write_result(out: Path, args, device_name: str, parts: list[str], start: float, rows: list[Row]) -> str:
    import torch

    result = {
        "device": args.device,
        "device_name": device_name,
        "torch": torch.__version__,
        "quick": args.quick,
        "parts": parts,
        "wall_s": time.time() - start,
        "rows": rows,
    }
    table = render(result)
    (out / "lane.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "lane.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    sys.exit(main())
