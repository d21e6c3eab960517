"""``python -m orchestrator.rendezvous.warm``: a node agent's interpreter, started before its command line is known.

An agent spends most of its start importing torch's elastic agent (~1.5 s of the ~1.7 s before it can start
its workers, here). ``orch launch`` starts one at its first moment when the launch most likely runs its nodes
here (:func:`orchestrator.lifecycle.cli.start_agent_ahead`), and the local launcher one for every other node
once the launch has passed its checks, so that those imports overlap composing, checking, hosting the store,
writing the run dir and planning.
Once the node's command line is known, the driver writes it and the node's environment as one JSON line on
this process's stdin (a pipe from the driver, nothing else reaches it), and this process becomes that agent:
the same ``orchestrator.rendezvous.agent`` ``main`` with the same ``sys.argv`` and ``os.environ`` as
``python -m orchestrator.rendezvous.agent ...`` would have had. If stdin closes first (the launch needed fewer
agents, or ended before starting them), it exits quietly.

Only what an interpreter reads at start-up cannot be handed over this way (``PYTHON*`` variables, the
executable): :meth:`orchestrator.processes.WarmInterpreter.fits` sends a node whose command line or environment
differs there to a fresh interpreter instead.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

AGENT_MODULE = "orchestrator.rendezvous.agent"
"""What runs in torchrun's place when the store is gated (see :mod:`orchestrator.rendezvous.args`)."""
WARM_MODULE = "orchestrator.rendezvous.warm"
"""This module: an agent interpreter started ahead, which becomes :data:`AGENT_MODULE`."""


def main() -> None:
    import torch.distributed.run  # noqa: F401 - the slow part, done while the driver prepares the launch

    agent = importlib.import_module(AGENT_MODULE)  # by name: the agent's own modules name this one

    order = sys.stdin.readline()
    if not order.strip():
        return  # not needed
    given = json.loads(order)
    devnull = os.open(os.devnull, os.O_RDONLY)  # as a fresh agent's: torchrun's workers inherit fd 0
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(given["env"])
    sys.argv = [agent.__file__, *given["args"]]
    agent.main()


if __name__ == "__main__":
    main()
