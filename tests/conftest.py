"""Suite-wide settings.

Property tests are derandomized by default so a CI run is reproducible: the same examples
every time. Explore new ones with ``HYPOTHESIS_PROFILE=explore make test``.

A test that leaves Ray up without meaning to (a remote call starts it: a learner built in the
test's process launches its trust checker, a Ray actor) would make every later ``ray.init`` in
the run fail; :func:`_no_ray_left_up` shuts down what a test left up that was not up before it.
"""

import os
import sys

import pytest
from hypothesis import settings

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=500, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _no_ray_left_up():
    ray = sys.modules.get("ray")
    was_up = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if ray is not None and not was_up and ray.is_initialized():
        ray.shutdown()
