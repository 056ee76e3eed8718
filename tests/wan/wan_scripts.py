"""Load a ``scripts/wan`` script as a module (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

WAN = Path(__file__).resolve().parents[2] / "scripts" / "wan"


def load(name: str):
    """``scripts/wan/<name>.py`` as module ``name`` (the scripts import each other by that name)."""
    if str(WAN) not in sys.path:
        sys.path.insert(0, str(WAN))
    spec = importlib.util.spec_from_file_location(name, WAN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
