from django.apps import AppConfig


class TasksConfig(AppConfig):
    name = "leases.tasks"
    label = "leases_tasks"
    verbose_name = "Leases: work"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.checks import register

        from leases import conf

        register(conf.check_settings)  # also when `leases` is missing: leases.E014 says so
        conf.replace_tasks_framework_check()
        if not self.apps.is_installed("leases"):
            return  # what follows runs on the base app's models
        from . import registry
        from .jobs import results
        from .schedules.fire import RUN_ENDED, runs_ended

        self.results = results  # for Job.wait: the models import none of the behaviour above them

        registry.add_finisher(RUN_ENDED, runs_ended)

        from leases.ops.readings import add_metrics, add_panels

        from . import readings

        add_panels(10, readings.job_panels)  # first on the dashboard; the pools come at 20
        add_panels(30, readings.dispatcher_panels)
        add_metrics(20, readings.job_metrics)
        add_metrics(25, readings.resource_job_metrics)
        add_metrics(26, readings.durable_job_metrics)
        add_metrics(30, readings.dispatcher_metrics)
