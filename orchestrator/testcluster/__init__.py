"""Multi-node test clusters on one machine: Linux network namespaces on a private bridge, with real per-node
addresses and hostnames, and real network faults. See docs/testing-in-ci.md.

``state`` is pure data (what planning reads); ``cluster`` creates, inspects, faults and removes clusters;
``pytest_plugin`` is the ``testcluster`` fixture.
"""

from orchestrator.testcluster.state import ClusterState, NodeHost, load_state, require_state

__all__ = ["ClusterState", "NodeHost", "load_state", "require_state"]
