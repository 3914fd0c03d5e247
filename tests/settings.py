"""The demo project's settings as the test suite runs them: always with the second database,
which the tests of work spread over two databases use (the demo configures it only when
DATABASE_URL_SECOND or LEASES_ROUTES asks for it)."""
from project.settings import *  # noqa: F403
from project.settings import DATABASES, second_database

DATABASES.setdefault("second", second_database())
