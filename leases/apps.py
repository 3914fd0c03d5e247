from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "leases"
    verbose_name = "Leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.checks import register

        from . import conf, db

        register(conf.check_settings)
        register(db.check_databases)

        from .ops import pools, readings

        readings.add_panels(20, pools.pool_panels)  # after the jobs' charts (10), before the dispatchers (30)
        readings.add_metrics(10, pools.lease_metrics)
