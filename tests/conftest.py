"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def ray_executor():
    """A local Ray instance with 2 worker CPUs (2 worker processes), shared by the
    executor tests of every module and shut down at the end of the session."""
    ray = pytest.importorskip("ray")
    from onnxdiag.runtime.executor import RayExecutor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # 2 worker processes
    try:
        yield RayExecutor()
    finally:
        ray.shutdown()
