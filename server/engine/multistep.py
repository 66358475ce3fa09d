"""When a multi-step run ends early for the requests that arrived during it.

A run of up to `--scheduler-steps` decode steps pays the scheduler's host work once (its pass boundary).
A request that arrives during the run either ends it at once, paying a boundary early, or waits
for its end with its slot idle. Ending early is worth it when the idle rows would lose more
row-steps than the boundary costs the running rows. With many rows running, a boundary costs them more
row-steps than one idle row loses by the run's end, so one arrival waits; with a few rows it joins at once.
Both costs are the engine's own timings (`PassCosts`), not constants. A streamed request always joins at
once: its client watches for the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.scheduler import Scheduler


@dataclass
class PassCosts:
    """Running means of a pass boundary's host work (the scheduler, events, metrics, row moves) and of a
    multi-step run's decode step, in seconds, as the engine measures them."""

    boundary_seconds: float = 0.0
    step_seconds: float = 0.0
    weight: float = 0.1  # of each new figure: the means follow a change of batch size within some passes

    def observe_boundary(self, seconds: float) -> None:
        self.boundary_seconds += self.weight * (seconds - self.boundary_seconds)

    def observe_steps(self, seconds: float, steps: int) -> None:
        per_step = seconds / steps
        self.step_seconds = (
            per_step if not self.step_seconds else (self.step_seconds + self.weight * (per_step - self.step_seconds))
        )


def joinable_rows(scheduler: Scheduler) -> int:
    """Rows the queue would fill at the next admission."""
    return sum(submission.request.rows for submission in scheduler.admissible())


def ends_run_early(scheduler: Scheduler, steps_left: int, costs: PassCosts) -> bool:
    """Whether a run should stop before its `steps_left` last steps so that waiting requests join now:
    the head of the queue fits, and its client watches each step, or the rows that would join lose more
    idle row-steps by the run's end than a boundary costs the running rows. Unmeasured costs (0.0)
    end it: a request joins at once."""
    joining = scheduler.admissible()
    if not joining:
        return False
    if joining[0].each_event or costs.step_seconds <= 0.0:
        return True
    rows = sum(submission.request.rows for submission in joining)
    return rows * steps_left * costs.step_seconds >= costs.boundary_seconds * scheduler.running
