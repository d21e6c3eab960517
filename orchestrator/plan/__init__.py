"""Pure planning: config -> LaunchPlan (what runs where), and the machine checks a plan needs."""

from orchestrator.plan.plan import CONFIG_FILE, PLAN_FILE, LaunchPlan, NodePlan, build_plan

__all__ = ["LaunchPlan", "NodePlan", "build_plan", "CONFIG_FILE", "PLAN_FILE"]
