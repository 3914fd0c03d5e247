from django.apps import AppConfig


class TasksConfig(AppConfig):
    name = "leases.tasks"
    label = "leases_tasks"
    verbose_name = "Leases: work"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import registry, sql  # noqa: F401 - sql registers the job queue's statements
        from .schedules import RUN_ENDED, runs_ended

        registry.add_finisher(RUN_ENDED, runs_ended)
