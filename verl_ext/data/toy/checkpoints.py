"""The toy model's checkpoints: the pinned supervised warm start, its identity, and which one a run trains.

* :func:`warm_start` -- exactly N supervised steps from a seed (N per answer format by default,
  :data:`DEFAULT_WARM_START_STEPS`), saved as a normal HF folder and cached by its settings; the
  same weights at every build on one machine, not across CPUs (its docstring).
* :func:`weights_sha256` -- the identity of a model folder's weights.
* :func:`resolve_toy_model` -- the model both engines train for the toy task: a given
  folder, else the toy task's warm start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from verl_ext.data.toy.cache import cached_folder, settings_key
from verl_ext.data.toy.model import new_toy_model
from verl_ext.data.toy.problems import (
    check_answer_format,
    check_digits,
    correct_response,
    make_problem,
    make_problems,
    toy_data_source,
)
from verl_ext.data.toy.scoring import toy_accuracy

__all__ = [
    "WARM_START_INFO",
    "PINNED_WARM_STARTS",
    "DEFAULT_WARM_START_STEPS",
    "default_warm_start_steps",
    "warm_start",
    "warm_start_folder",
    "weights_sha256",
    "resolve_toy_model",
]

logger = logging.getLogger(__name__)

#: name of the json file warm_start writes next to the model (accuracy, settings, weights sha256)
WARM_START_INFO = "warm_start.json"
#: warm starts shipped with the package, each in the folder its settings name in a cache
#: (:func:`warm_start_folder`): the defaults' weights, the same bytes on every machine, where a
#: build depends on the CPU (:func:`warm_start`)
PINNED_WARM_STARTS = Path(__file__).resolve().parent / "pinned"
# bump when the training recipe changes, so old cache entries are not reused
_RECIPE_VERSION = 1

#: supervised steps of the default warm start per answer format, chosen on the default task
#: (3 digits, seed 0; held-out sampled accuracy at temperature 1.0 on 256 problems); both ship
#: with the package (:data:`PINNED_WARM_STARTS`), so every machine uses the same bytes:
#: short: 850 steps -> 0.484 (weights sha256 5b6147d9...). The bare 3-digit sum sits on a plateau
#: near 0 and leaves it at a step that depends on the CPU's kernels: on the earlier machines at
#: ~575 (675 steps gave 0.496), on the machine of 2026-11-25 later (675: 0.004, 750: 0.051, 850:
#: 0.484; ``python -m verl_ext.data.toy --cache-dir DIR --steps N --train``), hence 850, built there.
#: scratchpad: 210 steps -> 0.227 (weights sha256 8e41c357..., powered_long's warm start; the
#: study's 200-step conditions ran from another CPU's build, e0af1dc2..., 0.242, not shipped);
#: writing the columns out makes every digit a local function, learnt sooner.
DEFAULT_WARM_START_STEPS = {"short": 850, "scratchpad": 210}


def default_warm_start_steps(answer_format: str = "short") -> int:
    """:data:`DEFAULT_WARM_START_STEPS` of ``answer_format``."""
    return DEFAULT_WARM_START_STEPS[check_answer_format(answer_format)]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def warm_start(
    cache_dir: str | os.PathLike,
    digits: int = 3,
    *,
    steps: int | None = None,
    seed: int = 0,
    answer_format: str = "short",
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup_steps: int = 50,
    n_eval: int = 256,
    use_shipped: bool = True,
) -> Path:
    """Supervised warm start of the tiny model; returns the cached HF folder, or the shipped one.

    Exactly ``steps`` AdamW steps (betas 0.9/0.98, no weight decay, linear learning-rate warm-up
    over ``warmup_steps`` steps then constant, gradient clip 1.0) on fresh random problems from
    ``random.Random(seed)`` (cross-entropy on the response and ``</s>`` only), with deterministic
    torch ops and one torch thread, then one evaluation for the record (``n_eval`` held-out
    problems, seed ``seed + 10**6``, sampled at temperature 1 with seed ``seed + steps``). No clock
    and no accuracy decide anything, so every build on one machine gives the same weights, checked
    by ``weights_sha256`` in :data:`WARM_START_INFO` (one and two threads gave the same weights
    here, ``docs/study.md``; two threads ran 13x slower on a loaded machine). Another CPU may not:
    torch and MKL choose their kernels by the CPU's instruction set and sum in another order, and
    the training amplifies the last bits (``research/bench/warm_start_kernels.py``: other kernel
    settings on one CPU, other weights each). So the warm starts everything here uses by default
    ship with the package (:data:`PINNED_WARM_STARTS`, one folder per settings, named as in the
    cache): with ``use_shipped`` (the default) a shipped folder of the same settings is returned
    as it is, the same bytes on every machine; ``use_shipped=False`` trains (the recipe itself).

    The folder holds the model (safetensors), the tokenizer and :data:`WARM_START_INFO`
    (``accuracy``, ``steps``, ``seconds`` (wall, evaluation included), ``train_seconds``,
    ``cpu_seconds``, ``final_loss``, ``versions``, ``settings``, ``weights_sha256``). It lives at
    ``cache_dir/<toy_data_source>-pin<steps>-<hash of the settings>`` (``toy_add3-pin850-...``,
    ``toy_add3_scratch-pin210-...``); a second call with the same settings returns it without
    training (a file lock serialises concurrent calls).

    Args:
        cache_dir: folder for cached checkpoints (created if missing).
        digits: operand digits (1..9).
        steps: optimizer steps (>= 1); None: :func:`default_warm_start_steps` of ``answer_format``
            (calibrated on 3 digits).
        seed: seeds the model init, the training problems and the evaluation sampling.
        answer_format: "short" (the sum) or "scratchpad" (long answers, see
            :mod:`verl_ext.data.toy.problems`).
        batch_size: problems per optimizer step.
        lr: AdamW peak learning rate.
        warmup_steps: optimizer steps of linear learning-rate warm-up.
        n_eval: held-out problems of the final evaluation (one sample each).
        use_shipped: return the package's copy when it has one for these settings.
    """
    name, settings = _pinned_settings(digits, steps, seed, answer_format, batch_size, lr, warmup_steps, n_eval)
    shipped = PINNED_WARM_STARTS / f"{name}-{settings_key(settings)}"
    if use_shipped and (shipped / WARM_START_INFO).is_file():
        return shipped

    def build(folder: Path) -> None:
        with _one_thread_deterministic():
            model, tok, info = _train(settings)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        info["weights_sha256"] = weights_sha256(folder)
        (folder / WARM_START_INFO).write_text(json.dumps(info, indent=2) + "\n")

    return cached_folder(cache_dir, name, settings, build, done_file=WARM_START_INFO)


def warm_start_folder(cache_dir: str | os.PathLike, digits: int = 3, **kwargs: Any) -> Path:
    """The folder :func:`warm_start` with the same arguments returns, built or not (its name is
    the settings' key, the same on every machine): where a copy of pinned weights goes so that
    ``warm_start`` uses it instead of training."""
    name, settings = _pinned_settings(digits, **kwargs)
    return Path(cache_dir) / f"{name}-{settings_key(settings)}"


def _pinned_settings(
    digits: int = 3,
    steps: int | None = None,
    seed: int = 0,
    answer_format: str = "short",
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup_steps: int = 50,
    n_eval: int = 256,
) -> tuple[str, dict]:
    """(folder name stem, settings) of a warm start, every argument checked (:func:`warm_start`)."""
    digits = check_digits(digits)
    answer_format = check_answer_format(answer_format)
    steps = default_warm_start_steps(answer_format) if steps is None else steps
    _check_int("steps", steps, 1)
    _check_int("seed", seed, 0)
    for name, value, minimum in (
        ("batch_size", batch_size, 1),
        ("warmup_steps", warmup_steps, 0),
        ("n_eval", n_eval, 1),
    ):
        _check_int(name, value, minimum)
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    settings = {
        "recipe_version": _RECIPE_VERSION,
        "mode": "pinned",  # the only mode now; kept so the cache keys of existing folders stay valid
        "digits": digits,
        "answer_format": answer_format,
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": float(lr),
        "warmup_steps": warmup_steps,
        "n_eval": n_eval,
        "eval_temperature": 1.0,
    }
    return f"{toy_data_source(digits, answer_format)}-pin{steps}", settings


@contextlib.contextmanager
def _one_thread_deterministic():
    """One torch thread and ``torch.use_deterministic_algorithms(True)`` inside the block, the
    previous settings after."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def _train_batch(rng: random.Random, batch_size: int, digits: int, tokenizer, answer_format: str):
    """Token ids and labels of ``batch_size`` fresh problems (prompt + correct response + ``</s>``);
    the prompt's labels are -100 (random operands, not learnable)."""
    import torch

    hi = 10**digits
    rows = []
    for _ in range(batch_size):
        a, b = rng.randrange(hi), rng.randrange(hi)
        prompt, _ = make_problem(a, b, digits)
        response = correct_response(a, b, digits, answer_format)
        rows.append(tokenizer(prompt + response)["input_ids"] + [tokenizer.eos_token_id])
    ids = torch.tensor(rows)
    labels = ids.clone()
    labels[:, : 1 + 2 * digits + 2] = -100  # <s> and the prompt
    return ids, labels


def _train(settings: dict):
    """``(model, tokenizer, info)`` after exactly ``settings["steps"]`` supervised steps and one
    held-out evaluation; the caller sets threads and determinism (:func:`_one_thread_deterministic`)."""
    import torch
    import transformers

    digits, answer_format, seed = settings["digits"], settings["answer_format"], settings["seed"]
    model, tok = new_toy_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    warmup = settings["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / max(1, warmup)))
    rng = random.Random(seed)
    t0, c0 = time.monotonic(), time.process_time()
    model.train()
    loss = None
    for _ in range(settings["steps"]):
        ids, labels = _train_batch(rng, settings["batch_size"], digits, tok, answer_format)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    final_loss = loss.item()
    train_seconds = time.monotonic() - t0
    model.eval()
    held_out = make_problems(settings["n_eval"], digits=digits, seed=seed + 10**6, answer_format=answer_format)
    acc = toy_accuracy(model, tok, held_out, temperature=1.0, seed=seed + settings["steps"])
    logger.info(
        "toy warm start: %d steps, %.1f s, last loss %.3f, accuracy %.3f",
        settings["steps"],
        train_seconds,
        final_loss,
        acc,
    )
    info = {
        "accuracy": acc,
        "stop_reason": "steps",
        "steps": settings["steps"],
        "seconds": round(time.monotonic() - t0, 2),
        "train_seconds": round(train_seconds, 2),
        "cpu_seconds": round(time.process_time() - c0, 2),
        "eval_temperature": 1.0,
        "n_eval": settings["n_eval"],
        "final_loss": final_loss,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": settings,
    }
    return model, tok, info


def weights_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of a model folder's weights: over every ``*.safetensors`` tensor, in sorted
    name order, of its name, dtype, shape and raw bytes -- independent of the file's metadata and
    tensor layout, so equal weights give equal hashes on any machine."""
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def resolve_toy_model(model_path: str, task_name: str, **warm_start_kwargs: Any) -> str:
    """The model both engines train: ``model_path`` if given (a local HF folder), else for
    ``task.name=toy_addition`` the cached :func:`warm_start` (``warm_start_kwargs`` are its arguments)."""
    if model_path:
        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"actor_rollout_ref.model.path={model_path!r} is not a local model folder")
        return str(model_path)
    if task_name != "toy_addition":
        raise ValueError(
            f"actor_rollout_ref.model.path is required for task.name={task_name} (no model hub here), "
            f"or a built-in model: task.model=smollm2-135m-instruct"
        )
    return str(warm_start(**warm_start_kwargs))
