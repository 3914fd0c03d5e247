"""The named values of the base app's columns, which Python and the SQL statements share
(`leases.sql` names them as literals). Apart from the models, so the statements can be
built, and the settings checked, before the app's models load."""
from django.db import models


class VerdictKind(models.TextChoices):
    """What a line of the verdict log says: a target banned or rested a resource, or an
    operator lifted its bans and rests."""

    BAN = "ban", "banned"
    REST = "rest", "rested"
    LIFT = "lift", "lifted"
