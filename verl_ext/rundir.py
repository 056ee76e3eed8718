"""The run directory: the one place that writes and reads its files.

A run directory (``trainer.default_local_dir``) holds ``metrics.jsonl`` (``{"step": int, "<metric>":
float, ...}`` a line, appended by :class:`MetricsWriter` for both engines; ``eval/...`` keys possibly
on lines of their own; a resume drops the steps after its checkpoint first, :func:`truncate_metrics`;
a killed run may leave a torn last line), ``config.yaml`` (the composed config:
:func:`read_run_config`), ``placement.json`` (:func:`write_placement`: where each role of a
verl-engine run ran), ``events.jsonl`` (things that happened once, each with ``step`` and ``event``:
:func:`append_event`, :func:`read_events`), ``enrolment.json`` (the public keys of an async run's
samplers, written before each may send) and ``checkpoints/step_<k>.pt`` with ``checkpoints/latest``
(:func:`save_checkpoint`, :func:`load_latest_checkpoint`, :func:`latest_checkpoint_step`).

Readers: :func:`read_metric_rows` (dicts), :func:`load_metrics` (a pandas row a step),
:func:`load_run` / :func:`load_runs` (plus the config); all skip bad lines alike (:func:`iter_metric_lines`).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
PLACEMENT_FILE = "placement.json"
EVENTS_FILE = "events.jsonl"
ENROLMENT_FILE = "enrolment.json"
CHECKPOINT_DIR = "checkpoints"
LATEST_POINTER = "latest"

LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
MAX_DELAY_KEY = "hetero.max_delay"
PRESET_KEY = "algorithm_preset"
SEED_KEY = "hetero.seed"

PathLike = Union[str, os.PathLike]


class RunDirError(ValueError):
    """A run directory that cannot be read (missing, not a directory, no ``metrics.jsonl``)."""


# --------------------------------------------------------------------------- writing


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The values a metrics line keeps: everything ``float()`` accepts (Python and numpy numbers,
    one-element tensors, bools) that is finite; text, None, NaN and infinities are left out."""
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (str, bytes)) or value is None:
            continue
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            clean[key] = value
    return clean


def metric_line(metrics: Mapping[str, Any], step: int) -> str:
    """One ``metrics.jsonl`` line (with its newline): ``step`` first, then :func:`clean_metrics`."""
    return json.dumps({"step": int(step), **clean_metrics(metrics)}) + "\n"


class MetricsWriter:
    """Appends lines to ``<run_dir>/metrics.jsonl`` (line-buffered: a reader sees whole lines)."""

    def __init__(self, run_dir: PathLike):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        self._file = open(self.path, "a", buffering=1)

    def write(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """Append one line; returns the values written (see :func:`clean_metrics`)."""
        self._file.write(metric_line(metrics, step))
        return clean_metrics(metrics)

    def close(self) -> None:
        self._file.close()


def set_aside_metrics(run_dir: PathLike) -> Optional[Path]:
    """A fresh run in a used directory: rename its ``metrics.jsonl`` to ``metrics.<unix time>.jsonl``
    (never append to or overwrite another run's metrics); returns the new name, or None."""
    return _set_aside(Path(run_dir) / METRICS_FILE, "metrics.{time}.jsonl")


def _set_aside(path: Path, pattern: str) -> Optional[Path]:
    """Rename ``path`` (if it exists) to ``pattern`` with ``{time}`` the unix time; the new path."""
    if not path.exists():
        return None
    kept = path.with_name(pattern.format(time=int(time.time())))
    path.rename(kept)
    return kept


def set_aside_latest_checkpoint(run_dir: PathLike) -> Optional[Path]:
    """A fresh run (``trainer.resume_mode=disable``) in a used directory: rename the ``latest``
    pointer to ``latest.<unix time>`` so that a later ``resume_mode=auto`` start resumes this run,
    never the one before it; the checkpoints themselves stay. Returns the new name, or None."""
    return _set_aside(Path(run_dir) / CHECKPOINT_DIR / LATEST_POINTER, LATEST_POINTER + ".{time}")


RESUME_MAY_CHANGE = (
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.logger",
    "trainer.resume_mode",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.default_local_dir",
    "actor_rollout_ref.rollout.trace.project_name",  # verl's copies of the two names above
    "actor_rollout_ref.rollout.trace.experiment_name",
    "hetero.dry_run",
    "hetero.wait_timeout_s",
    "hetero.ray_address",
    "hetero.learner_cpus",
    "hetero.sampler_cpus",
    "hetero.system_cpus",
    "hetero.learner_ray_resources.*",
    "hetero.sampler_ray_resources.*",
    "task.cache_dir",
    "ray_kwargs.*",
)
"""Keys a resumed run may set differently from the run it resumes (``fnmatch`` patterns): how long
it runs, what it logs and where its processes sit -- not what it trains."""


def config_leaves(
    node: Any, prefix: str = "", skip: Sequence[str] = (), keep_empty: bool = False
) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a plain config tree (``OmegaConf.to_container``),
    leaving out keys named in ``skip`` at any depth. An empty mapping is a leaf (value ``{}``) only
    with ``keep_empty``: then a mapping emptied or dropped shows as a change too."""
    if isinstance(node, dict):
        if not node and keep_empty:
            yield prefix, {}
        for k, v in node.items():
            if k not in skip:
                yield from config_leaves(v, f"{prefix}.{k}" if prefix else str(k), skip, keep_empty)
    else:
        yield prefix, node


def changed_settings(
    old: Mapping[str, Any], new: Mapping[str, Any], may_change: Sequence[str] = ()
) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every key of two flat settings mappings whose values
    differ (a key missing on one side reads ``"<not set>"``), sorted, leaving out keys that match a
    pattern of ``may_change`` (fnmatch). The one rule behind every "resume only with the settings
    that wrote it" check: a run directory's checkpoint, an evaluation's records."""
    import fnmatch

    changed = []
    for key in sorted(set(old) | set(new)):
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in may_change):
            continue
        a, b = old.get(key, "<not set>"), new.get(key, "<not set>")
        if a != b:
            changed.append((key, a, b))
    return changed


def describe_changes(changed: Sequence[tuple[str, Any, Any]], limit: int = 8) -> str:
    """``"key: old -> new; ..."`` for the first ``limit`` changes, and how many more."""
    listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:limit])
    return listed + (f" and {len(changed) - limit} more" if len(changed) > limit else "")


def resume_config_changes(run_dir: PathLike, cfg: Any) -> list[tuple[str, Any, Any]]:
    """``(key, value in config.yaml, value in cfg)`` for every key that differs between the run
    directory's ``config.yaml`` (the run its ``latest`` checkpoint belongs to) and the config
    ``cfg`` (an OmegaConf node) about to resume it, leaving out :data:`RESUME_MAY_CHANGE`.
    Empty when the directory has no ``config.yaml``."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return []

    old = dict(config_leaves(OmegaConf.to_container(OmegaConf.load(path), resolve=False), keep_empty=True))
    new = dict(config_leaves(OmegaConf.to_container(cfg, resolve=True), keep_empty=True))
    return changed_settings(old, new, RESUME_MAY_CHANGE)


def check_resume_config(run_dir: PathLike, cfg: Any) -> None:
    """Refuse (ValueError naming up to eight keys and both values) to resume the checkpoint in
    ``run_dir`` with a config that trains something else than the run that wrote it."""
    changed = resume_config_changes(run_dir, cfg)
    if changed:
        raise ValueError(
            f"{run_dir} holds a checkpoint of a run with another config ({describe_changes(changed)}): resuming it would "
            "train on with these settings and report them as the old run's. Use another "
            "trainer.default_local_dir, or trainer.resume_mode=disable to start over there (its metrics "
            "and checkpoint pointer are set aside, nothing is deleted)."
        )


def truncate_metrics(path: PathLike, after_step: int) -> None:
    """Keep only the lines of ``path`` whose step is at most ``after_step`` (a resumed run
    re-logs the later ones); unreadable lines (a line cut by a crash) go too."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line.text for line in iter_metric_lines(path) if line.row is not None and line.row["step"] <= after_step]
    path.write_text("".join(text + "\n" for text in kept))


def write_run_config(run_dir: PathLike, cfg: Any) -> Path:
    """Write the composed config (an OmegaConf node, interpolations resolved) to
    ``<run_dir>/config.yaml``, what :func:`read_run_config` reads back; returns the path."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return path


def node_identity(_actor: Any = None) -> dict[str, str]:
    """This process's node: its hostname and the address Ray knows it by. Called inside Ray actors
    (``actor.__ray_call__.remote(node_identity)``, hence the unused instance argument)."""
    import socket

    import ray

    return {"hostname": socket.gethostname(), "ip": ray.util.get_node_ip_address()}


def append_event(run_dir: PathLike, event: Mapping[str, Any]) -> Path:
    """Append one event line (``{"step", "event", ...}``) to ``events.jsonl``."""
    path = Path(run_dir) / EVENTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(dict(event), sort_keys=True, default=str) + "\n")
    return path


def describe_event(event: Mapping[str, Any]) -> str:
    """One log line's worth of an event: ``quarantined: sampler_id=..., reason=...`` (no time)."""
    detail = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "time"))
    return f"{event['event']}: {detail}"


def read_events(run_dir: PathLike) -> list[dict[str, Any]]:
    """The events of a run (none when the file does not exist); a torn last line is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    return [line.value for line in iter_jsonl(path) if not line.error]


def write_placement(run_dir: PathLike, placement: Mapping[str, Sequence[Mapping[str, str]]]) -> Path:
    """Write ``<run_dir>/placement.json``: role -> the :func:`node_identity` of each of its processes."""
    path = Path(run_dir) / PLACEMENT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({role: list(nodes) for role, nodes in placement.items()}, indent=1) + "\n")
    return path


def private_tmp(path: PathLike) -> Path:
    """A hidden sibling of ``path`` that only this process writes, to rename over ``path`` when done:
    processes that write the same file at once (a learner and its pools filling one cache) each
    rename a whole file of their own, instead of one renaming another's half-written one away."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")


def write_text_atomically(path: PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (:func:`private_tmp` renamed over it): a reader
    sees the old content or the new, never half of it."""
    tmp = private_tmp(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(run_dir: PathLike, step: int, state: dict[str, Any]) -> Path:
    """Atomically write ``checkpoints/step_<k>.pt`` and point ``checkpoints/latest`` at it."""
    import torch

    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:06d}.pt"
    tmp = private_tmp(path)
    torch.save(state, tmp)
    os.replace(tmp, path)
    write_text_atomically(ckpt_dir / LATEST_POINTER, path.name)
    return path


def load_latest_checkpoint(run_dir: PathLike) -> Optional[dict[str, Any]]:
    """The state saved by the latest :func:`save_checkpoint`, or None if the run has none."""
    import torch

    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    pointer = ckpt_dir / LATEST_POINTER
    if not pointer.exists():
        return None
    return torch.load(ckpt_dir / pointer.read_text().strip(), weights_only=False)


def latest_checkpoint_step(run_dir: PathLike) -> int:
    """The step of the latest :func:`save_checkpoint` (read from the ``latest`` pointer, without
    loading the state), or 0 if the run has none."""
    try:
        name = (Path(run_dir) / CHECKPOINT_DIR / LATEST_POINTER).read_text().strip()
    except FileNotFoundError:
        return 0
    digits = name.removeprefix("step_").removesuffix(".pt")
    return int(digits) if digits.isdigit() else 0


# --------------------------------------------------------------------------- reading


def metrics_path(run_dir: PathLike) -> Path:
    """``<run_dir>/metrics.jsonl``; raises :class:`RunDirError` naming ``run_dir`` if the
    directory or the file does not exist. A path to the ``.jsonl`` file itself is accepted."""
    p = Path(run_dir)
    if p.is_file() and p.suffix == ".jsonl":
        return p
    if not p.exists():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    if not p.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} is not a directory (nor a .jsonl file)")
    f = p / METRICS_FILE
    if not f.is_file():
        raise RunDirError(f"run directory {str(run_dir)!r} has no {METRICS_FILE}")
    return f


def to_float(v: Any) -> float:
    """A metric value as float: numbers as they are, numeric strings ("0.5", "nan", "inf")
    parsed, everything else (null, booleans, text, lists, dicts) NaN."""
    if isinstance(v, bool) or v is None:
        return math.nan
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return math.nan
    return math.nan


def to_step(v: Any) -> Optional[int]:
    """``step`` as int, or None if it is not an integral number (bools rejected)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            return None
    if isinstance(v, (int, float)) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    return None


@dataclass(frozen=True)
class MetricLine:
    """One non-blank line of ``metrics.jsonl``.

    ``row`` is ``{"step": int, <metric>: float, ...}`` (values through :func:`to_float`), or None
    when the line is unreadable; ``why`` then says why."""

    lineno: int
    """1-based line number."""
    text: str
    row: Optional[dict[str, Any]]
    why: str = ""


@dataclass(frozen=True)
class JsonLine:
    """One non-blank line of a JSON-lines file."""

    lineno: int
    """1-based line number."""
    text: str
    value: Any = None
    """The parsed JSON value (None when ``error`` is set)."""
    error: str = ""
    """Why the line did not parse; empty when it did."""
    complete: bool = True
    """False for a last line without its newline: a write cut short by a kill, even if it parses."""


def iter_jsonl(path: PathLike) -> Iterator[JsonLine]:
    """Every non-blank line of a JSON-lines file, parsed: the one reader of the project's append-only
    files (metrics, events, evaluation records). A torn last line comes with ``complete=False`` and,
    if it does not parse, the error ``"truncated last line"``."""
    lines = Path(path).read_bytes().decode("utf-8", errors="replace").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        complete = i < len(lines) - 1
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            yield JsonLine(
                i + 1, line, None, f"invalid JSON ({e.msg})" if complete else "truncated last line", complete
            )
            continue
        yield JsonLine(i + 1, line, value, "", complete)


def iter_metric_lines(path: PathLike) -> Iterator[MetricLine]:
    """Every non-blank line of a ``metrics.jsonl`` file, parsed. A line that is not a JSON object
    with an integral ``step`` -- typically the torn last line of a killed run -- comes with
    ``row=None`` and the reason."""
    for line in iter_jsonl(path):
        obj = line.value
        if line.error:
            yield MetricLine(line.lineno, line.text, None, line.error)
            continue
        if not isinstance(obj, dict):
            yield MetricLine(line.lineno, line.text, None, f"not a JSON object ({type(obj).__name__})")
            continue
        step = to_step(obj.get("step"))
        if step is None:
            yield MetricLine(line.lineno, line.text, None, f"no integral 'step' (got {obj.get('step')!r})")
            continue
        yield MetricLine(
            line.lineno, line.text, {"step": step, **{k: to_float(v) for k, v in obj.items() if k != "step"}}
        )


def _warn_skipped(path: Path, skipped: Sequence[MetricLine]) -> None:
    if skipped:
        shown = "; ".join(f"line {s.lineno}: {s.why}" for s in skipped[:5])
        more = f" (+{len(skipped) - 5} more)" if len(skipped) > 5 else ""
        warnings.warn(f"{path}: skipped {len(skipped)} unreadable line(s): {shown}{more}", stacklevel=3)


def read_metric_rows(run_dir: PathLike, missing_ok: bool = False, warn: bool = True) -> list[dict[str, Any]]:
    """The readable lines of ``<run_dir>/metrics.jsonl`` (or of that file, given its path) in file
    order, each ``{"step": int, <metric>: float, ...}`` (one per log call: a step may appear on
    several lines). Unreadable lines are skipped, with a :class:`UserWarning` naming them unless
    ``warn`` is off (polling a live run, whose last line may be half written). With
    ``missing_ok`` a run without the file gives ``[]``; otherwise :class:`RunDirError`."""
    try:
        path = metrics_path(run_dir)
    except RunDirError:
        if missing_ok:
            return []
        raise
    lines = list(iter_metric_lines(path))
    if warn:
        _warn_skipped(path, [ln for ln in lines if ln.row is None])
    return [ln.row for ln in lines if ln.row is not None]


def load_metrics(run_dir: PathLike):
    """Read ``<run_dir>/metrics.jsonl`` into a pandas DataFrame with one row per step.

    Columns: ``step`` (int, sorted ascending) and one float64 column per metric key seen
    (NaN where a step did not log it). Lines with the same step (a separate evaluation line,
    or a resumed run that re-logged steps) are merged: per column, the last non-missing value
    wins. Values that are not numbers become NaN (numeric strings such as ``"0.5"``/``"nan"``
    are parsed). Unreadable lines are skipped with a :class:`UserWarning` naming the file and
    line numbers; their 1-based line numbers are in ``df.attrs["skipped_lines"]``.
    ``df.attrs["path"]`` is the file read.

    Raises :class:`RunDirError` (a ValueError) naming ``run_dir`` if it or its metrics file
    does not exist.
    """
    import pandas as pd

    path = metrics_path(run_dir)
    lines = list(iter_metric_lines(path))
    skipped = [ln for ln in lines if ln.row is None]
    _warn_skipped(path, skipped)
    records = [ln.row for ln in lines if ln.row is not None]
    if records:
        df = pd.DataFrame.from_records(records)
        metric_cols = [c for c in df.columns if c != "step"]
        df = pd.concat([df[["step"]], df[metric_cols].astype("float64")], axis=1)  # one block, not many
        # last non-missing value per column and step (groupby.last skips NaN)
        df = df.groupby("step", sort=True)[metric_cols].last().reset_index()
        df["step"] = df["step"].astype("int64")
    else:
        df = pd.DataFrame({"step": pd.Series([], dtype="int64")})
    df.attrs["path"] = str(path)
    df.attrs["skipped_lines"] = [ln.lineno for ln in skipped]
    return df


@dataclass
class Run:
    """One run directory: its metrics and what the config says about the algorithm.

    ``loss_mode``/``max_delay``/``preset``/``seed`` are None when ``config.yaml`` is missing,
    unreadable or lacks the key (``preset`` is usually absent: presets are merged into the
    global config)."""

    run_dir: Path
    metrics: Any
    """pandas DataFrame from :func:`load_metrics`."""
    loss_mode: Optional[str] = None
    max_delay: Optional[int] = None
    preset: Optional[str] = None
    seed: Optional[int] = None

    @property
    def algorithm(self) -> str:
        """Algorithm name: the loss mode, with the preset in front when the config records one
        that differs (``dr_grpo`` and ``grpo`` share loss mode ``vanilla``): ``"dr_grpo
        (vanilla)"``; ``"unknown"`` without a loss mode."""
        loss = self.loss_mode or "unknown"
        if self.preset and self.preset != loss:
            return f"{self.preset} ({loss})"
        return loss

    @property
    def label(self) -> str:
        """``"<algorithm>, d=<max_delay>"`` (``d=?`` when the config has no max delay)."""
        d = "?" if self.max_delay is None else str(self.max_delay)
        return f"{self.algorithm}, d={d}"


def read_run_config(run_dir: PathLike) -> dict[str, Any]:
    """``loss_mode``, ``max_delay``, ``preset``, ``seed`` from ``<run_dir>/config.yaml``
    (values None if absent). A missing file gives all None; an unreadable one a warning too."""
    out: dict[str, Any] = {"loss_mode": None, "max_delay": None, "preset": None, "seed": None}
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return out
    try:
        from omegaconf import DictConfig, OmegaConf

        cfg = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 -- any parse failure: report, keep going
        warnings.warn(
            f"{path}: cannot read config ({type(e).__name__}: {e}); algorithm and delay unknown", stacklevel=2
        )
        return out

    def get(key: str) -> Any:
        try:
            v = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        except Exception:  # noqa: BLE001 -- e.g. an interpolation to a custom resolver
            return None
        return None if isinstance(v, DictConfig) else v

    loss = get(LOSS_MODE_KEY)
    out["loss_mode"] = None if loss is None else str(loss)
    preset = get(PRESET_KEY)
    out["preset"] = preset if isinstance(preset, str) and preset else None
    for name, key in (("max_delay", MAX_DELAY_KEY), ("seed", SEED_KEY)):
        v = to_step(get(key))
        if v is None and get(key) is not None:
            warnings.warn(f"{path}: {key}={get(key)!r} is not an integer; ignored", stacklevel=2)
        out[name] = v
    return out


def load_run(run_dir: PathLike) -> Run:
    """:func:`load_metrics` plus :func:`read_run_config` for one run directory."""
    df = load_metrics(run_dir)
    cfg = read_run_config(metrics_path(run_dir).parent)
    return Run(run_dir=Path(run_dir), metrics=df, **cfg)


def load_runs(run_dirs: Sequence[PathLike], labels: Optional[Sequence[str]] = None) -> tuple[list[Run], list[str]]:
    """Load every run directory and give each a legend label.

    Default labels are ``Run.label`` (``"<algorithm>, d=<delay>"``); labels shared by several
    runs (seeds) get the run directory's name appended. Raises :class:`RunDirError` naming the
    first bad directory, ValueError if ``labels`` does not have one entry per run."""
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"--labels has {len(labels)} entries for {len(run_dirs)} RUN_DIRs; give one per RUN_DIR")
    for d in run_dirs:
        metrics_path(d)  # validate all before the (slower) loading
    runs = [load_run(d) for d in run_dirs]
    if labels is not None:
        return runs, list(labels)
    base = [r.label for r in runs]
    return runs, [f"{b} [{r.run_dir.name}]" if base.count(b) > 1 else b for b, r in zip(base, runs)]
