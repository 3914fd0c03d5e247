from django.apps import AppConfig


class TasksConfig(AppConfig):
    name = "leases.tasks"
    label = "leases_tasks"
    verbose_name = "Leases: work"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import sql  # noqa: F401 - registers the job queue's statements
