"""What a handler's jobs hold while they run: a lease on one resource of a pool.

``@handler("crawl.fetch", lease="proxies")`` or, with options,
``@handler("crawl.fetch", lease=Needs("proxies", where={"region": "eu"}, target=domain,
affinity=session, pace=2, ban_for=1800, cooldown=0))``. A job of such a handler is claimed
only together with a lease on a qualifying free resource (`leases.tasks.jobs.leasing`);
until one qualifies it waits in the database, holding no worker thread.

- `where`: resources whose data has these values qualify (``{"region": "eu"}``);
- `target`: the job's target (a string, or a function of what the handler receives, e.g.
  the URL's domain), for per-target bans, rests and pace (`leases.targets`) and for taking
  turns when resources are scarce;
- `affinity`: a function of what the handler receives (a login session): jobs of one
  affinity key run on the resource they last used while it is usable;
- `pace`: seconds between two starts on one resource for one target (2, or a rate such as
  "30/m");
- `ban_for`: seconds of a ban the handler declares without saying how long;
- `cooldown`: seconds a resource rests after a job of this handler releases it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from leases.encoding import dump_json
from leases.validation import POOL_NAME_LENGTH, check_cooldown, check_name, check_seconds, check_target

from .jobs.limits import parse_rate
from .models import AFFINITY_LENGTH

#: Default of a ban the handler declares without a duration.
BAN_FOR = 3600.0

Key = str | Callable[[Any], str] | None


@dataclass(frozen=True)
class Needs:
    """A lease on one resource of `pool` for each job of a handler (see the module)."""

    pool: str
    where: Mapping[str, Any] = field(default_factory=dict)
    target: Key = None
    affinity: Callable[[Any], str] | None = None
    pace: float | str | None = None
    ban_for: float = BAN_FOR
    cooldown: float = 0.0

    def __post_init__(self) -> None:
        check_name(self.pool, "lease pool", POOL_NAME_LENGTH)
        if not isinstance(self.where, Mapping) or not all(isinstance(key, str) for key in self.where):
            raise ValueError(f"lease where= must be a dict of data keys to values, not {self.where!r}")
        dump_json(dict(self.where), "lease where=")
        if self.target is not None and not callable(self.target):
            check_target(self.target)
        if self.affinity is not None and not callable(self.affinity):
            raise ValueError(f"lease affinity= must be a function of the payload, not {self.affinity!r}")
        object.__setattr__(self, "pace", pace_seconds(self.pace))
        object.__setattr__(self, "ban_for", check_seconds(self.ban_for, "lease ban_for", above=True))
        object.__setattr__(self, "cooldown", check_cooldown(self.cooldown))

    def qualifies(self, data: Any) -> bool:
        """Whether a resource with this data may serve these jobs."""
        return all(isinstance(data, dict) and key in data and data[key] == value for key, value in self.where.items())

    def target_of(self, payload: Any) -> str:
        """The target of a job of this payload ("" for none); ValueError, one line, when
        the function raises or returns something that is not a target."""
        return _key(self.target, payload, "target", check_target)

    def affinity_of(self, payload: Any) -> str:
        """The affinity key of a job of this payload ("" for none)."""
        return _key(self.affinity, payload, "affinity", _check_affinity)


def by_payload(limit_key: Any, needs: Needs | None) -> bool:
    """Whether a job's keys are computed from what its handler receives: a limit key, a
    target or an affinity key that is a function (a pipeline task's is its item and its
    run's context, not the job's stored payload)."""
    return callable(limit_key) or (needs is not None and (callable(needs.target) or needs.affinity is not None))


def needs_of(lease: Any) -> Needs | None:
    """A handler's `lease=` as Needs: a pool's name, a Needs, or None."""
    if lease is None or isinstance(lease, Needs):
        return lease
    if isinstance(lease, str):
        return Needs(lease)
    raise ValueError(f"lease= takes a pool's name or leases.tasks.Needs(...), not {lease!r}")


def pace_seconds(pace: Any) -> float | None:
    """Seconds between two starts: a number of seconds, or a rate "N/s", "N/m", "N/h"."""
    if pace is None:
        return None
    if isinstance(pace, str):
        starts, period = parse_rate(pace)
        return period / starts
    return check_seconds(pace, "lease pace", above=True)


def _key(given: Key, payload: Any, what: str, check: Callable[[Any], str]) -> str:
    if given is None:
        return ""
    if callable(given):
        try:
            given = given(payload)
        except Exception as exc:  # noqa: BLE001 - a key function failing is bad input, one line
            raise ValueError(f"lease {what} function failed for this payload: {type(exc).__name__}: {exc}") from None
        if given is None or given == "":
            return ""
        try:
            return check(given)
        except ValueError as exc:
            raise ValueError(f"lease {what} function returned a bad key: {exc}") from None
    return check(given)


def _check_affinity(key: Any) -> str:
    if not isinstance(key, str):
        raise ValueError(f"an affinity key must be a string, not {type(key).__name__} {key!r}")
    return check_name(key, "affinity key", AFFINITY_LENGTH)
