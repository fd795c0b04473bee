"""Shared fixtures of the metile pytest suite.

Random inputs are fresh on every run but always seeded: the seed is printed (pytest
shows it with a failure) and METILE_TEST_SEED=N replays a run exactly.
"""
import os
import pathlib
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("METILE_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.nodeid}: METILE_TEST_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def source_dir():
    """The repository root (examples/ lives there)."""
    return pathlib.Path(os.environ.get("METILE_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
