"""``python -m orchestrator.rendezvous.tunnel <torchrun arguments>``: torchrun, dialing orch's store through an
authenticating tunnel (see :mod:`orchestrator.rendezvous.gate`).

The controller starts every agent this way when the store is gated: this process starts a
:class:`~orchestrator.rendezvous.gate.StoreTunnel` to the ``--rdzv-endpoint`` (the gate), points torchrun at
the tunnel instead, and runs torchrun's ``main`` in-process, so the tunnel lives exactly as long as the agent.
"""

from __future__ import annotations

import os
import sys

from orchestrator.rendezvous.gate import RUN_SECRET_ENV, StoreTunnel

ENDPOINT_FLAG = "--rdzv-endpoint="
MODULE = "orchestrator.rendezvous.tunnel"  # run in torchrun's place: python -m orchestrator.rendezvous.tunnel


def tunneled(argv: list[str], secret: str) -> tuple[list[str], StoreTunnel]:
    """``argv`` with its ``--rdzv-endpoint`` replaced by a tunnel to it, and the tunnel."""
    (i, endpoint), = [(i, a[len(ENDPOINT_FLAG):]) for i, a in enumerate(argv) if a.startswith(ENDPOINT_FLAG)]
    host, port = endpoint.rsplit(":", 1)
    tunnel = StoreTunnel((host.strip("[]"), int(port)), secret)
    return [*argv[:i], f"{ENDPOINT_FLAG}127.0.0.1:{tunnel.port}", *argv[i + 1:]], tunnel


def main() -> None:
    secret = os.environ.get(RUN_SECRET_ENV, "")
    if not secret:
        sys.exit(f"orchestrator.rendezvous.tunnel: {RUN_SECRET_ENV} is not set (orch's launcher sets it)")
    args, _tunnel = tunneled(sys.argv[1:], secret)
    from torch.distributed.run import main as torchrun_main

    sys.argv = ["torchrun", *args]
    torchrun_main(args)


if __name__ == "__main__":
    main()
