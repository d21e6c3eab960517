"""Exit-barrier policy: when agents that linger after training has finished are stopped. Decides; stops nothing.

torchrun's exit barrier waits 300 s (not configurable) for a peer that left after the last step. Once one agent
has exited, the others get EXIT_BARRIER_GRACE_S to follow; with none gone, workers may still be writing their
last checkpoint on a loaded machine, so they get EXIT_TIMEOUT_S.
"""

from __future__ import annotations

from typing import Optional

EXIT_BARRIER_GRACE_S = 10.0  # training done and a peer gone, yet an agent waits in torchrun's exit barrier for it
EXIT_TIMEOUT_S = 120.0  # training done, and no agent has exited at all: stop them (a peer died after the last step)


class ExitBarrier:
    """Remembers the first agent exit after training finished and says, once, when the rest should be stopped."""

    def __init__(self) -> None:
        self.first_exit_t: Optional[float] = None  # monotonic time of the first exit after training finished
        self._stopped = False

    def agent_exited(self, now: float, training_done: bool) -> None:
        if training_done and self.first_exit_t is None:
            self.first_exit_t = now

    def stop_lingering(self, now: float, training_finished_t: float, agents_left: bool) -> bool:
        """Whether to stop the agents still running now (True at most once)."""
        since = now - (self.first_exit_t or training_finished_t)
        if self._stopped or not agents_left:
            return False
        if since > (EXIT_BARRIER_GRACE_S if self.first_exit_t is not None else EXIT_TIMEOUT_S):
            self._stopped = True
            return True
        return False
