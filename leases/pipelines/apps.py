from django.apps import AppConfig


class PipelinesConfig(AppConfig):
    name = "leases.pipelines"
    label = "leases_pipelines"
    verbose_name = "Leases: pipelines"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from leases.tasks import registry

        from .engine import BACKEND, TASK_ENDED, task_runner, tasks_ended

        registry.add_runner(BACKEND, task_runner)
        registry.add_finisher(TASK_ENDED, tasks_ended)
