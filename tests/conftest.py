"""Shared pytest fixtures: fresh random seeds, the `gpu` marker's skip on machines without one, and
8 fake CPU devices for the sharding tests (set before jax starts; the default device stays the first)."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def fresh_seed(request) -> int:
    """A new random seed for every test run (set JAX_KDA_TEST_SEED to replay one).

    The seed is printed, so a failure's captured output says how to reproduce it.
    """
    seed = int(os.environ.get("JAX_KDA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"{request.node.nodeid}: JAX_KDA_TEST_SEED={seed}")
    return seed


def _has_cuda_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible to JAX (tests marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
