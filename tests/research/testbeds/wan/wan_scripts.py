"""The ``research/testbeds/wan`` tools as modules of the ``research.testbeds.wan`` package."""

from __future__ import annotations

import importlib


def load(name: str):
    """``research/testbeds/wan/<name>.py`` as ``research.testbeds.wan.<name>`` (the tests run from the repository root)."""
    return importlib.import_module(f"research.testbeds.wan.{name}")
