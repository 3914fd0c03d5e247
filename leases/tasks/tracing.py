"""OpenTelemetry spans for the job queue and pipelines (the optional extra `tracing`).

A push is a PRODUCER span "push <name>", made and ended where the job is made
(`jobs/push.new_job`, the one maker of job rows); the row keeps that span's W3C
`traceparent`, so the CONSUMER span "run <name>" around the handler (`worker/threads`),
in whichever process claims the job, is its child. A pipeline run's start is a span
"pipeline <name>" whose traceparent the run keeps and its tasks' jobs carry instead of
a push span's, so every task's run span is a child of the run's span. That span ends
when the start does: a span ends in the process that began it, and a run ends in
whichever worker runs its last advance event, so the run's length is its trace's.

Tracing is on when a tracer provider is configured (`trace.set_tracer_provider`).
Until then nothing here makes a span or stores a context: each call costs a look at the
global provider. Without opentelemetry installed every function does nothing. The
context is written and read with the W3C propagator itself, not the process's global
one, since the column holds a traceparent whatever headers the process's HTTP uses.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the extra is not installed: tracing stays off
    trace = None

from leases import __version__

from .models.jobs import TRACEPARENT_LENGTH

#: `messaging.system` of every span (the messaging semantic conventions' attributes).
SYSTEM = "leases"
_OFF = (trace.ProxyTracerProvider, trace.NoOpTracerProvider) if trace is not None else ()
_W3C = TraceContextTextMapPropagator() if trace is not None else None
_NOTHING = nullcontext()
#: (provider, this package's tracer from it): the provider is looked up at each call, so
#: one configured after this module was imported (or a test's) is the one used.
_cached: tuple[Any, Any] = (None, None)


def _tracer() -> Any:
    """This package's tracer from the configured provider; None when tracing is off."""
    global _cached
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, _OFF):
        return None
    cached = _cached
    if cached[0] is not provider:
        cached = _cached = (provider, provider.get_tracer("leases", __version__))
    return cached[1]


def enabled() -> bool:
    """Whether spans are recorded now (a tracer provider is configured): what costs a read
    only for tracing asks first."""
    return _tracer() is not None


def _traceparent(span: Any) -> str | None:
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, trace.set_span_in_context(span))
    value = carrier.get("traceparent")
    # A later version of the format could outgrow the column: such a job carries none.
    return value if value is not None and len(value) <= TRACEPARENT_LENGTH else None


def pushed(name: str, queue: str, key: str) -> str | None:
    """The traceparent a new job carries: of a PRODUCER span "push <name>", child of the
    current span, made and ended now (the job's id is the database's, after it). None
    when tracing is off."""
    tracer = _tracer()
    if tracer is None:
        return None
    span = tracer.start_span(f"push {name}", kind=trace.SpanKind.PRODUCER, attributes={
        "messaging.system": SYSTEM, "messaging.operation.type": "create", "messaging.operation.name": "push",
        "messaging.destination.name": queue, "leases.job.name": name, "leases.job.key": key,
    })
    span.end()
    return _traceparent(span)


def running(job: Any) -> AbstractContextManager[None]:
    """Around a claimed job's handler: a CONSUMER span "run <name>", child of the context
    the job carries, ERROR with the exception recorded when the handler raises. A context
    that does nothing when tracing is off."""
    tracer = _tracer()
    if tracer is None:
        return _NOTHING
    return _run_span(tracer, job)


@contextmanager
def _run_span(tracer: Any, job: Any) -> Iterator[None]:
    parent = _W3C.extract({"traceparent": job.traceparent}) if job.traceparent else None
    attributes = {
        "messaging.system": SYSTEM, "messaging.operation.type": "process", "messaging.operation.name": "run",
        "messaging.destination.name": job.queue, "messaging.message.id": str(job.id),
        "messaging.client.id": job.worker, "leases.job.name": job.name, "leases.job.attempt": job.attempt,
    }
    # Exceptions are recorded here, BaseException too: the worker fails the attempt on any.
    with tracer.start_as_current_span(f"run {job.name}", context=parent, kind=trace.SpanKind.CONSUMER,
                                      attributes=attributes, record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            yield
        except BaseException as exc:
            _record_failure(span, exc)
            raise


def _record_failure(span: Any, exc: BaseException) -> None:
    """ERROR and the exception; an exception whose __str__ breaks gets its class's name
    (the job's outcome says the rest), as tracing must not change what the worker sees."""
    try:
        span.record_exception(exc)
        description = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - the handler's broken exception, not ours to raise
        description = type(exc).__name__
    span.set_status(trace.Status(trace.StatusCode.ERROR, description))


class Started:
    """A pipeline run's span as its start sees it: the traceparent to store on the run
    (None when tracing is off), and `ran` to name the run once it is written."""

    def __init__(self, span: Any = None) -> None:
        self.span = span
        self.traceparent = _traceparent(span) if span is not None else None

    def ran(self, run_id: int, created: bool) -> None:
        if self.span is not None:
            self.span.set_attributes({"leases.pipeline.run.id": run_id, "leases.pipeline.run.created": created})


@contextmanager
def pipeline_started(pipeline: str, key: str | None) -> Iterator[Started]:
    """Around a pipeline run's start: a span "pipeline <name>", ended when the start is."""
    tracer = _tracer()
    if tracer is None:
        yield Started()
        return
    attributes = {"leases.pipeline.name": pipeline, **({"leases.pipeline.key": key} if key is not None else {})}
    with tracer.start_as_current_span(f"pipeline {pipeline}", attributes=attributes) as span:
        yield Started(span)
