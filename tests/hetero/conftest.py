"""Fixtures for the hetero tests."""

import pytest

from .factories import build_group


@pytest.fixture
def make_group():
    return build_group
