"""The cluster tier: nodes as network namespaces on this machine (tests/cluster/nodes.py).

    .venv/bin/python -m pytest -q -m cluster tests/cluster        # as root; `make test-cluster`

Every test here is marked `cluster` (not in the default tier) and skips, naming the reason, where
nodes cannot be made. The fixture tears the nodes down after the module and fails the module's
last test if anything of them is left behind.
"""

from __future__ import annotations

import pytest

from tests.cluster.nodes import Cluster, unavailable


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cluster/" in str(item.fspath):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="module")
def cluster():
    why = unavailable()
    if why:
        pytest.skip(why)
    c = Cluster(2).up()
    try:
        yield c
    finally:
        c.down()
    assert c.leftovers() == [], f"the cluster left {c.leftovers()}"
