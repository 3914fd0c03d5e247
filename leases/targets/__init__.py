"""What each target (a site, a domain) says of a pool's resources: bans, rests and pace.

A site's 403 or 429 says nothing about a proxy's standing elsewhere, so its verdict is
kept per (resource, target): a resource banned by one target stays usable for the others,
a cool-down (a `Retry-After`) rests it for its target only, and a pace ("one start per
2 s per proxy per domain") spaces its starts there. Quarantine of the whole resource
stays the operator's (`Pool.quarantine`). Jobs that hold resources (`leases.tasks`) and
the Scrapy middleware read and write the same rows, so they share one view of which
resource is banned where. Every time is the database server's, computed in the statement.

`verdicts` writes them (and the log of who said what), `standing` reads them for operators.
"""
from .standing import FILTER_READ, Standing, history, in_force, standing
from .verdicts import (
    FORGET_AFTER,
    REASON_LENGTH,
    Unusable,
    ban,
    forget,
    lift,
    of_resource,
    pace,
    rest,
    unusable,
    unusable_now,
    verdict,
)

__all__ = [
    "FILTER_READ", "FORGET_AFTER", "REASON_LENGTH", "Standing", "Unusable", "ban", "forget", "history", "in_force",
    "lift", "of_resource", "pace", "rest", "standing", "unusable", "unusable_now", "verdict",
]
