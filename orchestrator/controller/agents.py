"""The agents a launch starts, as the controller asks for them: what node i's agent runs and what happens when
one is gone, from the plan (its template), the fault-tolerance mode (each agent's rendezvous) and the launch
(the run's secret, whether the store is gated). The controller never builds or edits a command itself."""

from __future__ import annotations

import os
from typing import Mapping

from orchestrator.controller.agent_env import forwarded_env
from orchestrator.controller.api import AgentSpec
from orchestrator.ft.driver import DriverMode, attempt_rendezvous_id
from orchestrator.plan.plan import LaunchPlan


class AgentMaker:
    """``plan``'s agents under ``mode``. ``secret_env``: what only the agents' environment holds (the run's
    secret; never recorded); ``gated``: the store admits only holders of that secret (agents dial it through
    orch's agent module)."""

    def __init__(self, plan: LaunchPlan, mode: DriverMode, secret_env: Mapping[str, str], gated: bool):
        self.plan, self.mode, self.secret_env, self.gated = plan, mode, dict(secret_env), gated

    def run_rendezvous(self, attempt: int) -> str:
        """The run's rendezvous id in ``attempt`` (what a test cluster's round watch follows)."""
        return attempt_rendezvous_id(self.plan.run_id, attempt)

    def spec(self, agent_id: int, node: int, attempt: int, log_path: str) -> tuple[AgentSpec, str]:
        """Agent ``agent_id`` playing ``node``: its spec, and the rendezvous id it joins."""
        nodeplan = self.plan.nodes[node]
        rendezvous = self.mode.agent_rendezvous(self.plan.run_id, node, agent_id, attempt)
        env = {**forwarded_env(os.environ, os.getcwd()), **nodeplan.env, **rendezvous.env, **self.secret_env}
        argv = nodeplan.agent.command(rendezvous, self.gated)
        return AgentSpec(agent_id, node, argv, env, log_path, os.getcwd()), rendezvous.id

    def gone(self, agent_id: int, node: int, pid: int, rendezvous_id: str) -> None:
        """Agent ``agent_id`` (PID ``pid``) left: the mode takes it out of its rendezvous or quorum now."""
        self.mode.agent_gone(agent_id, node, pid, rendezvous_id)
