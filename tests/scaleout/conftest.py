"""The Ray cluster the scale-out tests share, one per module."""

from __future__ import annotations

import pytest

from kvmigrate.scaleout.ray_runner import LOCAL_OBJECT_STORE_BYTES


@pytest.fixture(scope="module")
def ray_cluster(ray):
    """One local cluster for the module; the commands find it initialized and use it."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    yield ray
    ray.shutdown()
