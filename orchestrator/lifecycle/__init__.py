"""A run's life after ``orch launch``: the launch record (``launch.json``), detached launches, Ray jobs, and the
commands that find a run again (``orch status``, ``orch logs``, ``orch stop``, ``orch resume``). See
docs/lifecycle.md."""
