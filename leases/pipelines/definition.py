"""Pipeline definitions: stages of tasks, the DAG between them, and the registry by name.

A definition is checked when it is made (stage names, `requires`, cycles, `for_each`)
and when a run starts (every task names a registered handler). A run keeps the
definition's `snapshot()`, so a changed deploy does not disturb runs in flight.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from django.apps import apps
from django.utils.module_loading import autodiscover_modules

from leases.validation import check_name

from .models import NAME_LENGTH, TASK_LENGTH, Run

CONTINUE, FAIL = "continue", "fail"
_UNSET: Any = object()


@dataclass(frozen=True)
class Stage:
    """Tasks (handler names) run one after another, or at once with `parallel=True`.

    `requires` names the stages this one waits for; left out, it is the stage listed
    before (so a plain list is a sequence); `[]` starts with the run. `for_each` names
    a task of a stage this one depends on that returns a list: the tasks then run once
    per item, side by side whatever `parallel` says, at most `max_parallel` task jobs at
    once if given. A task that fails for good fails the run, unless `on_failure` is
    "continue": the stage is recorded failed and the stages after it see None. With
    `wait_for`, the stage starts only once the run has received that event
    (`run.send_event(name, data)`); the events' data is kept in the run's `events`.
    """

    name: str
    tasks: Sequence[str]
    parallel: bool = False
    requires: Sequence[str] | None = None
    for_each: str | None = None
    max_parallel: int | None = None
    on_failure: str = FAIL
    wait_for: str | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "stage name", NAME_LENGTH)
        if self.wait_for is not None:
            check_name(self.wait_for, f"stage {self.name!r}: wait_for", NAME_LENGTH)
        if isinstance(self.tasks, str) or not isinstance(self.tasks, (list, tuple)) or not self.tasks:
            raise ValueError(f"stage {self.name!r}: tasks must be a non-empty list of handler names")
        for task in self.tasks:
            check_name(task, f"stage {self.name!r}: task", TASK_LENGTH)
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"stage {self.name!r} names a task twice")
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if self.requires is not None:
            if isinstance(self.requires, str) or not isinstance(self.requires, (list, tuple)):
                raise ValueError(f"stage {self.name!r}: requires must be a list of stage names")
            object.__setattr__(self, "requires", tuple(self.requires))
        if not isinstance(self.parallel, bool):
            raise ValueError(f"stage {self.name!r}: parallel must be True or False")
        if self.max_parallel is not None and (
            isinstance(self.max_parallel, bool) or not isinstance(self.max_parallel, int) or self.max_parallel < 1
        ):
            raise ValueError(f"stage {self.name!r}: max_parallel must be a whole number >= 1, not {self.max_parallel!r}")
        if self.on_failure not in (FAIL, CONTINUE):
            raise ValueError(f"stage {self.name!r}: on_failure must be 'fail' or 'continue', not {self.on_failure!r}")
        if self.for_each is not None:
            check_name(self.for_each, f"stage {self.name!r}: for_each", TASK_LENGTH)

    @property
    def limit(self) -> int | None:
        """Tasks of this stage queued at once: one for a serial stage, else max_parallel
        (None: all). A for_each stage runs its items side by side."""
        if not self.parallel and self.for_each is None:
            return 1
        return self.max_parallel


@dataclass
class Pipeline:
    """A named DAG of stages, registered by name when made (an installed app's
    ``pipelines`` module, or a module the worker imports)."""

    name: str
    stages: Sequence[Stage]
    module: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        check_name(self.name, "pipeline name", NAME_LENGTH)
        if not isinstance(self.stages, (list, tuple)) or not self.stages:
            raise ValueError(f"pipeline {self.name!r}: stages must be a non-empty list of Stage")
        for stage in self.stages:
            if not isinstance(stage, Stage):
                raise ValueError(f"pipeline {self.name!r}: {stage!r} is not a Stage")
        self.stages = tuple(self.stages)
        self._check()
        if not self.module:
            caller = inspect.currentframe().f_back.f_back  # __init__ -> __post_init__
            self.module = caller.f_globals.get("__name__", "") if caller else ""
        register(self)

    def _check(self) -> None:
        names = [stage.name for stage in self.stages]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"pipeline {self.name!r}: two stages are named {name!r}")
            seen.add(name)
        owner: dict[str, str] = {}
        for stage in self.stages:
            for task in stage.tasks:
                if task in owner:
                    raise ValueError(
                        f"pipeline {self.name!r}: task {task!r} is in stages {owner[task]!r} and {stage.name!r};"
                        " a task may appear once (its result is looked up by name)"
                    )
                owner[task] = stage.name
        requires = self.requires()
        for stage, needs in requires.items():
            for need in needs:
                if need not in seen:
                    raise ValueError(f"pipeline {self.name!r}: stage {stage!r} requires unknown stage {need!r}")
                if need == stage:
                    raise ValueError(f"pipeline {self.name!r}: stage {stage!r} requires itself")
        order = _topological(names, requires)
        if order is None:
            raise ValueError(f"pipeline {self.name!r}: the stages' requires form a cycle")
        for stage in self.stages:
            if stage.for_each is None:
                continue
            source = owner.get(stage.for_each)
            if source is None or source not in upstream(stage.name, requires):
                raise ValueError(
                    f"pipeline {self.name!r}: stage {stage.name!r} has for_each={stage.for_each!r}, which is"
                    " not a task of a stage it depends on"
                )

    def requires(self) -> dict[str, tuple[str, ...]]:
        """Each stage's direct requirements, with the default (the stage before) filled in."""
        found: dict[str, tuple[str, ...]] = {}
        for index, stage in enumerate(self.stages):
            if stage.requires is not None:
                found[stage.name] = tuple(stage.requires)
            else:
                found[stage.name] = (self.stages[index - 1].name,) if index else ()
        return found

    def snapshot(self) -> dict[str, Any]:
        """The definition as JSON, as a run keeps it."""
        requires = self.requires()
        return {
            "name": self.name,
            "stages": [
                {
                    "name": stage.name,
                    "tasks": list(stage.tasks),
                    "parallel": stage.parallel,
                    "requires": list(requires[stage.name]),
                    "for_each": stage.for_each,
                    "max_parallel": stage.max_parallel,
                    "on_failure": stage.on_failure,
                    "wait_for": stage.wait_for,
                }
                for stage in self.stages
            ],
        }

    def start(self, context: Any = None, key: str | None = None, using: str | None = None) -> Run:
        """Start a run with `context` (JSON) and return it; with `key`, return the live
        run of that key instead when there is one (`run.created` says which).

        The runner is `leases.pipelines.runs.start`, which this app's config holds: a
        definition imports nothing that runs it."""
        runs = apps.get_app_config("leases_pipelines").runs
        return runs.start(self, context=context, key=key, using=using)


def from_snapshot(data: dict[str, Any]) -> Pipeline:
    """A run's definition as a Pipeline again (not registered)."""
    stages = [
        Stage(
            name=item["name"], tasks=item["tasks"], parallel=item["parallel"], requires=item["requires"],
            for_each=item["for_each"], max_parallel=item["max_parallel"], on_failure=item["on_failure"],
            wait_for=item.get("wait_for"),  # runs started before stages could wait have none
        )
        for item in data["stages"]
    ]
    pipeline = Pipeline.__new__(Pipeline)
    pipeline.name, pipeline.stages, pipeline.module = data["name"], tuple(stages), ""
    return pipeline


def upstream(stage: str, requires: dict[str, Iterable[str]]) -> set[str]:
    """Every stage `stage` depends on, directly or not."""
    found: set[str] = set()
    todo = list(requires.get(stage, ()))
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(requires.get(name, ()))
    return found


def downstream(stage: str, requires: dict[str, Iterable[str]]) -> set[str]:
    """Every stage that depends on `stage`, directly or not."""
    return {name for name in requires if stage in upstream(name, requires)}


def _topological(names: list[str], requires: dict[str, tuple[str, ...]]) -> list[str] | None:
    done: list[str] = []
    left = list(names)
    while left:
        ready = [name for name in left if all(need in done for need in requires[name])]
        if not ready:
            return None
        done += ready
        left = [name for name in left if name not in ready]
    return done


_PIPELINES: dict[str, Pipeline] = {}
_discovered = False


def register(pipeline: Pipeline) -> None:
    """Keep `pipeline` under its name. The same module may define it again (a reload
    or a deploy); another module naming it too is a mistake."""
    existing = _PIPELINES.get(pipeline.name)
    if existing is not None and existing.module != pipeline.module and existing.snapshot() != pipeline.snapshot():
        raise ValueError(f"pipeline {pipeline.name!r} is already defined in {existing.module or 'another module'}")
    _PIPELINES[pipeline.name] = pipeline


def discover() -> None:
    """Import every installed app's ``pipelines`` module (once per process)."""
    global _discovered
    if not _discovered:
        autodiscover_modules("pipelines")
        _discovered = True


def get(name: str) -> Pipeline:
    """The pipeline defined as `name`; ValueError naming the known ones if none is."""
    found = _PIPELINES.get(name)
    if found is None:
        discover()
        found = _PIPELINES.get(name)
    if found is None:
        known = ", ".join(sorted(_PIPELINES)[:10]) or "none defined"
        raise ValueError(f"no pipeline named {name!r} (known: {known})")
    return found


def defined() -> dict[str, Pipeline]:
    discover()
    return dict(_PIPELINES)
