"""Suite-wide settings.

Property tests are derandomized by default so a CI run is reproducible: the same examples
every time. Explore new ones with ``HYPOTHESIS_PROFILE=explore make test``.

A test that leaves Ray up without meaning to (a remote call starts it: a learner built in the
test's process launches its trust checker, a Ray actor) would make every later ``ray.init`` in
the run fail; :func:`_no_ray_left_up` shuts down what a test left up that was not up before it.

Tests that start processes -- their module imports ``ray``, ``subprocess`` or ``multiprocessing``,
or they use a fixture that starts Ray -- are marked ``integration``; ``make test-quick`` runs the
rest (``-m "not slow and not integration"``), the unit tests of the edit-test loop.

The suite composes hydra configs of ~30 YAML files in most of its tests, parsing the same YAML texts
again each time. :func:`_parse_each_yaml_text_once` keeps each text's parse for the session (a deep
copy per load, so nothing is shared): compose results are unchanged.
"""

import ast
import copy
import functools
import io
import os
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import settings
from omegaconf import OmegaConf
from omegaconf._utils import get_yaml_loader

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=500, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@functools.lru_cache(maxsize=None)
def _parsed_yaml(text: str):
    return yaml.load(text, Loader=get_yaml_loader())


def _load_parsing_each_text_once(file_):
    """``OmegaConf.load`` (same checks, same result) with the YAML parse of each text done once."""
    if isinstance(file_, (str, Path)):
        with io.open(os.path.abspath(file_), "r", encoding="utf-8") as f:
            text = f.read()
    elif getattr(file_, "read", None):
        text = file_.read()
        text = text.decode("utf-8") if isinstance(text, bytes) else text
    else:
        raise TypeError("Unexpected file type")
    obj = copy.deepcopy(_parsed_yaml(text))
    if obj is not None and not isinstance(obj, (list, dict, str)):
        raise IOError(f"Invalid loaded object type: {type(obj).__name__}")
    return OmegaConf.create() if obj is None else OmegaConf.create(obj)


@pytest.fixture(autouse=True, scope="session")
def _parse_each_yaml_text_once():
    original = OmegaConf.load
    OmegaConf.load = staticmethod(_load_parsing_each_text_once)
    yield
    OmegaConf.load = original


@pytest.fixture(autouse=True)
def _no_ray_left_up():
    ray = sys.modules.get("ray")
    was_up = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if ray is not None and not was_up and ray.is_initialized():
        ray.shutdown()


PROCESS_MODULES = ("ray", "subprocess", "multiprocessing")
PROCESS_FIXTURES = {"local_ray", "ray_session"}


@functools.lru_cache(maxsize=None)
def starts_processes(path: Path) -> bool:
    """Whether the test module at ``path`` imports a module that starts processes (anywhere in it)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n.split(".")[0] in PROCESS_MODULES for n in names):
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if starts_processes(Path(item.path)) or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
