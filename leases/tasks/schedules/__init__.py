"""Recurring and one-off jobs and pipeline runs, in the order a schedule lives:

- `timing`: when ticks fall (cron in a time zone, every N seconds, once at a moment);
- `define`: `schedule()`, `unschedule()`, `set_enabled()`, LEASES_SCHEDULES applied;
- `serving`: which queue a schedule's jobs go on, and which live workers serve it;
- `fire`: the pass that fires due ticks in one transaction per batch, and runs' endings;
- `leader`: the worker that leads (through this project's own lock) runs the passes.
"""
from .define import apply_settings, check, schedule, set_enabled, unschedule
from .fire import (
    BATCH,
    CATCH_UP_MAX,
    LATE_AFTER,
    RUN_ENDED,
    fire_due,
    fire_now,
    fire_some,
    plan,
    runs_ended,
    status_of,
    tick_key,
)
from .timing import MIN_EVERY, Timing, check_timing

__all__ = [
    "BATCH", "CATCH_UP_MAX", "LATE_AFTER", "MIN_EVERY", "RUN_ENDED", "Timing", "apply_settings", "check",
    "check_timing", "fire_due", "fire_now", "fire_some", "plan", "runs_ended", "schedule", "set_enabled",
    "status_of", "tick_key", "unschedule",
]
