"""The toy task as files verl's own trainer reads: a HF model folder and train/val parquet.

    python -m verl_ext.data.toy_assets --out runs/verl_toy            # untrained toy model
    python -m verl_ext.data.toy_assets --out runs/verl_toy --warm-start .cache/heterorl

verl's ``main_ppo`` takes ``actor_rollout_ref.model.path``, ``data.train_files`` and
``data.val_files``; this writes all three (idempotent: existing files are kept) for the ~1M-parameter
character-level Llama of :mod:`verl_ext.data.toy`. Rewards come from
``reward.custom_reward_function.path=pkg://verl_ext.rewards.dispatch`` (``data_source`` toy_add<d>
or toy_add<d>_scratch, :func:`verl_ext.data.toy.problems.toy_data_source`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from verl_ext.data.prepare import write_verl_parquet
from verl_ext.rundir import private_tmp
from verl_ext.data.toy.problems import ANSWER_FORMATS, check_answer_format, make_problems, toy_data_source


@dataclass(frozen=True)
class ToyAssets:
    model_path: Path
    train_file: Path
    val_file: Path


def _save_untrained_model(path: Path, seed: int) -> None:
    from verl_ext.data.toy.model import new_toy_model

    model, tokenizer = new_toy_model(seed)
    tmp = private_tmp(path)  # learner and pools may make the same cached model at once
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process's copy of the same model got there first: keep it
        if not (path / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_toy_assets(
    out_dir: str | Path,
    digits: int = 3,
    n_train: int = 2048,
    n_val: int = 64,
    seed: int = 0,
    warm_start_cache: str | Path | None = None,
    model_path: str | Path | None = None,
    answer_format: str = "short",
) -> ToyAssets:
    """Write (or find) the model folder and the parquet files under ``out_dir``.

    Args:
        out_dir: folder for ``model/`` (or a link to the warm start), ``train.parquet``, ``val.parquet``.
        digits: operand digits of the addition problems.
        n_train, n_val: problems per file (val problems are drawn with seed ``seed + 1``).
        seed: seed of the untrained model's init and of the problems.
        warm_start_cache: if given, use the cached supervised warm start from that folder
            (:func:`verl_ext.data.toy.checkpoints.warm_start` with the answer format's default
            steps, trained on first use) instead of an untrained model.
        model_path: use this model folder (e.g. a warm start resolved elsewhere); overrides the above.
        answer_format: ``short`` or ``scratchpad`` (:data:`verl_ext.data.toy.problems.ANSWER_FORMATS`):
            the problems' ``data_source`` (``toy_add<d>`` / ``toy_add<d>_scratch``) picks the
            reward and names the parquet files. The model is the caller's to match (a scratchpad
            warm start for scratchpad data).
    """
    check_answer_format(answer_format)
    source = toy_data_source(digits, answer_format)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if model_path is not None:
        model_path = Path(model_path).resolve()
    elif warm_start_cache is not None:
        from verl_ext.data.toy.checkpoints import warm_start

        model_path = Path(warm_start(warm_start_cache, digits=digits, seed=seed, answer_format=answer_format)).resolve()
    else:
        model_path = out / f"model_add{digits}_seed{seed}"
        if not (model_path / "config.json").is_file():
            _save_untrained_model(model_path, seed)
    files = {}
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1)):
        path = out / f"{split}_{source}_n{n}_seed{split_seed}.parquet"
        if not path.is_file():
            problems = make_problems(n, digits=digits, seed=split_seed, answer_format=answer_format)
            write_verl_parquet(problems, path, template="toy", split=split)
        files[split] = path
    return ToyAssets(model_path, files["train"], files["val"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_ext.data.toy_assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-start", default=None, metavar="CACHE_DIR", help="use the cached supervised warm start")
    parser.add_argument("--answer-format", default="short", choices=ANSWER_FORMATS, help="short sums or scratchpad")
    parser.add_argument("--print-overrides", action="store_true", help="print verl hydra overrides for the files")
    args = parser.parse_args(argv)
    assets = prepare_toy_assets(
        args.out, args.digits, args.n_train, args.n_val, args.seed, args.warm_start, answer_format=args.answer_format
    )
    if args.print_overrides:
        print(
            f"actor_rollout_ref.model.path={assets.model_path} data.train_files={assets.train_file} "
            f"data.val_files={assets.val_file}"
        )
    else:
        print(f"model {assets.model_path}\ntrain {assets.train_file}\nval   {assets.val_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
