"""Shared pytest set-up: a fixed seed for every test and a bounded thread count.

The machine that runs the suite is shared and small; tests use small shapes, so more
threads only add contention (tests in spawned processes share the same cores). One thread
by default; ``EPSCALE_TEST_THREADS`` overrides the count.

``EPSCALE_TEST_DEVICE=cuda`` makes that torch's default device, so that the single-process
layer tests (the fast layer against the reference) run there; `benchmarks/gpu_check.sh`
does this on a GPU machine. Tests of CPU-only mechanisms carry the ``cpu_only`` mark (or
live in tests/kernels/, the CPU kernels' own) and are skipped then; the multi-process gloo
tests are not meant for it.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

torch.set_num_threads(int(os.environ.get("EPSCALE_TEST_THREADS", "1")))

TEST_DEVICE = torch.device(os.environ.get("EPSCALE_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type != "cpu":
    torch.set_default_device(TEST_DEVICE)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: tests a CPU-only mechanism (skipped when "
                                       "EPSCALE_TEST_DEVICE names another device)")


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"CPU-only mechanism; EPSCALE_TEST_DEVICE={TEST_DEVICE}")
    for item in items:  # tests/kernels/ holds the CPU kernels' tests: all CPU-only
        if item.get_closest_marker("cpu_only") or item.nodeid.startswith("tests/kernels/") \
                or item.nodeid.startswith("kernels/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fixed_seed():
    """Every test starts from the same random state, whatever ran before it."""
    random.seed(0)
    torch.manual_seed(0)
    yield
