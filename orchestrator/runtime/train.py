"""``python -m orchestrator.runtime.train``: the built-in trainer's entry point before it moved to
:mod:`orchestrator.trainer.train`, kept for what still names it (launch plans made before the move). It runs
that module as ``__main__`` by name, so the runtime layer imports nothing of the trainer above it.
"""

if __name__ == "__main__":
    import runpy

    runpy.run_module("orchestrator.trainer.train", run_name="__main__", alter_sys=True)
