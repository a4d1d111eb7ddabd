"""Shared pytest set-up: a fixed seed for every test and a bounded thread count.

The machine that runs the suite is shared and small; tests use small shapes, so more
threads only add contention (tests in spawned processes share the same cores). One thread
by default; ``EPSCALE_TEST_THREADS`` overrides the count.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

torch.set_num_threads(int(os.environ.get("EPSCALE_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _fixed_seed():
    """Every test starts from the same random state, whatever ran before it."""
    random.seed(0)
    torch.manual_seed(0)
    yield
