"""The ``scripts/wan`` tools as modules of the ``scripts.wan`` package."""

from __future__ import annotations

import importlib


def load(name: str):
    """``scripts/wan/<name>.py`` as ``scripts.wan.<name>`` (the tests run from the repository root)."""
    return importlib.import_module(f"scripts.wan.{name}")
