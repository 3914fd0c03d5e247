"""The `leases` loggers as the worker prints them: timestamped lines on stderr, or one JSON
object a line for log shippers.

Loggers: `leases` (pools, leases, locks), `leases.tasks.worker` (one line per job outcome,
recoveries, outages), `leases.tasks.scheduler`, `leases.tasks.limits`, `leases.pipelines`.
"""
from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

#: Attributes a log call may pass with `extra=` that the JSON lines carry as fields.
FIELDS = ("job_id", "job_name", "queue", "attempt", "seconds", "outcome", "retry_in")
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the job's
    fields when the line is about a job, and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({name: getattr(record, name) for name in FIELDS if hasattr(record, name)})
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure(log_format: str = "plain", verbosity: int = 1) -> None:
    """Show the `leases` logs on stderr for a long-running command: at INFO (WARNING at
    -v 0, DEBUG from -v 2), with timestamps. A project whose LOGGING already gives the
    `leases` logger a handler keeps it, unless JSON is asked for; either way each line is
    printed once (the logger stops passing lines up to the root's handlers)."""
    logger = logging.getLogger("leases")
    if logger.handlers and log_format != "json":
        if verbosity >= 2:
            logger.setLevel(logging.DEBUG)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(PLAIN))
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.WARNING if verbosity == 0 else logging.DEBUG if verbosity >= 2 else logging.INFO)
