"""A local Ray instance for the scale-out tests: 2 CPUs, loopback only, no usage reports.

Ray picks the node's address when it is imported: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
makes it the loopback address (as on a laptop), so nothing here listens on or talks to
another address; `RAY_USAGE_STATS_ENABLED=0` keeps Ray from reporting usage.

Under pytest-xdist (`make test TEST_WORKERS=N`), the tests on the instance run on one worker
(one xdist group): one instance starts, not one per worker, and no two share the machine's
2 CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """The `ray` module, connected to a fresh local instance with 2 CPUs."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    nodes = ray.nodes()
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"], "Ray is not on loopback"
    yield ray
    ray.shutdown()
