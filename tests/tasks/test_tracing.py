"""Tracing, the optional extra: a span per push and per job run, the trace context a job
carries from its push to its run, a pipeline run's span over its tasks; nothing at all
without a tracer provider, and the package as it was without opentelemetry."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

import tests.jobs  # noqa: F401 - registers the handlers
import tests.pipes as pipes
from leases.pipelines.models import Run
from leases.tasks import push, push_many
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker, execute

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


@pytest.fixture
def spans(monkeypatch):
    """A tracer provider for this test alone, its spans kept in memory.

    `trace.set_tracer_provider` sets the process's provider once and for all (a second
    call is refused), so this fixture puts its provider in the global that call would
    have set, and monkeypatch puts the previous value (none) back after the test: every
    other test runs as an application that configured no tracing."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


def work_off(rounds: int = 10) -> None:
    """Claim and run what is due, in this thread, until nothing is left (or `rounds`)."""
    w = JobWorker(queues=["default"], ttl=30)
    w.register()
    for _ in range(rounds):
        jobs = w.claim(50)
        if not jobs:
            return
        w.finish([execute(job) for job in jobs])


def traceparent(span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def named(exporter: InMemorySpanExporter, name: str) -> list:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def test_a_jobs_run_is_a_child_of_its_push_in_the_pushers_trace(spans):
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("request") as request:
        job = push("noop", {"n": 1})
    assert Job.objects.get(pk=job.pk).traceparent == traceparent(named(spans, "push noop")[0])
    work_off()
    [pushed], [ran] = named(spans, "push noop"), named(spans, "run noop")
    assert (pushed.kind, ran.kind) == (SpanKind.PRODUCER, SpanKind.CONSUMER)
    assert pushed.parent.span_id == request.get_span_context().span_id
    assert ran.parent.span_id == pushed.context.span_id and ran.parent.is_remote  # read from the row
    assert ran.context.trace_id == pushed.context.trace_id == request.get_span_context().trace_id
    assert dict(pushed.attributes) == {
        "messaging.system": "leases", "messaging.operation.type": "create", "messaging.operation.name": "push",
        "messaging.destination.name": "default", "leases.job.name": "noop", "leases.job.key": job.key,
    }
    worker = Job.objects.get(pk=job.pk).worker
    assert dict(ran.attributes) == {
        "messaging.system": "leases", "messaging.operation.type": "process", "messaging.operation.name": "run",
        "messaging.destination.name": "default", "messaging.message.id": str(job.pk),
        "messaging.client.id": worker, "leases.job.name": "noop", "leases.job.attempt": 1,
    }
    assert ran.status.status_code == StatusCode.UNSET


def test_each_job_of_push_many_carries_its_own_push_span(spans):
    with trace.get_tracer("tests").start_as_current_span("batch") as batch:
        push_many([("noop", {"n": n}) for n in range(3)] + [("echo", {"n": 3})])
    pushes = [span for span in spans.get_finished_spans() if span.name.startswith("push ")]
    assert sorted(span.name for span in pushes) == ["push echo"] + ["push noop"] * 3
    assert {span.parent.span_id for span in pushes} == {batch.get_span_context().span_id}
    stored = set(Job.objects.values_list("traceparent", flat=True))
    assert stored == {traceparent(span) for span in pushes}
    assert named(spans, "push echo")[0].attributes["messaging.destination.name"] == "other"


def test_a_failing_handler_ends_each_attempts_span_in_error(spans):
    job = push("boom", {"n": 7})  # three attempts, no backoff
    refused = push("refuse", {})
    work_off()
    [pushed] = named(spans, "push boom")
    runs = named(spans, "run boom")
    assert [span.attributes["leases.job.attempt"] for span in runs] == [1, 2, 3]
    for span in runs:
        assert span.parent.span_id == pushed.context.span_id
        assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "RuntimeError: boom 7")
        [event] = span.events
        assert event.name == "exception"
        assert (event.attributes["exception.type"], event.attributes["exception.message"]) == ("RuntimeError",
                                                                                                "boom 7")
    [failed] = named(spans, "run refuse")
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.events[0].attributes["exception.type"] == "leases.exceptions.Fail"
    assert (Job.objects.get(pk=job.pk).status, Job.objects.get(pk=refused.pk).status) == (Job.DEAD, Job.FAILED)


def test_a_pipeline_runs_span_is_the_parent_of_every_task_whoever_pushed_it(spans):
    run = pipes.crawl.start(context={"items": 3}, key="example.com")
    [started] = named(spans, "pipeline crawl-site")
    assert dict(started.attributes) == {
        "leases.pipeline.name": "crawl-site", "leases.pipeline.key": "example.com",
        "leases.pipeline.run.id": run.pk, "leases.pipeline.run.created": True,
    }
    assert Run.objects.get(pk=run.pk).traceparent == traceparent(started)
    work_off()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED
    tasks = [span for span in spans.get_finished_spans() if span.name.startswith("run p.")]
    # The first stage's task was pushed by the start; the others by the worker's writes of
    # their stages' ends, outside any span of theirs: they carry the run's context all the same.
    assert sorted(span.name for span in tasks) == sorted(
        ["run p.discover", "run p.thumbs", "run p.transcode", "run p.index"] + ["run p.fetch"] * 3
    )
    assert not named(spans, "run leases.pipelines.advance")  # each stage moved on as its last task ended
    for span in tasks:
        assert (span.parent.span_id, span.context.trace_id) == (started.context.span_id, started.context.trace_id)
    task_jobs = Job.objects.filter(backend="leases.pipelines")
    assert set(task_jobs.values_list("traceparent", flat=True)) == {run.traceparent}
    assert not named(spans, "push p.fetch")  # a task's job carries its run's context, not a push's


def test_without_a_tracer_provider_no_context_is_stored_and_no_span_is_made(monkeypatch):
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # nothing leaked in
    made = []

    def counted(method):
        def start(self, name, *args, **kwargs):
            made.append(name)
            return method(self, name, *args, **kwargs)
        return start

    for tracer in (trace.ProxyTracer, trace.NoOpTracer):  # the tracers of an unconfigured process
        for method in ("start_span", "start_as_current_span"):
            monkeypatch.setattr(tracer, method, counted(getattr(tracer, method)))
    # A valid current span without an SDK: what an instrumented web framework holds.
    caller = SpanContext(trace_id=1, span_id=2, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with trace.use_span(NonRecordingSpan(caller)):
        job = push("noop", {"n": 1})
        failing = push("boom", {"n": 2}, max_attempts=1)
        run = pipes.three.start()
    work_off()
    run.refresh_from_db()
    assert (run.status, run.traceparent) == (Run.SUCCEEDED, None)
    assert Job.objects.get(pk=job.pk).status == Job.SUCCEEDED
    assert Job.objects.get(pk=failing.pk).status == Job.DEAD
    assert set(Job.objects.values_list("traceparent", flat=True)) == {None}
    assert made == []


NO_OPENTELEMETRY = """
import sys
sys.modules["opentelemetry"] = None  # any import of it raises ImportError
import django
django.setup()
import tests.jobs, tests.pipes as pipes
from leases.pipelines.models import Run
from leases.tasks import push, tracing
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker, execute
job = push("noop", {"n": 1})
failing = push("boom", {"n": 2}, max_attempts=1)
run = pipes.three.start()
w = JobWorker(queues=["default"])
w.register()
for _ in range(10):
    jobs = w.claim(50)
    if jobs:
        w.finish([execute(j) for j in jobs])
loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry") and sys.modules[name])
print(Job.objects.get(pk=job.pk).status, Job.objects.get(pk=failing.pk).status, Run.objects.get(pk=run.pk).status,
      Job.objects.exclude(traceparent=None).count(), tracing.trace, loaded)
"""


def test_the_package_runs_jobs_and_pipelines_without_opentelemetry(child_env):
    env = {**child_env, "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "project.settings")}
    done = subprocess.run([sys.executable, "-c", NO_OPENTELEMETRY], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"{int(Job.SUCCEEDED)} {int(Job.DEAD)} succeeded 0 None []"
