"""Evaluate a model on math benchmarks with the paper's protocol (sampled mean@k, pass@k).

The library behind ``python -m recipe.gepo.evaluate model_path=... benchmarks=[...]
output_dir=...``; every setting is a field of :class:`EvalConfig` (mirrors ``config/evaluate.yaml``).
Writes to ``output_dir``: ``records.jsonl`` (one line a sample, appended and fsync'ed after every
chunk of problems), ``run_config.json`` (the settings that determine the records),
``summary.json`` / ``summary.md`` (mean@k and pass@k per benchmark and their average) and, given
``history_file``, one ``{"step", "scores"}`` line appended there for :mod:`verl_ext.eval.report`.
Resume: started again on the same ``output_dir``, it skips every problem whose records are all
present, cuts a torn last line and redoes a partly written problem; different settings are refused
naming the fields, unless ``resume=false`` (start over). The files' fields: docs/evaluation.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_ext.eval.metrics import summarize
from verl_ext.rundir import changed_settings, describe_changes, iter_jsonl, write_text_atomically


def _known_benchmarks() -> tuple[str, ...]:
    """Benchmarks ``verl_ext.data.datasets.load_benchmark`` knows (math500, aime24, ..., toy)."""
    from verl_ext.data.datasets import BENCHMARKS

    return tuple(BENCHMARKS)


#: reward ``error`` values that mean "the response gave no answer" (not a scoring failure)
NO_ANSWER_ERRORS = frozenset({"no_boxed", "no_answer"})

RECORDS_FILE = "records.jsonl"
RUN_CONFIG_FILE = "run_config.json"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"

#: fields whose change makes existing records incompatible (checked on resume)
_FINGERPRINT_FIELDS = (
    "model_path",
    "tokenizer_path",
    "template",
    "samples_per_problem",
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "seed",
    "toy_digits",
    "toy_seed",
    "toy_answer_format",
    "reward_kwargs",
)
#: fingerprint fields added after run_config.json files were first written: their value when a file lacks them
_FINGERPRINT_DEFAULTS = {"toy_answer_format": "short"}


@dataclass
class EvalConfig:
    """Settings of one evaluation; ``config/evaluate.yaml`` declares the same fields."""

    #: HF model folder, a ``.gguf`` file, or a folder holding exactly one ``.gguf``. Required.
    model_path: str | None = None
    #: tokenizer folder (or .gguf, HF engine only) when it is not next to the model; None: from ``model_path``.
    tokenizer_path: str | None = None
    #: benchmarks to run: math500, aime24, aime25, amc23, gsm8k, toy (any of load_benchmark's names).
    benchmarks: list[str] = field(default_factory=lambda: ["amc23", "aime24", "aime25", "math500"])
    #: per-benchmark data file overriding the built-in location, e.g. {aime24: /data/aime24.jsonl}.
    benchmark_paths: dict[str, str] = field(default_factory=dict)
    #: evaluate only the first ``limit`` problems of each benchmark (None: all).
    limit: int | None = None
    #: samples per problem, k of mean@k (the paper: 8).
    samples_per_problem: int = 8
    #: extra pass@k values to report (each 1 <= k <= samples_per_problem); None: [samples_per_problem].
    pass_ks: list[int] | None = None
    #: sampling temperature (paper 0.6).
    temperature: float = 0.6
    #: nucleus sampling threshold (paper 0.95).
    top_p: float = 0.95
    #: top-k sampling (paper 20; 0 disables).
    top_k: int = 20
    #: generation budget per sample (paper: up to 4096).
    max_new_tokens: int = 4096
    #: prompt template (``verl_ext.data.templates``: qwen3_think, qwen3_nothink, plain); toy always uses ``toy``.
    template: str = "qwen3_think"
    #: base random seed; each chunk of problems is sampled with a seed derived from it.
    seed: int = 0
    #: sequences per ``generate`` call; a chunk is max(1, batch_size // samples) problems
    #: (vllm: must be >= samples_per_problem, as vLLM gets a chunk's sequences in one call).
    batch_size: int = 16
    #: auto (vLLM if importable, CUDA present and vLLM honours every option; else HF), hf, or vllm.
    engine: str = "auto"
    #: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16.
    dtype: str = "auto"
    #: auto, cpu, cuda, cuda:1, ... (vllm: auto / cuda only; it uses the visible GPU).
    device: str = "auto"
    #: folder for records.jsonl, run_config.json, summary.json, summary.md.
    output_dir: str = "outputs/eval"
    #: resume from records in output_dir (false: delete them and start over).
    resume: bool = True
    #: training step this checkpoint belongs to (written to the summary and the history).
    step: int | None = None
    #: jsonl to append ``{"step", "scores"}`` to for the Best/Last report; needs ``step``.
    history_file: str | None = None
    #: options for ``verl_ext.rewards.math_reward`` (RewardConfig fields, e.g. timeout_seconds).
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    #: toy benchmark: number of problems, digits per operand, generator seed.
    toy_n: int = 64
    toy_digits: int = 3
    toy_seed: int = 1234
    #: toy benchmark: ``short`` (the sum) or ``scratchpad`` (columns, then ``=`` and the sum); the
    #: problems' data_source (``toy_add<d>`` / ``toy_add<d>_scratch``) picks the reward.
    toy_answer_format: str = "short"
    #: show tqdm progress bars.
    progress: bool = True

    def __post_init__(self):
        if self.benchmarks is None or isinstance(self.benchmarks, str):
            self.benchmarks = [self.benchmarks] if isinstance(self.benchmarks, str) else []
        self.benchmarks = [str(b) for b in self.benchmarks]
        if not self.benchmarks:
            raise ValueError("benchmarks is empty: give e.g. benchmarks=[math500,aime24]")
        known = _known_benchmarks()
        unknown = [b for b in self.benchmarks if b not in known]
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown}; known: {list(known)}")
        if len(set(self.benchmarks)) != len(self.benchmarks):
            raise ValueError(f"benchmarks lists a name twice: {self.benchmarks}")
        bad_paths = [b for b in self.benchmark_paths if b not in known]
        if bad_paths:
            raise ValueError(f"benchmark_paths has unknown benchmark(s) {bad_paths}; known: {list(known)}")
        from verl_ext.data.templates import check_template

        if self.template == "toy" and any(b != "toy" for b in self.benchmarks):
            raise ValueError(
                "template='toy' is only for the toy benchmark; math benchmarks need a chat or plain template"
            )
        check_template(self.template)
        if self.samples_per_problem < 1:
            raise ValueError(f"samples_per_problem={self.samples_per_problem} must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit} must be >= 1 or null")
        for k in self.pass_ks or []:
            if not 1 <= int(k) <= self.samples_per_problem:
                raise ValueError(
                    f"pass_ks contains k={k}; need 1 <= k <= samples_per_problem={self.samples_per_problem}"
                )
        if self.engine not in ("auto", "hf", "vllm"):
            raise ValueError(f"engine={self.engine!r} unknown; choose auto, hf or vllm")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} unknown; choose auto, float32, bfloat16 or float16")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.engine != "auto":
            # at start, before any model or vLLM import: an option the engine would ignore is refused
            from verl_ext.eval.generate import check_engine_options

            check_engine_options(
                self.engine,
                tokenizer_path=self.tokenizer_path,
                dtype=self.dtype,
                device=self.device,
                batch_size=self.batch_size,
                samples_per_problem=self.samples_per_problem,
            )
        if self.history_file and self.step is None:
            raise ValueError("history_file is set but step is not: pass step=<training step>")
        from verl_ext.data.toy.problems import ANSWER_FORMATS

        if self.toy_answer_format not in ANSWER_FORMATS:
            raise ValueError(f"toy_answer_format={self.toy_answer_format!r} unknown; choose one of {ANSWER_FORMATS}")

    @property
    def ks(self) -> list[int]:
        ks = [int(k) for k in (self.pass_ks or [self.samples_per_problem])]
        return sorted(set(ks))

    @property
    def problems_per_chunk(self) -> int:
        return max(1, self.batch_size // self.samples_per_problem)

    def fingerprint(self) -> dict:
        d = dataclasses.asdict(self)
        fp = {k: d[k] for k in _FINGERPRINT_FIELDS}
        if fp["model_path"]:
            fp["model_path"] = str(Path(fp["model_path"]).expanduser().resolve())
        if fp["tokenizer_path"]:
            fp["tokenizer_path"] = str(Path(fp["tokenizer_path"]).expanduser().resolve())
        return fp


def config_from_mapping(m: Mapping) -> EvalConfig:
    """Build an :class:`EvalConfig` from a plain mapping (e.g. Hydra's), naming unknown keys."""
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    unknown = sorted(set(m) - names)
    if unknown:
        raise ValueError(f"unknown evaluation setting(s) {unknown}; see recipe/gepo/config/evaluate.yaml")
    for f in dataclasses.fields(EvalConfig):
        value, default = m.get(f.name), f.default
        if value is None or not isinstance(default, (bool, int, float, str)) or default is None:
            continue
        expected = type(default)
        fits = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
        fits = fits or (expected is float and isinstance(value, int) and not isinstance(value, bool))
        if not fits:
            raise ValueError(f"{f.name}={value!r}: expected {expected.__name__} (like the default {default!r})")
    return EvalConfig(**dict(m))


# ---------------------------------------------------------------------------------------------
# problems


def load_problems(cfg: EvalConfig, name: str) -> list[dict]:
    """Problems of one benchmark (``verl_ext.data.datasets.load_benchmark`` records: id, problem,
    answer, data_source); ``toy`` is generated from ``toy_n``, ``toy_digits``, ``toy_seed``,
    ``toy_answer_format``."""
    from verl_ext.data.datasets import load_benchmark

    if name == "toy":
        opts = {"n": cfg.toy_n, "digits": cfg.toy_digits, "seed": cfg.toy_seed, "answer_format": cfg.toy_answer_format}
        return list(load_benchmark(name, path=cfg.benchmark_paths.get(name), limit=cfg.limit, **opts))
    return list(load_benchmark(name, path=cfg.benchmark_paths.get(name), limit=cfg.limit))


def template_for(cfg: EvalConfig, benchmark: str) -> str:
    """The prompt template of a benchmark: ``toy`` for the toy task, ``cfg.template`` otherwise."""
    return "toy" if benchmark == "toy" else cfg.template


def _chunk_seed(base: int, benchmark: str, chunk: int) -> int:
    h = hashlib.sha256(f"{base}/{benchmark}/{chunk}".encode()).digest()
    return int.from_bytes(h[:4], "little")


# ---------------------------------------------------------------------------------------------
# records file


def read_records(path: str | Path, repair: bool = False) -> list[dict]:
    """Read a records jsonl. A last line without its newline (a write torn by a kill) is ignored,
    and with ``repair=True`` cut from the file so appends start on a clean line. Any other
    unparsable line raises ``ValueError`` with its line number."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in iter_jsonl(path):
        if not line.complete:
            if repair:
                with open(path, "r+b") as f:
                    f.truncate(path.read_bytes().rfind(b"\n") + 1)
            break
        if line.error:
            raise ValueError(f"{path}:{line.lineno}: corrupt record line ({line.error}); remove it or use resume=false")
        records.append(line.value)
    return records


def completed_problems(records: Sequence[Mapping], n: int) -> dict[str, set[str]]:
    """``{benchmark: {problem_id}}`` of problems whose samples 0..n-1 are all recorded."""
    done: dict[str, set[str]] = {}
    seen: dict[tuple[str, str], set[int]] = {}
    for r in records:
        seen.setdefault((str(r["benchmark"]), str(r["problem_id"])), set()).add(int(r["sample_idx"]))
    for (b, pid), idx in seen.items():
        if set(range(n)) <= idx:
            done.setdefault(b, set()).add(pid)
    return done


def _check_run_config(out: Path, cfg: EvalConfig) -> None:
    rc = out / RUN_CONFIG_FILE
    fp = cfg.fingerprint()
    if rc.exists():
        changed = changed_settings({**_FINGERPRINT_DEFAULTS, **json.loads(rc.read_text())}, fp)
        if changed:
            raise ValueError(
                f"{out} holds records made with other settings ({describe_changes(changed, limit=len(changed))}); "
                "use another output_dir or resume=false to start over"
            )
    else:
        write_text_atomically(rc, json.dumps(fp, indent=2))


# ---------------------------------------------------------------------------------------------
# scoring


def score_samples(
    data_source: str, responses: Sequence[str], answers: Sequence[Any], reward_kwargs: Mapping
) -> list[dict]:
    """Score responses of one ``data_source`` with the reward the registry picks for it
    (:func:`verl_ext.rewards.dispatch.score_batch`: ``toy_add<d>`` the toy reward,
    ``toy_add<d>_scratch`` the scratchpad reward, anything else the math reward, verified in
    parallel); ``reward_kwargs`` go to the reward (the math reward's RewardConfig fields)."""
    from verl_ext.rewards.dispatch import score_batch

    return score_batch(data_source, responses, answers, **dict(reward_kwargs))


def _score_chunk(items, comps, reward_kwargs) -> list[list[dict]]:
    """Scores of a chunk, ``out[problem][sample]``: one reward call per data source (parallel
    verification over the whole chunk)."""
    by_source: dict[str, list[tuple[int, int]]] = {}
    for pi, ((_, p), samples) in enumerate(zip(items, comps)):
        by_source.setdefault(p["data_source"], []).extend((pi, j) for j in range(len(samples)))
    out: list[list[dict | None]] = [[None] * len(samples) for samples in comps]
    for src, where in by_source.items():
        texts = [comps[pi][j].text for pi, j in where]
        golds = [items[pi][1]["answer"] for pi, _ in where]
        for (pi, j), sc in zip(where, score_samples(src, texts, golds, reward_kwargs)):
            out[pi][j] = sc
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# summary


def _response_stats(records: Sequence[Mapping], names: Sequence[str]) -> dict[str, dict]:
    latest: dict[tuple, Mapping] = {}
    for r in records:
        latest[(r["benchmark"], str(r["problem_id"]), int(r["sample_idx"]))] = r
    out = {}
    for b in names:
        rs = [r for k, r in latest.items() if k[0] == b]
        n = max(len(rs), 1)
        out[b] = {
            "mean_response_tokens": sum(int(r.get("n_tokens", 0)) for r in rs) / n,
            "truncation_rate": sum(1 for r in rs if r.get("truncated")) / n,
            "no_answer_rate": sum(1 for r in rs if r.get("error") in NO_ANSWER_ERRORS) / n,
            "scoring_errors": sum(1 for r in rs if r.get("error") and r.get("error") not in NO_ANSWER_ERRORS),
        }
    return out


def build_summary(records: Sequence[Mapping], cfg: EvalConfig) -> dict:
    """Summary dict from per-sample records (only the configured benchmarks/problems)."""
    names = list(cfg.benchmarks)
    wanted = [r for r in records if r["benchmark"] in names and int(r["sample_idx"]) < cfg.samples_per_problem]
    summ = summarize(wanted, pass_ks=cfg.ks, benchmarks=names)
    for b, st in _response_stats(wanted, names).items():
        summ["benchmarks"][b].update(st)
    summ.update(
        {
            "model_path": cfg.fingerprint()["model_path"],
            "step": cfg.step,
            "samples_per_problem": cfg.samples_per_problem,
            "sampling": {k: getattr(cfg, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")},
            "template": cfg.template,
        }
    )
    return summ


def summary_markdown(summary: Mapping, digits: int = 1) -> str:
    """Markdown table: accuracies in percent, one row per benchmark plus the average."""
    n = summary["samples_per_problem"]
    first = next(iter(summary["benchmarks"].values()))
    pks = sorted(int(k.split("@")[1]) for k in first if k.startswith("pass@"))
    head = (
        ["Benchmark", "Problems", f"mean@{n}"]
        + [f"pass@{k}" for k in pks]
        + ["Correct", "No answer", "Scoring errors", "Mean tokens", "Truncated"]
    )
    lines = ["| " + " | ".join(head) + " |", "|---|" + "|".join(["---:"] * (len(head) - 1)) + "|"]
    pct = lambda v: f"{100 * v:.{digits}f}"  # noqa: E731
    from verl_ext.eval.report import DISPLAY_NAMES

    for b, m in summary["benchmarks"].items():
        row = [DISPLAY_NAMES.get(b, b), str(m["n_problems"]), pct(m[f"mean@{n}"])]
        row += [pct(m[f"pass@{k}"]) for k in pks]
        row += [
            f"{m['n_correct']}/{m['n_samples']}",
            pct(m["no_answer_rate"]),
            str(m["scoring_errors"]),
            f"{m['mean_response_tokens']:.1f}",
            pct(m["truncation_rate"]),
        ]
        lines.append("| " + " | ".join(row) + " |")
    if "average" in summary:
        a = summary["average"]
        row = ["**Avg**", "", pct(a[f"mean@{n}"])] + [pct(a[f"pass@{k}"]) for k in pks] + [""] * 5
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# main loop


def run_evaluation(cfg: EvalConfig, generator=None) -> dict:
    """Evaluate (resuming from ``cfg.output_dir``), write the summary files, return the summary.

    ``generator`` -- an object with ``generate(prompts, n, seed, desc) -> [[Completion]]`` and a
    ``tokenizer`` attribute (an :class:`~verl_ext.eval.generate.HFGenerator`); built from
    ``cfg`` when None (only if some problem is left to generate).
    """
    from tqdm.auto import tqdm

    from verl_ext.eval.generate import SamplingParams, make_generator, resolve_model_path

    resolve_model_path(cfg.model_path)  # fail early, naming a bad path
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rec_path = out / RECORDS_FILE
    if not cfg.resume:
        for f in (rec_path, out / RUN_CONFIG_FILE, out / SUMMARY_JSON, out / SUMMARY_MD):
            f.unlink(missing_ok=True)
    _check_run_config(out, cfg)
    records = read_records(rec_path, repair=True)
    done = completed_problems(records, cfg.samples_per_problem)
    problems = {b: load_problems(cfg, b) for b in cfg.benchmarks}
    todo = {
        b: [(i, p) for i, p in enumerate(ps) if str(p["id"]) not in done.get(b, set())] for b, ps in problems.items()
    }
    n_todo = sum(len(v) for v in todo.values())
    n_all = sum(len(v) for v in problems.values())
    if n_todo < n_all:
        print(f"[evaluate] resuming: {n_all - n_todo}/{n_all} problems already complete in {rec_path}")

    if n_todo:
        params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens)
        if generator is None:
            generator = make_generator(
                cfg.engine,
                cfg.model_path,
                params,
                batch_size=cfg.batch_size,
                dtype=cfg.dtype,
                device=cfg.device,
                tokenizer_path=cfg.tokenizer_path,
                seed=cfg.seed,
                show_progress=cfg.progress,
                samples_per_problem=cfg.samples_per_problem,
            )
        elif getattr(generator, "params", params) != params:
            raise ValueError(f"the generator samples with {generator.params}, the config asks for {params}")
        from verl_ext.data.templates import render_prompt

        ppc = cfg.problems_per_chunk
        t0 = time.time()
        with (
            open(rec_path, "a", encoding="utf-8") as fh,
            tqdm(total=n_todo, desc="problems", unit="prob", disable=not cfg.progress) as bar,
        ):
            for b in cfg.benchmarks:
                chunks: dict[int, list[tuple[int, dict]]] = {}
                for i, p in todo[b]:
                    chunks.setdefault(i // ppc, []).append((i, p))
                for c, items in sorted(chunks.items()):
                    bar.set_postfix_str(f"{b} chunk {c}")
                    tpl = template_for(cfg, b)
                    prompts = [render_prompt(p["problem"], tpl, tokenizer=generator.tokenizer) for _, p in items]
                    comps = generator.generate(
                        prompts, cfg.samples_per_problem, seed=_chunk_seed(cfg.seed, b, c), desc=f"{b} sampling"
                    )
                    all_scores = _score_chunk(items, comps, cfg.reward_kwargs)
                    lines = []
                    for (i, p), prompt, samples, scores in zip(items, prompts, comps, all_scores):
                        for j, (s, sc) in enumerate(zip(samples, scores)):
                            rec = {
                                "benchmark": b,
                                "problem_id": str(p["id"]),
                                "problem_index": i,
                                "sample_idx": j,
                                "data_source": p["data_source"],
                                "ground_truth": p["answer"],
                                "response": s.text,
                                "n_tokens": s.n_tokens,
                                "truncated": s.truncated,
                                "acc": float(sc.get("acc", sc.get("score", 0.0))),
                                "score": float(sc.get("score", sc.get("acc", 0.0))),
                                "pred": sc.get("pred"),
                                "error": sc.get("error") or "",
                            }
                            if j == 0:
                                rec["prompt"] = prompt
                            lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                    fh.write("".join(lines))
                    fh.flush()
                    os.fsync(fh.fileno())
                    bar.update(len(items))
        print(f"[evaluate] generated {n_todo} problems x {cfg.samples_per_problem} samples in {time.time() - t0:.1f}s")
        records = read_records(rec_path)

    ids = {b: {str(p["id"]) for p in ps} for b, ps in problems.items()}
    current = [r for r in records if r["benchmark"] in ids and str(r["problem_id"]) in ids[r["benchmark"]]]
    summary = build_summary(current, cfg)
    write_text_atomically(out / SUMMARY_JSON, json.dumps(summary, indent=2, ensure_ascii=False))
    md = summary_markdown(summary)
    write_text_atomically(out / SUMMARY_MD, md)
    if cfg.history_file:
        hp = Path(cfg.history_file)
        hp.parent.mkdir(parents=True, exist_ok=True)
        n = cfg.samples_per_problem
        line = {
            "step": cfg.step,
            "scores": {b: m[f"mean@{n}"] for b, m in summary["benchmarks"].items()},
            "model_path": summary["model_path"],
            "output_dir": str(out.resolve()),
        }
        with open(hp, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    print(md, end="")
    return summary
