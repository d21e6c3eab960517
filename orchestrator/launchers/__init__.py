"""Launchers: one module per backend, each turning a LaunchPlan into running torchrun agents."""
