"""What the fork server of the tests' child processes imports before it forks any: Django,
set up once from DJANGO_SETTINGS_MODULE, so that a child unpickles its target (whose module
imports models) without setting it up again (see tests.conftest.CONTEXT)."""
import django

django.setup()
