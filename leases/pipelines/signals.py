"""Signals sent once a step of a run has committed (sender: the Run class).

- ``task_finished(run, stage, task)``: a task's outcome was recorded.
- ``stage_finished(run, stage)``: a stage succeeded or failed.
- ``pipeline_finished(run)``: a run succeeded, failed or was cancelled.

They are sent by the process that made the step, at most once per step: a step whose
COMMIT reply was lost is found done when it runs again, and sends nothing. An exception
in a receiver is logged, not raised. `task_finished` is sent from the main loop of the
worker that wrote the task's outcome, so its receivers must be quick; the others run in
the advance event's job (or the caller of start, cancel, restart...).
"""
from django.dispatch import Signal

task_finished = Signal()
stage_finished = Signal()
pipeline_finished = Signal()
