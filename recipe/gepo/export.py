"""A run directory's checkpoint as a Hugging Face folder, for either engine:

    python -m recipe.gepo.export RUN_DIR [--step N] [--out DIR]      # default DIR: RUN_DIR/hf/step_<N>

The embedded engine's ``checkpoints/step_<N>.pt`` holds the learner's float32 weights; they are put
into the run's own base model (``config.yaml``: the model path, or the task's built-in model or warm
start) and saved with its tokenizer. The verl engine's ``global_step_<N>/actor`` goes through
:func:`recipe.gepo.verl_engine.fsdp_export.export` (float32, not verl's bfloat16 merger). ``evaluate``
accepts a run directory and exports its latest checkpoint this way when no export of it exists;
training ends by exporting as ``hetero.export_hf`` says (:func:`export_at_end`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from verl_ext.rundir import CHECKPOINT_DIR, LATEST_POINTER

EXPORT_DIR = "hf"
"""Exports go to ``RUN_DIR/hf/step_<N>`` unless ``--out`` says otherwise."""
PROVENANCE = "heterorl_export.json"
"""Written into every export: the run, the step and the checkpoint it came from."""


def run_checkpoints(run_dir: Path) -> dict[int, Path]:
    """{step: checkpoint} of a run directory, either engine's; ValueError naming the folder if none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    found = {int(m.group(1)): p for p in (run_dir / CHECKPOINT_DIR).glob("step_*.pt") if (m := _step(p.stem))}
    for path in run_dir.glob("global_step_*"):
        if (path / "actor").is_dir() and (m := re.fullmatch(r"global_step_(\d+)", path.name)):
            found[int(m.group(1))] = path / "actor"
    if not found:
        raise ValueError(
            f"run directory {str(run_dir)!r} has no checkpoint ({CHECKPOINT_DIR}/step_<N>.pt or global_step_<N>/actor): "
            "train with trainer.save_freq > 0"
        )
    return found


def _step(stem: str) -> Optional[re.Match]:
    return re.fullmatch(r"step_(\d+)", stem)


def latest_step(run_dir: Path) -> int:
    """The step of the run's latest checkpoint (the ``latest`` pointer where the engine writes one)."""
    pointer = Path(run_dir) / CHECKPOINT_DIR / LATEST_POINTER
    if pointer.is_file() and (m := _step(Path(pointer.read_text().strip()).stem)):
        return int(m.group(1))
    return max(run_checkpoints(run_dir))


def export_run(run_dir: Path, step: Optional[int] = None, out: Optional[Path] = None) -> Path:
    """Export checkpoint ``step`` (default: the latest) of ``run_dir``; returns the HF folder."""
    run_dir = Path(run_dir)
    checkpoints = run_checkpoints(run_dir)
    step = latest_step(run_dir) if step is None else step
    if step not in checkpoints:
        raise ValueError(f"--step {step}: {run_dir} has checkpoints at steps {sorted(checkpoints)}")
    source = checkpoints[step]
    out = Path(out) if out is not None else run_dir / EXPORT_DIR / f"step_{step:06d}"
    if source.is_dir():  # the verl engine's FSDP actor
        from .verl_engine.fsdp_export import export

        export(source, out)
    else:
        _export_embedded(run_dir, source, out)
    provenance = {
        "run_dir": str(run_dir.resolve()),
        "step": step,
        "checkpoint": str(source.resolve()),
        "checkpoint_mtime": _mtime(source),
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")
    return out


def _mtime(checkpoint: Path) -> float:
    """When the checkpoint was written (a folder: its newest file), to tell a stale export from a current one."""
    paths = [checkpoint] if checkpoint.is_file() else [p for p in checkpoint.rglob("*") if p.is_file()]
    return max((p.stat().st_mtime for p in paths), default=0.0)


def is_current(export: Path, checkpoint: Path) -> bool:
    """Whether ``export`` was made from ``checkpoint`` as it is now (a fresh run in the same
    directory writes a new checkpoint of the same step)."""
    try:
        provenance = json.loads((export / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    return provenance.get("checkpoint_mtime") == _mtime(checkpoint)


def plan_line(which: str) -> str:
    """What a dry run's plan says about ``hetero.export_hf``."""
    return {
        "final": "the last checkpoint becomes an HF folder, RUN_DIR/hf/step_<N> (hetero.export_hf=final)",
        "all": "every checkpoint becomes an HF folder, RUN_DIR/hf/step_<N> (hetero.export_hf=all)",
        "none": "no HF export (hetero.export_hf=none)",
    }[which]


def export_at_end(run_dir: Path, which: str, strategy: str = "fsdp") -> list[str]:
    """``hetero.export_hf`` when training has ended: export the latest checkpoint (``final``) or
    every one (``all``) that has no current export; the lines to print. A run without checkpoints,
    a Megatron run (the export reads FSDP checkpoints) or a failed export gets a line saying so:
    the run's results stay as they are."""
    run_dir = Path(run_dir)
    if which == "none":
        return []
    if strategy == "megatron":
        return [
            f"hetero.export_hf={which}: Megatron checkpoints are not exported (the export reads FSDP and "
            "embedded checkpoints); verl's `python -m verl.model_merger merge --backend megatron` merges them"
        ]
    try:
        checkpoints = run_checkpoints(run_dir)
    except ValueError:
        return [f"hetero.export_hf={which}: no checkpoint to export (trainer.save_freq <= 0 saved none)"]
    steps = sorted(checkpoints) if which == "all" else [latest_step(run_dir)]
    lines = []
    for step in steps:
        out = run_dir / EXPORT_DIR / f"step_{step:06d}"
        try:
            if not is_current(out, checkpoints[step]):
                export_run(run_dir, step, out)
        except Exception as err:  # noqa: BLE001 -- the run is done; say why its export is missing
            lines.append(f"hetero.export_hf={which}: step {step} not exported: {type(err).__name__}: {err}")
            continue
        lines.append(f"exported step {step} -> {out}")
    return lines


def _export_embedded(run_dir: Path, checkpoint: Path, out: Path) -> None:
    import torch
    from omegaconf import OmegaConf

    from .embedded.policy import load_policy
    from .embedded.tasks import resolve_model_path
    from .sections import TaskConfig

    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"{config_file}: missing; the embedded engine writes it beside its checkpoints")
    cfg = OmegaConf.load(config_file)
    base = resolve_model_path(
        str(cfg.actor_rollout_ref.model.path or ""), TaskConfig.from_omegaconf(cfg.task), int(cfg.hetero.seed)
    )
    model, tokenizer = load_policy(base)
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "model" not in state.get("learner", {}):
        raise ValueError(f"{checkpoint}: not an embedded-engine checkpoint (no learner model weights)")
    model.load_state_dict(state["learner"]["model"])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def latest_export(run_dir: Path) -> Path:
    """The HF folder of the run's latest checkpoint: exported now unless ``hf/step_<N>`` exists."""
    step = latest_step(run_dir)
    existing = Path(run_dir) / EXPORT_DIR / f"step_{step:06d}"
    if is_current(existing, run_checkpoints(run_dir)[step]):
        return existing
    print(f"[heterorl] exporting {run_dir} step {step} -> {existing}", file=sys.stderr, flush=True)
    return export_run(Path(run_dir), step)


def is_run_dir(path: Path) -> bool:
    """A folder with either engine's checkpoints (not an HF model folder)."""
    path = Path(path)
    return (
        path.is_dir()
        and not (path / "config.json").is_file()
        and ((path / CHECKPOINT_DIR).is_dir() or any(path.glob("global_step_*")))
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="trainer.default_local_dir of a run (either engine)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--out", type=Path, default=None, help="the HF folder to write (default RUN_DIR/hf/step_N)")
    args = parser.parse_args(argv)
    try:
        out = export_run(args.run_dir, args.step, args.out)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
