"""The Ray-driven controller: an explicit state machine that places one torchrun agent per node, keeps the
rendezvous store alive in the driver, and answers lost nodes, new nodes and failures.

- ``api``: the data model (nodes, agent specs, agent exits) and the ``NodePool`` protocol the controller acts
  through.
- ``failure_policy`` / ``scaling_policy``: small modules that decide; they start and stop nothing.
- ``states``: one class per state (scheduling, running, recovering, finished, failed).
- ``controller``: the ``Controller`` that acts on the decisions and records every event.
- ``ray_pool`` / ``node_agent``: node agents as Ray actors (the only modules here that import Ray).
"""
