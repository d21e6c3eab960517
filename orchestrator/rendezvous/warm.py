"""``python -m orchestrator.rendezvous.warm``: a node agent's interpreter, started before its command line is known.

An agent spends most of its start importing torch's elastic agent (~1.5 s of the ~1.7 s before it can start
its workers, here). The local launcher starts one of these per node as soon as its launch has passed its
checks, while the driver still hosts the store, writes the run dir and plans, so that import overlaps them.
Once the node's command line is known, the driver writes it and the node's environment as one JSON line on
this process's stdin (a pipe from the driver, nothing else reaches it), and this process becomes that agent:
the same ``orchestrator.rendezvous.agent`` ``main`` with the same ``sys.argv`` and ``os.environ`` as
``python -m orchestrator.rendezvous.agent ...`` would have had. If stdin closes first (the launch needed fewer
agents, or ended before starting them), it exits quietly.

Only what an interpreter reads at start-up cannot be handed over this way (``PYTHON*`` variables, the
executable): :func:`orchestrator.processes.WarmAgent.fits` sends a node whose command line or environment
differs there to a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import torch.distributed.run  # noqa: F401 - the slow part, done while the driver prepares the launch

    from orchestrator.rendezvous import agent

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
