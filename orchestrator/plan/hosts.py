"""Where a node runs when a site pins its nodes to hosts (a test cluster's network namespaces, say): a neutral
record the plan carries and the controller and pools use, whatever the site."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostRecord:
    """One node's host."""

    address: str
    """The host's address: what its agent's machine reports as its IP (the controller places node i there)."""
    hostname: str
    """The host's name: its agent's ``--local-addr`` (rank 0's becomes the workers' rendezvous address)."""
    env: dict[str, str] = field(default_factory=dict)
    """What the node's environment needs on this host (its interface for gloo, say)."""
    wrapper: tuple[str, ...] = ()
    """The command prefix that runs a command on the host (empty: this machine as it is)."""

    def run(self, argv: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """``argv`` as run on this host."""
        return (*self.wrapper, *argv)
