"""The toy task: zero-padded n-digit addition, learned by a ~1M-parameter Llama on CPU.

``"047+385="`` -> ``"0432"``: both operands have exactly ``digits`` digits (zero-padded) and the
sum has ``digits + 1``. Zero padding makes every sequence the same length and the carry
positions fixed, which is what lets a tiny model learn it in a minute or two of CPU time.

Pieces:

* :func:`build_tokenizer` -- character-level ``PreTrainedTokenizerFast`` (WordLevel model from the
  ``tokenizers`` library): ``<pad>`` (id 0), ``<s>``, ``</s>``, ``<unk>``, the digits, ``+``, ``=``.
  Encoding adds ``<s>`` in front; left padding; decoding fuses characters (no spaces); a chat
  template (``<s>`` + message contents) so verl's chat-message prompts work unchanged.
* :func:`toy_model_config` -- the tiny Llama (hidden 128, 4 layers, 4 heads, FFN 512, tied
  embeddings).
* :func:`make_problems` -- benchmark records (same format as :func:`verl_ext.data.datasets.load_benchmark`).
* :func:`toy_accuracy` -- sampled accuracy through ``model.generate`` and the toy reward.
* :func:`warm_start` -- supervised training, saved as a normal HF folder and cached: *pinned*
  (``steps=N``: exactly N optimizer steps from a seed, the same weights on any machine, identified
  by :func:`weights_sha256`) or, the older way, until the sampled accuracy (temperature 1.0) first
  lands inside a target window (depends on the machine's speed through its time budget).
* :func:`weights_sha256` -- the identity of a model folder's weights.

Long answers (``answer_format="scratchpad"``): the response first writes out every column of the
addition, least significant first, as five digits ``a_i b_i c_i s_i`` (the two operand digits,
the carry coming in, and the two-digit column sum a_i + b_i + c_i), then ``=`` and the
zero-padded sum: ``"047+385="`` -> ``"75012" "48113" "03104" "=0432"`` (21 tokens with ``</s>``
for 3 digits, 27 for 4). Only the final sum is rewarded (:func:`scratchpad_score`), as in math RL
where only the final answer is checked; the scratchpad gives the policy 20-60 tokens per
response, the regime where length-normalised and token-level importance weights differ.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "SPECIAL_TOKENS",
    "CHARS",
    "build_tokenizer",
    "toy_model_config",
    "make_problem",
    "make_problems",
    "ANSWER_FORMATS",
    "scratchpad_response",
    "scratchpad_score",
    "response_length",
    "toy_accuracy",
    "warm_start",
    "weights_sha256",
    "load_toy_model",
    "WARM_START_INFO",
]

logger = logging.getLogger(__name__)

#: special tokens, in id order 0..3
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
#: the task's characters, ids 4..15
CHARS = tuple("0123456789+=")
#: name of the json file warm_start writes next to the model (accuracy, settings, history)
WARM_START_INFO = "warm_start.json"
# bump when the training recipe changes, so old cache entries are not reused
_RECIPE_VERSION = 1
#: answer formats: "short" (the sum only) and "scratchpad" (column sums and carries, then the sum)
ANSWER_FORMATS = ("short", "scratchpad")
_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _check_digits(digits: Any) -> int:
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"digits must be an int in 1..9, got {digits!r}")
    return digits


# ---------------------------------------------------------------------------------------------
# tokenizer and model


def build_tokenizer(model_max_length: int = 64):
    """The character tokenizer as a ``transformers.PreTrainedTokenizerFast``.

    Args:
        model_max_length: longest sequence in tokens the tokenizer reports (prompt + answer of a
            9-digit problem is 32 tokens).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    core.decoder = decoders.Fuse()  # join characters without spaces
    bos = SPECIAL_TOKENS["bos_token"]
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        model_max_length=model_max_length,
        padding_side="left",
        chat_template=_CHAT_TEMPLATE,
        **SPECIAL_TOKENS,
    )
    return tok


def toy_model_config(tokenizer=None, **overrides):
    """``LlamaConfig`` of the tiny model (~0.8M parameters); ``overrides`` replace fields.

    hidden 128, 4 layers, 4 attention heads (head dim 32, no GQA), FFN 512, tied input/output
    embeddings, 64 positions, vocabulary and special-token ids from ``tokenizer`` (default: a
    fresh :func:`build_tokenizer`).
    """
    from transformers import LlamaConfig

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    fields = dict(
        vocab_size=len(tok),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


# ---------------------------------------------------------------------------------------------
# problems


def make_problem(a: int, b: int, digits: int) -> tuple[str, str]:
    """``(prompt, answer)`` for ``a + b``: ``make_problem(47, 385, 3) == ("047+385=", "0432")``."""
    _check_digits(digits)
    hi = 10**digits
    for name, v in (("a", a), ("b", b)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < hi:
            raise ValueError(f"{name} must be an int in [0, {hi}) for {digits} digits, got {v!r}")
    return f"{a:0{digits}d}+{b:0{digits}d}=", f"{a + b:0{digits + 1}d}"


def _check_format(answer_format: Any) -> str:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    return answer_format


def scratchpad_response(a: int, b: int, digits: int) -> str:
    """The scratchpad target for ``a + b`` (without ``</s>``): per column from the least
    significant, ``a_i b_i c_i`` and the two-digit sum ``a_i + b_i + c_i``, then ``=`` and the
    zero-padded sum. ``scratchpad_response(47, 385, 3) == "750124811303104=0432"``."""
    _, answer = make_problem(a, b, digits)  # validates
    sa, sb = f"{a:0{digits}d}", f"{b:0{digits}d}"
    carry, cols = 0, []
    for i in range(digits - 1, -1, -1):
        da, db = int(sa[i]), int(sb[i])
        total = da + db + carry
        cols.append(f"{da}{db}{carry}{total:02d}")
        carry = total // 10
    return "".join(cols) + "=" + answer


def response_length(digits: int, answer_format: str = "short") -> int:
    """Tokens of a correct response including ``</s>``: digits + 2 (short), 6 digits + 3 (scratchpad)."""
    _check_digits(digits)
    return digits + 2 if _check_format(answer_format) == "short" else 5 * digits + 1 + digits + 1 + 1


def scratchpad_score(response: str, answer: str) -> float:
    """1.0 iff the response has an ``=`` and the leading digits after the first one equal
    ``answer`` exactly; the scratchpad itself is not checked. The long-answer reward
    (:func:`verl_ext.rewards.scratchpad_reward.compute_score`), as a float."""
    from verl_ext.rewards import scratchpad_reward

    return float(scratchpad_reward.compute_score("toy_scratch", response, answer)["acc"])


def make_problems(n: int, digits: int = 3, seed: int = 0, answer_format: str = "short") -> list[dict]:
    """``n`` random problems (operands uniform in [0, 10^digits), drawn with ``random.Random(seed)``).

    Returns benchmark records: ``{"id": "toy_add3/<seed>/<i>", "problem": "047+385=",
    "answer": "0432", "data_source": "toy_add3", "meta": {"a": 47, "b": 385, "digits": 3}}``.
    With ``answer_format="scratchpad"`` the operands are the same, ``meta`` also has
    ``"answer_format": "scratchpad"`` and ``"target"`` (the full scratchpad response), and
    ``data_source`` is ``toy_add<digits>_scratch``; ``answer`` stays the sum.
    """
    _check_format(answer_format)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    _check_digits(digits)
    rng = random.Random(seed)
    hi = 10**digits
    out = []
    for i in range(n):
        a, b = rng.randrange(hi), rng.randrange(hi)
        prompt, answer = make_problem(a, b, digits)
        rec = {
            "id": f"toy_add{digits}/{seed}/{i}",
            "problem": prompt,
            "answer": answer,
            "data_source": f"toy_add{digits}",
            "meta": {"a": a, "b": b, "digits": digits},
        }
        if answer_format == "scratchpad":
            rec["id"] = f"toy_add{digits}_scratch/{seed}/{i}"
            rec["data_source"] = f"toy_add{digits}_scratch"
            rec["meta"].update(answer_format="scratchpad", target=scratchpad_response(a, b, digits))
        out.append(rec)
    return out


def _is_scratchpad(problem: dict) -> bool:
    return (problem.get("meta") or {}).get("answer_format") == "scratchpad"


# ---------------------------------------------------------------------------------------------
# evaluation


def toy_accuracy(
    model,
    tokenizer,
    problems: list[dict],
    temperature: float = 1.0,
    *,
    batch_size: int = 256,
    seed: int = 0,
    max_new_tokens: int | None = None,
    return_completions: bool = False,
):
    """Fraction of ``problems`` whose generated sum is exactly right (toy reward, 0..1).

    One completion per problem through ``model.generate`` (left-padded batches, so problems of
    different lengths can share a batch); ``temperature == 0`` is greedy, otherwise plain
    sampling (no top-k / top-p) at that temperature. The torch RNG is seeded with ``seed`` inside
    a forked RNG state, so the caller's RNG is untouched and results repeat.

    Args:
        problems: records from :func:`make_problems` (``problem`` and ``answer`` used).
        max_new_tokens: default: longest answer + 1 (room for ``</s>``).
        return_completions: also return the decoded completions (list of str, problem order).

    Returns:
        accuracy (float), or ``(accuracy, completions)``.
    """
    import torch

    from verl_ext.rewards.dispatch import compute_score
    from verl_ext.sampling import generate

    if not problems:
        raise ValueError("toy_accuracy needs at least one problem")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if max_new_tokens is None:
        max_new_tokens = max(len(p["meta"]["target"]) if _is_scratchpad(p) else len(p["answer"]) for p in problems) + 1
    was_training = model.training
    model.eval()
    completions: list[str] = []
    try:
        # one seeded random stream across the batches (generate(seed=None) draws from it), in a
        # forked RNG state so the caller's stream is untouched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(problems), batch_size):
                chunk = problems[start : start + batch_size]
                enc = tokenizer([p["problem"] for p in chunk], return_tensors="pt", padding=True)
                gen = generate(
                    model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                    eos_token_ids=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    temperature=float(temperature), with_log_q=False,
                )  # fmt: skip
                completions.extend(tokenizer.batch_decode(gen.tokens, skip_special_tokens=True))
    finally:
        model.train(was_training)
    correct = sum(compute_score(p["data_source"], c, p["answer"])["acc"] for c, p in zip(completions, problems))
    acc = correct / len(problems)
    return (acc, completions) if return_completions else acc


# ---------------------------------------------------------------------------------------------
# warm start


def load_toy_model(path: str | os.PathLike):
    """``(model, tokenizer)`` from a :func:`warm_start` folder (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"not a model folder (no config.json): {str(path)!r}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model, tok


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """``n`` torch threads inside the block (None: ``OMP_NUM_THREADS`` if set, else 1), restored after."""
    import torch

    from verl_ext.torch_threads import set_torch_threads

    before = torch.get_num_threads()
    if n is None:
        set_torch_threads(1)
    else:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _train_batch(rng: random.Random, batch_size: int, digits: int, tokenizer, answer_format: str = "short"):
    import torch

    hi = 10**digits
    rows = []
    for _ in range(batch_size):
        a, b = rng.randrange(hi), rng.randrange(hi)
        prompt, answer = make_problem(a, b, digits)
        if answer_format == "scratchpad":
            answer = scratchpad_response(a, b, digits)
        rows.append(tokenizer(prompt + answer)["input_ids"] + [tokenizer.eos_token_id])
    ids = torch.tensor(rows)
    labels = ids.clone()
    labels[:, : 1 + 2 * digits + 2] = -100  # <s> and the prompt: random operands, not learnable
    return ids, labels


def warm_start(
    cache_dir: str | os.PathLike,
    digits: int = 3,
    target_accuracy: tuple[float, float] | None = None,
    max_seconds: float | None = None,
    seed: int = 0,
    *,
    steps: int | None = None,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup_steps: int = 50,
    eval_every: int | None = None,
    n_eval: int = 256,
    max_steps: int | None = None,
    num_threads: int | None = None,
    answer_format: str = "short",
) -> Path:
    """Supervised warm start of the tiny model; returns the cached HF folder.

    **Pinned** (``steps=N``): exactly N optimizer steps on the problem stream of ``seed``, with
    deterministic torch ops and one torch thread, then one evaluation (``n_eval`` held-out
    problems, seed ``seed + 10**6``, sampled at temperature 1 with seed ``seed + N``) for the
    record. No clock and no accuracy decide anything, so the weights are the same on any machine
    with the same torch/transformers versions (recorded), checked by ``weights_sha256`` in
    :data:`WARM_START_INFO`. ``target_accuracy``, ``max_seconds``, ``max_steps`` and
    ``eval_every`` belong to the window mode and are refused with ``steps``; ``num_threads``
    must be None or 1 (one and two threads gave the same weights here, ``docs/study.md``, but
    other BLAS builds may sum differently, and two threads ran 13x slower on a loaded machine).

    **Window** (``steps=None``, the older way): trains on fresh random problems (cross-entropy on the answer and ``</s>`` only) and every
    ``eval_every`` steps measures sampled accuracy at temperature 1.0 on ``n_eval`` held-out
    problems (seed ``seed + 10**6``); training stops at the FIRST evaluation whose accuracy lies in
    ``target_accuracy`` (inclusive). To keep evaluations cheap during the long initial plateau,
    each one first samples the first 64 held-out problems and skips the full evaluation when that
    screen is below half the window's low end (``history`` rows with ``n_problems == 64``).
    3-digit addition sits on a plateau (~1% accuracy) for ~700 steps, then rises by ~30 points
    per 100 steps; evaluating every 25 steps lands inside a 20-70% window. If the time or step budget runs out, or one evaluation jumps
    past the window, the model is saved anyway with ``"in_target": false`` and a warning.

    The folder holds the model (safetensors), the tokenizer and :data:`WARM_START_INFO`
    (``accuracy``, ``in_target``, ``steps``, ``seconds`` (wall), ``cpu_seconds``, ``history`` [[step, seconds, accuracy, n_problems]],
    ``settings``). It lives at ``cache_dir/toy_add<digits>-<hash of the settings>``; a second call
    with the same settings returns it without training (a file lock serialises concurrent calls).

    Args:
        cache_dir: folder for cached checkpoints (created if missing).
        digits: operand digits (1..9).
        target_accuracy: window mode: (low, high) window of held-out sampled accuracy,
            0 <= low <= high <= 1 (None: (0.3, 0.7)).
        max_seconds: window mode: wall-clock training budget in seconds, evaluation time
            included (None: 900).
        seed: seeds the model init, the training problems and the evaluation sampling.
        steps: pinned mode: optimizer steps (>= 1); None = window mode.
        batch_size: problems per optimizer step.
        lr: AdamW peak learning rate (linear warm-up over ``warmup_steps`` steps, then constant).
        warmup_steps: optimizer steps of linear learning-rate warm-up.
        eval_every: window mode: optimizer steps between accuracy evaluations (None: 25).
        n_eval: held-out problems per evaluation (one sample each).
        max_steps: optional cap on optimizer steps (None: only the time budget).
        num_threads: torch intra-op threads while training (restored afterwards). None (default):
            ``OMP_NUM_THREADS`` if set, else 1, because on a shared 2-core machine 2 threads ran
            5x slower (OpenMP waits); see ``verl_ext.torch_threads``.
        answer_format: "short" (the sum) or "scratchpad" (long answers, see the module doc);
            scratchpad folders are named ``toy_add<digits>_scratch-<hash>``.
    """
    digits = _check_digits(digits)
    answer_format = _check_format(answer_format)
    if steps is not None:
        return _pinned_warm_start(
            cache_dir, digits, seed, steps, answer_format, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
            n_eval=n_eval, num_threads=num_threads,
            window_args={"target_accuracy": target_accuracy, "max_seconds": max_seconds, "max_steps": max_steps,
                         "eval_every": eval_every},
        )  # fmt: skip
    target_accuracy = (0.3, 0.7) if target_accuracy is None else target_accuracy
    max_seconds = 900.0 if max_seconds is None else max_seconds
    eval_every = 25 if eval_every is None else eval_every
    lo, hi = _check_window(target_accuracy)
    for name, value, minimum in (
        ("batch_size", batch_size, 1),
        ("warmup_steps", warmup_steps, 0),
        ("eval_every", eval_every, 1),
        ("n_eval", n_eval, 1),
        ("num_threads", 1 if num_threads is None else num_threads, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
    if not (isinstance(max_seconds, (int, float)) and max_seconds > 0 and math.isfinite(max_seconds)):
        raise ValueError(f"max_seconds must be a finite number > 0, got {max_seconds!r}")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")

    settings = {
        "recipe_version": _RECIPE_VERSION,
        "digits": digits,
        "target_accuracy": [lo, hi],
        "max_seconds": float(max_seconds),
        "seed": seed,
        "batch_size": batch_size,
        "lr": float(lr),
        "warmup_steps": warmup_steps,
        "eval_every": eval_every,
        "n_eval": n_eval,
        "max_steps": max_steps,
        "eval_temperature": 1.0,
    }
    name = f"toy_add{digits}"
    if answer_format != "short":  # only then: the short task's cache keys stay what they were
        settings["answer_format"] = answer_format
        name = f"toy_add{digits}_scratch"
    def train():
        with _torch_threads(num_threads):
            return _train(settings)

    return _cached_warm_start(cache_dir, name, settings, train, with_hash=False)


def _cached_warm_start(cache_dir, name: str, settings: dict, train: Callable[[], tuple], with_hash: bool) -> Path:
    """``<cache_dir>/<name>-<hash of settings>``: trained by ``train()`` -> (model, tokenizer, info)
    the first time, under a file lock (one process trains, the others wait), written to a
    temporary folder and renamed into place, so a killed run never leaves a folder that looks
    finished. ``with_hash`` records the weights' sha256 in the info file."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"{name}-{key}"
    if (final / WARM_START_INFO).is_file():
        return final
    with _file_lock(cache_dir / f".{name}-{key}.lock"):
        if (final / WARM_START_INFO).is_file():  # another process finished it while we waited
            return final
        model, tok, info = train()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if with_hash:
                info["weights_sha256"] = weights_sha256(tmp)
            (tmp / WARM_START_INFO).write_text(json.dumps(info, indent=2) + "\n")
            if final.exists():  # a partial folder from a killed run (no info file): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _pinned_warm_start(cache_dir, digits: int, seed: int, steps: int, answer_format: str, *, batch_size: int,
                       lr: float, warmup_steps: int, n_eval: int, num_threads: int | None, window_args: dict) -> Path:
    """:func:`warm_start` with ``steps`` (see there)."""
    given = [k for k, v in window_args.items() if v is not None]
    if given:
        raise ValueError(f"warm_start(steps={steps!r}) is the pinned mode; {', '.join(given)} belong to the "
                         f"accuracy-window mode (steps=None) and are not used here: drop them")
    _check_int("steps", steps, 1)
    _check_int("seed", seed, 0)
    for name, value, minimum in (("batch_size", batch_size, 1), ("warmup_steps", warmup_steps, 0), ("n_eval", n_eval, 1)):
        _check_int(name, value, minimum)
    if num_threads not in (None, 1):
        raise ValueError(f"num_threads={num_threads!r}: a pinned warm start trains with one torch thread "
                         "(thread counts may change float sums on other builds; two ran 13x slower here)")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    settings = {
        "recipe_version": _RECIPE_VERSION,
        "mode": "pinned",
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
    name = f"toy_add{digits}" + ("" if answer_format == "short" else "_scratch") + f"-pin{steps}"

    def train():
        with _torch_threads(1), _deterministic_torch():
            return _train_pinned(settings)

    return _cached_warm_start(cache_dir, name, settings, train, with_hash=True)
    with _file_lock(cache_dir / f".{name}-{key}.lock"):
        if (final / WARM_START_INFO).is_file():
            return final
        with _torch_threads(1), _deterministic_torch():
            model, tok, info = _train_pinned(settings)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            info["weights_sha256"] = weights_sha256(tmp)
            (tmp / WARM_START_INFO).write_text(json.dumps(info, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _deterministic_torch():
    """``torch.use_deterministic_algorithms(True)`` inside the block, the previous setting after."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _new_toy_model(seed: int):
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = LlamaForCausalLM(toy_model_config(tok))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return model, tok


def _train_pinned(settings: dict):
    """Exactly ``settings["steps"]`` AdamW steps (linear warm-up, then constant; grad clip 1),
    one held-out evaluation at the end."""
    import torch
    import transformers

    digits, answer_format, seed = settings["digits"], settings["answer_format"], settings["seed"]
    model, tok = _new_toy_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    warmup = settings["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / max(1, warmup)))
    rng = random.Random(seed)
    t0, c0 = time.monotonic(), time.process_time()
    model.train()
    losses = []
    for _ in range(settings["steps"]):
        losses.append(_supervised_step(model, tok, opt, sched, rng, settings["batch_size"], digits, answer_format))
    train_seconds = time.monotonic() - t0
    model.eval()
    held_out = make_problems(settings["n_eval"], digits=digits, seed=seed + 10**6, answer_format=answer_format)
    acc = toy_accuracy(model, tok, held_out, temperature=1.0, seed=seed + settings["steps"])
    logger.info("toy pinned warm start: %d steps, %.1f s, last loss %.3f, accuracy %.3f",
                settings["steps"], train_seconds, losses[-1], acc)  # fmt: skip
    info = {
        "accuracy": acc,
        "in_target": None,
        "stop_reason": "steps",
        "steps": settings["steps"],
        "seconds": round(time.monotonic() - t0, 2),
        "train_seconds": round(train_seconds, 2),
        "cpu_seconds": round(time.process_time() - c0, 2),
        "eval_temperature": 1.0,
        "n_eval": settings["n_eval"],
        "final_loss": losses[-1],
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
        raise ValueError(f"actor_rollout_ref.model.path is required for task.name={task_name} (no model hub here)")
    return str(warm_start(**warm_start_kwargs))


def resolve_task_model(model_path: str, task: Any, seed: int) -> str:
    """:func:`resolve_toy_model` from a ``task:`` section (the typed ``TaskConfig`` or its
    DictConfig: both engines pass theirs). ``task.warm_start_steps`` > 0 pins the warm start (N
    steps, no accuracy window, no clock); 0 keeps the window/time-budget warm start."""
    steps = int(getattr(task, "warm_start_steps", 0) or 0)
    if steps > 0:
        how: dict[str, Any] = {"steps": steps}
    else:
        how = {"target_accuracy": tuple(task.warm_start_accuracy), "max_seconds": float(task.warm_start_max_seconds)}
    return resolve_toy_model(
        str(model_path or ""), str(task.name), cache_dir=str(task.cache_dir), digits=int(task.digits), seed=int(seed),
        answer_format=str(getattr(task, "answer_format", "short")), **how,
    )  # fmt: skip


def _supervised_step(model, tok, opt, sched, rng, batch_size: int, digits: int, answer_format: str) -> float:
    """One warm-start step (both modes): next-token loss on a fresh batch, grad clip 1.0, AdamW and
    schedule step; returns the loss."""
    import torch

    ids, labels = _train_batch(rng, batch_size, digits, tok, answer_format)
    loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def _check_window(target_accuracy) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in target_accuracy)
    except (TypeError, ValueError):
        raise ValueError(f"target_accuracy must be a (low, high) pair, got {target_accuracy!r}") from None
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"target_accuracy must satisfy 0 <= low <= high <= 1, got {target_accuracy!r}")
    return lo, hi


def _train(settings: dict):
    import torch

    digits = settings["digits"]
    answer_format = settings.get("answer_format", "short")
    lo, hi = settings["target_accuracy"]
    seed = settings["seed"]
    model, tok = _new_toy_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    warmup = settings["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / max(1, warmup)))
    rng = random.Random(seed)
    held_out = make_problems(settings["n_eval"], digits=digits, seed=seed + 10**6, answer_format=answer_format)
    screen = held_out[:64]

    history: list[list[float]] = []
    t0 = time.monotonic()
    c0 = time.process_time()
    step = 0
    acc = 0.0
    stop_reason = "time"
    model.train()
    while True:
        loss = _supervised_step(model, tok, opt, sched, rng, settings["batch_size"], digits, answer_format)
        step += 1
        out_of_steps = settings["max_steps"] is not None and step >= settings["max_steps"]
        out_of_time = time.monotonic() - t0 >= settings["max_seconds"]
        if step % settings["eval_every"] == 0 or out_of_steps or out_of_time:
            last_chance = out_of_steps or out_of_time
            if not last_chance and len(screen) < len(held_out):
                # cheap screen on the first problems: far below the window, skip the full evaluation
                screen_acc = toy_accuracy(model, tok, screen, temperature=1.0, seed=seed + step)
                if screen_acc < lo / 2:
                    history.append([step, round(time.monotonic() - t0, 2), screen_acc, len(screen)])
                    continue
            acc = toy_accuracy(model, tok, held_out, temperature=1.0, seed=seed + step)
            elapsed = time.monotonic() - t0
            history.append([step, round(elapsed, 2), acc, len(held_out)])
            logger.info("toy warm start: step %d, %.1f s, loss %.3f, accuracy %.3f", step, elapsed, loss, acc)
            if lo <= acc <= hi:
                stop_reason = "in_target"
                break
            if acc > hi:
                stop_reason = "overshot"
                break
            if out_of_steps:
                stop_reason = "max_steps"
                break
            if out_of_time:
                stop_reason = "time"
                break
    seconds = time.monotonic() - t0
    if stop_reason != "in_target":
        logger.warning(
            "toy warm start stopped (%s) at step %d with accuracy %.3f outside the target window [%.2f, %.2f]",
            stop_reason,
            step,
            acc,
            lo,
            hi,
        )
    model.eval()
    info = {
        "accuracy": acc,
        "in_target": stop_reason == "in_target",
        "stop_reason": stop_reason,
        "steps": step,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(time.process_time() - c0, 2),
        "eval_temperature": 1.0,
        "n_eval": settings["n_eval"],
        "history": history,
        "settings": settings,
    }
    return model, tok, info


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_ext.data.toy --cache-dir DIR [--digits 3] (--steps N | --low 0.3 --high 0.7)``:
    warm start, print the folder (and, pinned, its weights' sha256)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m verl_ext.data.toy", description="toy addition warm start")
    parser.add_argument("--cache-dir", required=True, help="folder for cached checkpoints")
    parser.add_argument("--digits", type=int, default=3, help="operand digits")
    parser.add_argument("--steps", type=int, default=None, help="pinned: exactly this many optimizer steps")
    parser.add_argument("--low", type=float, default=None, help="window mode: low end of the accuracy window (0.3)")
    parser.add_argument("--high", type=float, default=None, help="window mode: high end of the accuracy window (0.7)")
    parser.add_argument("--max-seconds", type=float, default=None, help="window mode: wall-clock budget (900)")
    parser.add_argument("--seed", type=int, default=0, help="seed of init, data and evaluation")
    parser.add_argument("--answer-format", default="short", choices=ANSWER_FORMATS, help="short sums or scratchpad")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    window = None
    if args.low is not None or args.high is not None:
        window = (0.3 if args.low is None else args.low, 0.7 if args.high is None else args.high)
    path = warm_start(args.cache_dir, args.digits, window, args.max_seconds, args.seed, steps=args.steps,
                      answer_format=args.answer_format)  # fmt: skip
    info = json.loads((path / WARM_START_INFO).read_text())
    where = "pinned" if info["stop_reason"] == "steps" else f"in target: {info['in_target']}"
    print(
        f"{path}\naccuracy {info['accuracy']:.3f} ({where}), {info['steps']} steps, "
        f"training {info['seconds']:.1f} s wall / {info['cpu_seconds']:.1f} s CPU; this call {time.monotonic() - t0:.1f} s"
    )
    if "weights_sha256" in info:
        print(f"weights sha256 {info['weights_sha256']}")
    return 0 if info["in_target"] is not False else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
