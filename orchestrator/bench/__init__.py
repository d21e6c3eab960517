"""Benchmarks behind ``orch bench ...``: side-by-side comparisons, never timed unit tests."""
