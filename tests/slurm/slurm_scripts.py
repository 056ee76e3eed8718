"""Load ``scripts/slurm/local_cluster.py`` as a module (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "local_cluster.py"


def load_local_cluster():
    name = "heterorl_slurm_local_cluster"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]
