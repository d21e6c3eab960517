"""pytest plugin (opt-in: ``pytest -p orch_testcluster`` or ``pytest_plugins = ["orch_testcluster"]``): the
``testcluster`` fixture.

    def test_allreduce_across_hosts(testcluster):            # 3 hosts by default
        result = subprocess.run(["orch", "launch", "conf=cpu_gloo", *testcluster.launch_overrides(),
                                 "cluster.nnodes=3"])
        ...

    @pytest.mark.testcluster(nodes=2)
    def test_partition(testcluster):
        testcluster.partition(1); ...; testcluster.heal(1)

The fixture yields a ``TestCluster`` (``nodes``, ``addresses``, ``hostnames``, ``netns``, ``store_address``,
``partition``/``heal``/``kill``, ``run(node, *argv)``, ``pids(node)``) and always removes the cluster
afterwards, test failed or not. Where namespaces cannot be made (not root, no iproute2, a sandbox that
forbids them) the test is skipped with a one-line reason. Importing this module is cheap and has no
side effects.
"""

from __future__ import annotations

import os
import re

import pytest

_probe_result: list = []  # [reason or None], once per session


def testcluster_unavailable() -> str | None:
    """Why test clusters cannot be made on this machine (one line), or None if they can."""
    if _probe_result:
        return _probe_result[0]
    reason = None
    try:
        from orchestrator.errors import UserError
        from orchestrator.testcluster import netns as nx

        nx.require_root("the testcluster fixture")
        probe = f"orch-probe-{os.getpid()}"
        made = nx.ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            reason = f"network namespaces are not allowed here: {made.stderr.strip() or 'ip netns add failed'}"
        else:
            nx.ip("netns", "del", probe, check=False)
    except UserError as exc:
        reason = str(exc)
    except OSError as exc:
        reason = f"network namespaces are not available: {exc}"
    _probe_result.append(reason)
    return reason


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "testcluster(nodes=3, name=None): size and name of the `testcluster` fixture's cluster")


@pytest.fixture
def testcluster(request):
    """A fresh test cluster (3 nodes unless ``@pytest.mark.testcluster(nodes=N)``), removed afterwards."""
    reason = testcluster_unavailable()
    if reason:
        pytest.skip(f"testcluster: {reason}")
    from orchestrator.testcluster.cluster import TestCluster, down

    marker = request.node.get_closest_marker("testcluster")
    kwargs = marker.kwargs if marker else {}
    nodes = int(kwargs.get("nodes", 3))
    # Short, unique per worker process and test: parallel sessions never share or remove each other's cluster.
    name = kwargs.get("name") or "t" + re.sub(r"[^a-z0-9]", "", f"{os.getpid():x}{abs(hash(request.node.nodeid)) % 4096:x}")[:12]
    try:
        cluster = TestCluster.up(name, nodes)
    except BaseException:
        down(name)
        raise
    try:
        yield cluster
    finally:
        down(name)
