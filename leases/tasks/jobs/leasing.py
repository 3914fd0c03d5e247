"""Jobs that hold resources: a job of a handler with `lease=` is claimed only together with
a lease on a qualifying free resource of its pool, in one transaction.

One transaction, not a protocol between two: the claim locks the pool's free slots and the
lane's due jobs (both `SKIP LOCKED`, so it never waits), pairs them, takes each slot with
the base app's conditional UPDATE (its token grows: the fencing token) and marks the jobs
running with their lease, then commits. So a job never runs without its lease, and a
lease is never held for a job that is not running: both expire at the same moment of the
database clock, the worker's heartbeat renews both, the attempt's end releases the
resource in the transaction that ends the job, and a dead worker's job and lease lapse
together (recovery puts the job back; the slot is free by itself).

Which slot a job gets: the longest free that qualifies (`Needs.where`), that its target
does not refuse now (banned, rested or paced: `leases.targets`), and, for a job with an
affinity key, the one its key's jobs last used while that one is usable (it waits for it
while another job holds it). While none qualifies, the job stays ready in its pool's lane
of the queue: no worker thread, no attempt, no timeout spent. Jobs of no pool, and other
pools', have lanes of their own and never wait behind it.

When resources are scarce, targets take turns: each job of a pool gets a turn when it is
pushed (`take_turns`), the next of its target's or the lane's current turn if later, and
the lane is claimed in turn order (priority first), so one target's 10,000 jobs take
turns with another's 10.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from leases import db, targets
from leases.encoding import load_json
from leases.lease import job_holder
from leases.sql import in_list

from .. import registry, sql
from ..joblease import JobLease
from ..needs import Needs

log = logging.getLogger("leases.tasks.worker")

#: Free slots one claim reads at most per target, besides those of bound affinity keys.
FREE_READ = 64
#: Due jobs of a lane one claim reads per job it may start: jobs whose target refuses
#: every free slot are passed over, up to this many times the claim's size.
WINDOW = 4


def needs_for(name: str, backend: str) -> Needs | None:
    """What the handler of a job of `name` needs (a Django task's, by its path; an app's
    runner, such as a pipeline task's, runs the handler of that name)."""
    if backend and registry.runner(backend) is None:
        return registry.task_limits(name).needs
    spec = registry.find(name)
    return None if spec is None else spec.needs


def pools_of(queues: Sequence[str]) -> list[str]:
    """The pools the jobs of these queues (["*"]: any) may need, by this process's handlers."""
    found = {spec.needs.pool for spec in registry.registered().values()
             if spec.needs is not None and (queues == ["*"] or spec.queue in queues)}
    found |= registry.task_pools()
    return sorted(found)


# -- turns, when jobs are written ---------------------------------------------------------


def take_turns(cursor: Any, jobs: Sequence[Any]) -> list[Any]:
    """`jobs` with the turns of those of a pool, in the pushing transaction: each takes
    the next of its target's turns, or its lane's current one if that is later."""
    st = sql.leasing(cursor.db)
    lanes: dict[tuple[str, str], dict[str, int]] = {}
    fronts: dict[tuple[str, str], int] = {}
    for lane in sorted({(job.pool, job.queue) for job in jobs if job.pool}):
        cursor.execute(st.frontier, (lane[1], lane[0]))
        row = cursor.fetchone()
        fronts[lane] = row[0] if row else 0
        wanted = sorted({job.target for job in jobs if (job.pool, job.queue) == lane})
        cursor.execute(st.last_turns + in_list(wanted), (*lane, *wanted))
        lanes[lane] = dict(cursor.fetchall())
    given = []
    for job in jobs:
        if job.pool:
            lane = (job.pool, job.queue)
            turn = max(lanes[lane].get(job.target, 0) + 1, fronts[lane])
            lanes[lane][job.target] = turn
            job = replace(job, turn=turn)
        given.append(job)
    for (pool, queue), last in sorted(lanes.items()):
        for target, turn in sorted(last.items()):
            cursor.execute(st.set_turn, (pool, queue, target, turn))
    return given


# -- the claim ------------------------------------------------------------------------------


def claim_pool(cursor: Any, worker: str, pool: str, queues: Sequence[str], limit: int, ttl: float,
               lanes: Lanes) -> list[tuple[tuple, JobLease]]:
    """Claim up to `limit` due jobs of `pool`'s lane in `queues`, each with a lease on a
    slot for `ttl` seconds, in the caller's transaction (see `Lanes`)."""
    st = sql.leasing(cursor.db)
    cursor.execute(st.any_free, (pool,))
    if cursor.fetchone() is None:  # nothing free: the lane is not read at all
        return []
    rows = []
    for queue in queues:
        rows += lanes.due(queue, pool, limit * WINDOW)
    rows.sort(key=lambda row: (-row[1], row[19], str(row[2]), row[0]))
    rows = lanes.within_limits(rows)
    if not rows:
        return []
    pairs = _pair(cursor, pool, rows, limit)
    if not pairs:
        return []
    floor = _take_slots(cursor, worker, pairs, ttl)
    leases = {row[0]: JobLease(pool=pool, name=slot.name, slot=slot.slot, data=slot.data,
                               token=max(slot.token + 1, floor), id=slot.id, holder=_holder(worker, row[0])) for row, slot in pairs}
    started = {row[0] for row in lanes.start([row for row, _ in pairs], leases)}
    lost = [lease for job, lease in leases.items() if job not in started]
    if lost:  # taken by another claim meanwhile (SQLite has no SKIP LOCKED): give the slots back
        release(cursor, lost, 0.0)
    found = [(row, leases[row[0]]) for row, _ in pairs if row[0] in started]
    _after_start(cursor, pool, found)
    return found


class Lanes(Protocol):
    """What `claim_pool` needs of the claim it runs inside (`leases.tasks.jobs.claim`)."""

    def due(self, queue: str, pool: str, limit: int) -> list[tuple]:
        """The lane's first `limit` due rows in claim order, locked."""

    def within_limits(self, rows: list[tuple]) -> list[tuple]:
        """The rows the keys' limits let start (the rest held back)."""

    def start(self, rows: list[tuple], leases: dict[int, JobLease] | None = None) -> list[tuple]:
        """Mark the rows running under the worker, with their `leases` by job id; those it won."""


@dataclass
class _Slot:
    id: int
    token: int
    name: str
    slot: int
    data: Any


def _pair(cursor: Any, pool: str, rows: list[tuple], limit: int) -> list[tuple[tuple, _Slot]]:
    """Each job in claim order with the longest free slot it may use, while slots last.

    Two reads serve the whole claim, however many targets its jobs have: the pool's
    longest free slots (locked), and which of them the jobs' targets refuse now (bans,
    rests, pace). Only a target that refuses every slot of that read, while more are free,
    gets a read of its own with its refusals left out in the statement, so slots a target
    refuses never hide the others from it.
    """
    bound = _bound(cursor, pool, rows)
    usable_bound = _usable(cursor, pool, set(bound.values()))
    size = max(FREE_READ, 2 * limit)
    shared = _free(cursor, pool, size)
    refused = _refused(cursor, pool, shared, {row[17] for row in rows})
    own: dict[str, list[_Slot]] = {}  # a target's own read, when the shared one had nothing for it
    taken: set[int] = set()
    paced: set[tuple[str, str]] = set()  # (resource, target) started here under a pace
    pairs = []
    for row in rows:
        if len(pairs) == limit:
            break
        target = row[17]
        needs = needs_for(row[4], row[5]) or Needs(pool)
        name = bound.get(row[18]) if row[18] else None
        if name is not None and name not in usable_bound:
            name = None  # its resource is quarantined or gone: the key moves on

        def fits(slot: _Slot) -> bool:
            return (slot.id not in taken and (name is None or slot.name == name)
                    and (slot.name, target) not in paced and needs.qualifies(slot.data))

        if name is not None:
            slot = next(filter(fits, _named_slots(cursor, pool, target, name)), None)
        else:
            slot = next((slot for slot in shared if (slot.name, target) not in refused and fits(slot)), None)
            if slot is None and len(shared) == size and any((s.name, target) in refused for s in shared):
                if target not in own:
                    own[target] = _free_for(cursor, pool, target)
                slot = next(filter(fits, own[target]), None)
        if slot is None:
            continue
        taken.add(slot.id)
        if needs.pace and target:  # another slot of the resource must not start for it now
            paced.add((slot.name, target))
        pairs.append((row, slot))
    return pairs


def _slots(rows: list[tuple]) -> list[_Slot]:
    """Slots as read, their data parsed once (each is tried against several jobs)."""
    return [_Slot(pk, token, name, number, load_json(data)) for pk, token, name, number, data in rows]


def _free(cursor: Any, pool: str, size: int) -> list[_Slot]:
    """The pool's `size` longest free slots, locked."""
    cursor.execute(sql.leasing(cursor.db).free, (pool, size))
    return _slots(cursor.fetchall())


def _refused(cursor: Any, pool: str, slots: list[_Slot], wanted: set[str]) -> set[tuple[str, str]]:
    """(resource, target) of these slots' resources that these targets refuse now."""
    names, wanted = sorted({slot.name for slot in slots}), sorted(wanted - {""})
    if not names or not wanted:
        return set()
    cursor.execute(sql.leasing(cursor.db).refused + in_list(wanted) + " AND name IN (" + in_list(names),
                   (pool, *wanted, *names))
    return set(cursor.fetchall())


def _free_for(cursor: Any, pool: str, target: str) -> list[_Slot]:
    """The longest free slots `target` does not refuse now, locked."""
    cursor.execute(sql.leasing(cursor.db).free_for, (pool, pool, target, FREE_READ))
    return _slots(cursor.fetchall())


def _bound(cursor: Any, pool: str, rows: list[tuple]) -> dict[str, str]:
    """{affinity key: the resource its jobs last used} of the rows' keys."""
    keys = sorted({row[18] for row in rows if row[18]})
    if not keys:
        return {}
    cursor.execute(sql.leasing(cursor.db).bound + in_list(keys), (pool, *keys))
    return dict(cursor.fetchall())


def _named_slots(cursor: Any, pool: str, target: str, name: str) -> list[_Slot]:
    """The free slots of resource `name` (an affinity key's) that `target` does not
    refuse now, locked."""
    cursor.execute(sql.leasing(cursor.db).free_named, (pool, pool, target, name))
    return _slots(cursor.fetchall())


def _usable(cursor: Any, pool: str, names: set[str]) -> set[str]:
    """Which of these resources exist and are not quarantined (held ones included)."""
    if not names:
        return set()
    cursor.execute(sql.leasing(cursor.db).usable_named + in_list(sorted(names)), (pool, *sorted(names)))
    return {row[0] for row in cursor.fetchall()}


def _take_slots(cursor: Any, worker: str, pairs: list[tuple[tuple, _Slot]], ttl: float) -> int:
    """Lease each paired slot for its job, in one statement: the rows are locked by this
    claim, so it takes them all; each token grows, to at least the fence floor returned."""
    st = sql.leasing(cursor.db)
    holders = [value for row, slot in pairs for value in (slot.id, _holder(worker, row[0]))]
    ids = [slot.id for _, slot in pairs]
    floor = db.fence_floor(cursor.db)
    cursor.execute(st.take + " WHEN %s THEN %s" * len(pairs) + st.take_tail + in_list(ids),
                   (db.dialect(cursor.db).seconds(ttl), *holders, floor, *ids))
    return floor


def claim_statement(cursor: Any, leases: dict[int, JobLease]) -> tuple[str, list]:
    """The claim of jobs with their leases ("claim_leased"): its text and the parameters
    after the worker and the ttl (the ids at the end)."""
    st, cases = sql.leasing(cursor.db), " WHEN %s THEN %s" * len(leases)
    ids = sorted(leases)
    params = [v for job in ids for v in (job, leases[job].id)] + [v for job in ids for v in (job, leases[job].token)]
    return st.claim_leased + cases + st.claim_leased_middle + cases + st.claim_leased_tail + in_list(ids), [*params, *ids]


def _after_start(cursor: Any, pool: str, leases: list[tuple[tuple, JobLease]]) -> None:
    """Pace each started (resource, target) and bind each started affinity key."""
    st = sql.leasing(cursor.db)
    paced: dict[float, list[tuple[str, str]]] = {}
    for row, lease in leases:
        needs = needs_for(row[4], row[5])
        if needs is not None and needs.pace and row[17]:
            paced.setdefault(needs.pace, []).append((lease.name, row[17]))
    for seconds, pairs in sorted(paced.items()):
        targets.pace(cursor, pool, pairs, seconds)
    for key, name in sorted({(row[18], lease.name) for row, lease in leases if row[18]}):
        cursor.execute(st.bind, (pool, key, name))


def _holder(worker: str, job_id: int) -> str:
    """The holder a job's lease is written under: its worker and the job."""
    return job_holder(worker, job_id)


def lease_of(cursor: Any, row: tuple, worker: str) -> JobLease | None:
    """The lease of a running job read back after a lost reply (`claim._take_back`)."""
    resource_id, token = row[20], row[21]
    if resource_id is None or not row[16]:
        return None
    cursor.execute(sql.leasing(cursor.db).resource, (resource_id,))
    found = cursor.fetchone() or ("?", 0, "null")
    return JobLease(pool=row[16], name=found[0], slot=found[1], data=load_json(found[2]), token=token,
                    id=resource_id, holder=_holder(worker, row[0]))


# -- while it runs, and when it ends --------------------------------------------------------


def _matching(leases: Sequence[JobLease]) -> tuple[str, list]:
    return " OR ".join(["(id = %s AND token = %s AND holder = %s)"] * len(leases)) + ")", [
        value for lease in leases for value in (lease.id, lease.token, lease.holder)]


def renew(leases: Sequence[JobLease], ttl: float, using: str) -> list[JobLease]:
    """Renew the leases of a worker's running jobs (its heartbeat); returns those it no
    longer holds (an operator released, quarantined or removed the resource), marked lost."""
    leases = [lease for lease in leases if not lease.lost]
    if not leases:
        return []
    tail, params = _matching(leases)

    def work(cursor: Any, resumed: bool) -> set[int]:
        st = sql.leasing(cursor.db)
        cursor.execute(st.renew + tail, (db.dialect(cursor.db).seconds(ttl), *params))
        if cursor.rowcount == len(leases):
            return {lease.id for lease in leases}
        cursor.execute(st.held + tail, params)
        return {row[0] for row in cursor.fetchall()}

    held = db.run(work, using)
    lost = [lease for lease in leases if lease.id not in held]
    for lease in lost:
        lease.lost = True
        log.warning("job lease on %s/%s (token %d) lost: released, quarantined or removed by an operator",
                    lease.pool, lease.name, lease.token)
    return lost


def release(cursor: Any, leases: Sequence[JobLease], cooldown: float) -> None:
    """Free the jobs' resources (after `cooldown` seconds of rest), in the transaction that
    ends their attempts, in one statement: each only while its lease still holds it."""
    if leases:
        tail, params = _matching(sorted(leases, key=lambda lease: lease.id))
        cursor.execute(sql.leasing(cursor.db).release + tail, (db.dialect(cursor.db).seconds(cooldown), *params))


def release_handed_back(cursor: Any, worker: str, keep: Sequence[int]) -> None:
    """Free the resources of the attempts `worker` hands back (all it runs but `keep`,
    whose outcomes release theirs), in that transaction."""
    cursor.execute(sql.leasing(cursor.db).leases_of, (worker,))
    release(cursor, [JobLease(pool="", name="", slot=0, data=None, token=token, id=resource_id,
                              holder=_holder(worker, job_id))
                     for resource_id, token, job_id in cursor.fetchall() if job_id not in keep], 0.0)
