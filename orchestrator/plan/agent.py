"""One node's torchrun agent as a blueprint (torch elastic's ``WorkerSpec``): everything the plan knows of its
command line, with the two things only a launch knows left open. The fault-tolerance mode gives every agent
it starts its rendezvous (:class:`~orchestrator.rendezvous.args.AgentRendezvous`: id, node count, environment), and the site knows whether
the store is gated; :meth:`AgentTemplate.command` then writes the command. Nothing edits a command by argv
position afterwards."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Optional

from orchestrator.rendezvous.args import AgentRendezvous, agent_prefix, rendezvous_argv


@dataclass(frozen=True)
class AgentTemplate:
    """Node ``role``'s agent: torchrun's options and the entrypoint its workers run."""

    python: str
    nproc_per_node: int
    rendezvous_endpoint: str
    rendezvous_conf: str
    max_restarts: int
    role: str
    log_dir: str
    entrypoint: tuple[str, ...]
    local_addr: Optional[str] = None
    """The agent's own host name (``--local-addr``), where a site pins nodes to hosts."""
    monitor_interval_s: float = 0.5

    def command(self, rendezvous: AgentRendezvous, gated: bool = True) -> tuple[str, ...]:
        """The agent's command line: torchrun behind orch's agent module when the store is ``gated`` (every
        store a launch hosts), plain torchrun for a store without the run's secret."""
        # The role names the node, so torchrun's --tee prefixes each worker line with node and local rank
        # ("[node1-local0]:"); per-rank, per-attempt log files go under the run dir's logs/.
        return (
            *agent_prefix(self.python, gated),
            f"--nnodes={rendezvous.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            *rendezvous_argv(self.rendezvous_endpoint, rendezvous.id, self.rendezvous_conf),
            f"--max-restarts={self.max_restarts}",
            *((f"--local-addr={self.local_addr}",) if self.local_addr else ()),
            f"--monitor-interval={self.monitor_interval_s:g}",
            f"--role={self.role}",
            "--tee=3",
            f"--log-dir={self.log_dir}",
            *self.entrypoint,
        )

    def command_line(self, rendezvous: AgentRendezvous, gated: bool = True) -> str:
        return shlex.join(self.command(rendezvous, gated))
