"""orch for training code built on other libraries (docs/integrations.md).

- :mod:`orchestrator.integrations.hf`: a ``transformers.Trainer`` callback (needs the ``hf`` extra);
- ``accelerate`` and plain torchrun DDP scripts need nothing from here: wrap their loop in an
  :mod:`orchestrator.elastic` session (docs/integrations.md shows the lines).

Importing this package imports no third-party library; each submodule imports its own.
"""
