"""The one controller behind every launcher: an explicit state machine that starts one torchrun agent per
node through a node pool, next to the rendezvous store, and answers lost nodes, new nodes, notices and failures.

- ``api``: the data model (machines, agent specs, starts and exits, statuses), the ``NodePool`` protocol the
  controller acts through, ``RunHooks`` for a launch's side duties, and the clock.
- ``failure_policy`` / ``scaling_policy`` / ``standby_policy``: small modules that decide; they start nothing.
- ``states``: the states, as data.
- ``controller``: the ``Controller`` that acts on the decisions and records every event.
- ``pools/``: where agents run: ``local`` (processes on this machine), ``ray`` + ``node_agent`` (Ray actors,
  the only modules here that import Ray); ``log_echo`` follows node logs to the terminal.
"""
