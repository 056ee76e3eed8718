"""Does the pinned warm start give the same weights under other CPU kernels? One build per setting.

    python -m research.bench.warm_start_kernels [--steps 210] [--answer-format scratchpad] [--out FILE]

The study's warm start (``verl_ext.data.toy.checkpoints.warm_start``: 210 supervised steps, seed 0,
one torch thread, deterministic algorithms) is the same bytes every time on one machine. Another
CPU may run other kernels: torch picks its vectorised kernels by the CPU's capability
(``ATEN_CPU_CAPABILITY``) and MKL its matrix code by the instruction set
(``MKL_ENABLE_INSTRUCTIONS``, or a fixed path with ``MKL_CBWR``). Each setting below builds the
warm start in a fresh folder, in its own process, and prints its weights' sha256 (first 16 hex
digits) and the held-out accuracy it records. Different hashes mean the recipe is not portable
and a design must pin the weights it ran from (``Plan.warm_start_sha256``, docs/study.md).

Each build is a whole warm start on one core: run it at ``nice`` beside a sweep, never beside a
benchmark."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: the environment variables that choose torch's and MKL's kernels (the parent's are not inherited)
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
#: the settings tried: this CPU's defaults, then torch's and MKL's kernels forced to other paths
SETTINGS: list[dict[str, str]] = [
    {},
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"MKL_CBWR": "COMPATIBLE"},
    {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"},
]

_BUILD = """
import json, sys, torch
from verl_ext.data.toy.checkpoints import WARM_START_INFO, warm_start
path = warm_start(sys.argv[1], steps=int(sys.argv[2]), answer_format=sys.argv[3], use_shipped=False)
info = json.loads((path / WARM_START_INFO).read_text())
print(json.dumps({"sha256": info["weights_sha256"], "accuracy": info["accuracy"],
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def build(setting: dict[str, str], steps: int, answer_format: str) -> dict:
    """One warm start built under ``setting`` (environment variables) in a new process."""
    inherited = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES}  # "defaults" means defaults
    env = {**inherited, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **setting}
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run(
            [sys.executable, "-c", _BUILD, cache, str(steps), answer_format],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"warm start under {setting or 'the defaults'} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=210, help="supervised steps (the study's: 210)")
    p.add_argument("--answer-format", default="scratchpad", choices=["scratchpad", "short"])
    p.add_argument("--out", type=Path, help="also write the table (markdown) here")
    a = p.parse_args(argv)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[0]
    lines = [
        f"Warm start: {a.steps} steps, {a.answer_format}, seed 0; load {load} at the start.",
        "",
        "| setting | torch CPU capability | weights sha256 | accuracy |",
        "|---|---|---|---|",
    ]
    for setting in SETTINGS:
        got = build(setting, a.steps, a.answer_format)
        name = " ".join(f"{k}={v}" for k, v in setting.items()) or "this CPU's defaults"
        lines.append(f"| {name} | {got['capability']} | `{got['sha256'][:16]}` | {got['accuracy']:.3f} |")
        print(lines[-1], flush=True)
    distinct = len({line.split("`")[1] for line in lines[4:]})
    lines += ["", f"{distinct} different weights from {len(SETTINGS)} settings."]
    print(lines[-1])
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
