"""What the operators' dashboard reads of the jobs (leases.tasks.readings)."""
from __future__ import annotations

# What the operators' dashboard reads of the jobs (see leases.tasks.readings).
# The jobs in reach of a window, each with when it joined the queue and when it left it
# (NULL while it waits): its last start, or its end if it never ran.
_WAITS = (
    "SELECT queue, enqueued_at AS entered, CASE WHEN status IN ({job.ready}, {job.blocked}) THEN NULL"
    " ELSE COALESCE(started_at, finished_at) END AS gone FROM {j}"
)
READINGS = {
    # Jobs that finished in each bar of a window, through the finished_at index (a closed
    # range, which SQLite's planner takes), but for the names the caller lists: "IN (" is
    # completed by a placeholder per name (sql.in_list), then "finished_per_bar_tail".
    # params: start, step, start, end, the names
    "finished_per_bar": (
        "SELECT queue, status, {steps[finished_at]} AS bar, COUNT(*) FROM {j}"
        " WHERE finished_at BETWEEN %s AND %s AND name NOT IN ("
    ),
    "finished_per_bar_tail": " GROUP BY queue, status, bar",
    # The peak of jobs waiting within each bar of a window, per queue, and the change over
    # the bar. The jobs in reach (unfinished ones through the claim index, those that
    # ended within the window through finished_at) become moves: +1 when one joined (the
    # ones that joined before the window count at its start, in its first bar), -1 when
    # it left within the window; a running sum over each queue's moves is the number
    # waiting after each, a leaving counted before a joining at the same instant. The
    # rows read back are one per queue and bar, however many jobs moved.
    # params: start, end, start, start, start, start, step
    "waiting_per_bar": (
        "WITH waits AS (" + _WAITS + " WHERE status IN ({job.ready}, {job.blocked}, {job.running})"
        " UNION ALL " + _WAITS + " WHERE finished_at BETWEEN %s AND %s),"
        " moves AS (SELECT queue, entered AS moved_at, 1 AS delta FROM waits"
        " WHERE gone IS NULL OR (gone > entered AND gone > %s)"
        " UNION ALL SELECT queue, gone, -1 FROM waits WHERE gone > entered AND gone > %s)"
        " SELECT queue, bar, MAX(waiting), SUM(delta) FROM (SELECT queue, delta,"
        " CASE WHEN moved_at < %s THEN 0 ELSE {steps[moved_at]} END AS bar,"
        " SUM(delta) OVER (PARTITION BY queue ORDER BY moved_at, delta) AS waiting FROM moves) AS counted"
        " GROUP BY queue, bar"
    ),
}
