"""Shared test setup: the `gpu` marker skips cleanly on machines without a CUDA GPU."""

import jax
import pytest


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU host; see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
