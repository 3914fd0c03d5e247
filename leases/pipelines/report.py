"""A run as an operator looks at it: its stages, their task counts, a bounded sample of
tasks and when each ran, read once by the database clock.

`manage.py pipeline show` prints it and the admin's run page draws it. A stage of 10,000
tasks costs a few grouped counts and TASK_LINES rows per stage, never 10,000 rows.

Progress says what happened, not only how far: "9/9 (2 failed)", the failed tasks read
through the (stage, status) index, so counting them costs as much as there are failures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Case, Count, IntegerField, When

from leases import db
from leases.clock import db_now
from leases.tasks.models import Job

from .models import Run, StageRun, TaskRun

#: Tasks shown per stage; the rest of a big stage is counted by status.
TASK_LINES = 50
#: What a report calls a queued task whose job a worker holds.
RUNNING = "running"
#: Order of statuses when the tasks left out are counted.
STATUS_ORDER = ("succeeded", RUNNING, "queued", "waiting", "failed", "cancelled", "skipped")


def progress(done: int, total: int, failed: int, unit: str = "") -> str:
    """Tasks finished of those made, and how many failed: "9/9", "9/9 (2 failed)"."""
    return f"{done}/{total}{unit}" + (f" ({failed} failed)" if failed else "")


def failed_tasks(run_ids: list[int], using: str | None = None) -> dict[int, int]:
    """The failed tasks of each run, by run id (runs without any left out): two reads,
    the runs' stages, then their failed tasks through the (stage, status) index."""
    using = db.alias(using)
    stages = list(StageRun.objects.using(using).filter(run_id__in=run_ids).values_list("pk", flat=True))
    if not stages:
        return {}
    rows = (TaskRun.objects.using(using).order_by().filter(stage_id__in=stages, status=TaskRun.FAILED)
            .values_list("run_id").annotate(n=Count("id")))
    return dict(rows)


@dataclass(frozen=True)
class Bar:
    """One task on the timeline: from its start to its end (now, while it runs)."""

    stage: StageRun
    task: TaskRun
    status: str
    start: datetime
    end: datetime


@dataclass(frozen=True)
class Timeline:
    """The started tasks of the report on one axis, from the run's queueing to its end
    (now, while it is live; later, if a task finished after the run ended)."""

    origin: datetime
    seconds: float
    bars: list[Bar]
    not_started: int

    def offset(self, moment: datetime) -> float:
        """Where `moment` falls on the axis, 0.0 to 1.0."""
        return min(max((moment - self.origin).total_seconds() / self.seconds, 0.0), 1.0)


class RunReport:
    """The state of one run, read in a handful of queries when made."""

    def __init__(self, run: Run, using: str | None = None) -> None:
        using = db.alias(using or run._state.db)
        self.run = run
        self.using = using
        self.now = db_now(using)
        self.stages = list(StageRun.objects.using(using).filter(run=run).order_by("position"))
        self.counts: dict[int, Counter] = {stage.pk: Counter() for stage in self.stages}
        grouped = TaskRun.objects.using(using).filter(run=run).order_by().values("stage_id", "status")
        for row in grouped.annotate(n=Count("id")):
            self.counts[row["stage_id"]][row["status"]] = row["n"]
        self.picked = {stage.pk: self._pick(stage) for stage in self.stages}
        queued = [
            t.job_id
            for tasks in self.picked.values()
            for t in tasks
            if t.status == TaskRun.QUEUED and t.job_id
        ]
        rows = Job.objects.using(using).filter(pk__in=queued).values_list("id", "status", "started_at")
        self.jobs = {pk: (status, started) for pk, status, started in rows}

    def _pick(self, stage: StageRun) -> list[TaskRun]:
        """Up to TASK_LINES tasks of the stage, in order; when there are more, the failed
        and queued ones first, as those are what an operator looks for."""
        rank = Case(
            When(status=TaskRun.FAILED, then=0),
            When(status=TaskRun.QUEUED, then=1),
            default=2,
            output_field=IntegerField(),
        )
        tasks = TaskRun.objects.using(self.using).filter(stage=stage).defer("item", "result")
        chosen = list(tasks.annotate(rank=rank).order_by("rank", "position")[:TASK_LINES])
        return sorted(chosen, key=lambda task: task.position)

    @property
    def tasks_done(self) -> int:
        return sum(stage.done for stage in self.stages)

    @property
    def tasks_total(self) -> int:
        """Tasks made so far (a for_each adds its items when its stage starts)."""
        return sum(stage.total for stage in self.stages)

    @property
    def live(self) -> bool:
        return self.run.status in Run.LIVE

    def status(self, task: TaskRun) -> str:
        """The task's status, RUNNING for a queued task whose job a worker holds."""
        job = self.jobs.get(task.job_id) if task.status == TaskRun.QUEUED else None
        return RUNNING if job and job[0] == Job.RUNNING else task.status

    def times(self, task: TaskRun) -> tuple[datetime | None, datetime | None]:
        """When the task started and ended; for a running task (whose own times are
        written when it ends) its job's start, and now."""
        if self.status(task) != RUNNING:
            return task.started_at, task.finished_at
        return self.jobs[task.job_id][1], self.now

    def total(self, stage: StageRun) -> int:
        return sum(self.counts[stage.pk].values())

    def done(self, stage: StageRun) -> int:
        return sum(n for status, n in self.counts[stage.pk].items() if status in TaskRun.FINISHED)

    def failed(self, stage: StageRun | None = None) -> int:
        """Failed tasks of `stage`, or of the whole run."""
        stages = [stage] if stage is not None else self.stages
        return sum(self.counts[one.pk][TaskRun.FAILED] for one in stages)

    def stage_times(self, stage: StageRun) -> tuple[datetime | None, datetime | None, datetime | None]:
        """(start, end, now while it runs): a stage's first task start is written when it
        ends, so until then its start is when its tasks were queued."""
        going = self.now if stage.status == StageRun.RUNNING else None
        return stage.started_at or stage.queued_at, stage.finished_at, going

    def left_out(self, stage: StageRun) -> Counter:
        """The stage's tasks not in `picked`, by status (RUNNING counted apart)."""
        rest = self.counts[stage.pk] - Counter(task.status for task in self.picked[stage.pk])
        if rest[TaskRun.QUEUED]:
            queued = TaskRun.objects.using(self.using).filter(stage=stage, status=TaskRun.QUEUED)
            queued = queued.exclude(pk__in=[task.pk for task in self.picked[stage.pk]]).values("job_id")
            running = Job.objects.using(self.using).filter(pk__in=queued, status=Job.RUNNING).count()
            rest[RUNNING], rest[TaskRun.QUEUED] = running, rest[TaskRun.QUEUED] - running
        return +rest

    def timeline(self) -> Timeline | None:
        """The picked tasks that started, on a common axis; None when none has."""
        bars: list[Bar] = []
        shown = 0
        ends = [self.run.finished_at or self.now]
        for stage in self.stages:
            for task in self.picked[stage.pk]:
                shown += 1
                start, end = self.times(task)
                if start is not None:
                    end = end or self.now
                    ends.append(end)
                    bars.append(Bar(stage, task, self.status(task), start, end))
        if not bars:
            return None
        origin = self.run.queued_at
        seconds = max((max(ends) - origin).total_seconds(), 1e-3)
        return Timeline(origin, seconds, bars, shown - len(bars))
