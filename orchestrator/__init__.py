"""orch: an elastic distributed training orchestrator for PyTorch."""

__version__ = "0.1.0"
