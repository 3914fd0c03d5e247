from django.apps import AppConfig


class PipelinesConfig(AppConfig):
    name = "leases.pipelines"
    label = "leases_pipelines"
    verbose_name = "Leases: pipelines"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Plug the pipelines into the job queue: their tasks' runner and finisher, and the
        schedule target that starts runs. `runs` is kept here for the models and the
        definitions, which sit below it and import none of it."""
        from django.core.checks import register

        from leases import conf

        register(conf.check_settings)  # also when leases.tasks is missing: leases.E015 says so
        if not self.apps.is_installed("leases.tasks") or not self.apps.is_installed("leases"):
            return  # what follows runs on the job queue, and it on the base app (E014, E015)
        from leases.tasks import registry

        from . import definition, machine, outcomes, payload, runs
        from .handlers import START, start_queue

        self.runs = runs
        registry.add_runner(machine.BACKEND, payload.task_runner)
        registry.add_claim_reader(machine.BACKEND, payload.read_tasks)
        registry.add_finisher(machine.TASK_ENDED, outcomes.tasks_ended)
        registry.add_target(registry.Target(
            kind="pipeline", handler=START, check=lambda name: definition.get(name).name,
            payload=lambda name, context, key: {"pipeline": name, "context": context, "key": key},
            queue=start_queue,
        ))

        from leases.ops.readings import add_metrics, add_panels

        from . import readings

        add_panels(40, readings.run_panels)  # last on the dashboard
        add_metrics(40, readings.run_metrics)
