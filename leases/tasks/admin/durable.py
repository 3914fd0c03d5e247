"""Admin of durable jobs: a job's steps and the events sent to it (tables on the job's
page), and the action that sends an event. Steps' results and events' data are shown as stored to
those who may act on jobs and masked for viewers, as payloads are."""
from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join

from leases.clock import db_now
from leases.management.text import parse_json
from leases.ops.adminkit import EMPTY, local_time, pretty_json
from leases.ops.masking import mask_secrets

from ..jobs import steps
from ..jobs.payload import dump_payload
from ..models import JobEvent, JobStep

#: Characters of a step's result or an event's data shown in the table; the rest is folded.
PREVIEW = 80
#: Steps (the last ones) and events (the newest) a job's page shows.


def _preview(value: object) -> str:
    """JSON on one line; when longer than PREVIEW, cut, with the whole of it folded beneath."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    if len(text) <= PREVIEW:
        return text
    return format_html("<details><summary>{}</summary>{}</details>", text[: PREVIEW - 3] + "...", pretty_json(value))


def steps_table(job_id: int, using: str, masked: bool) -> str:
    """A durable job's last steps (steps.SHOWN), in order: done (and its result), or a sleep or a
    wait begun and when it ends (or ended: a sleep is not written again once it is over);
    a job of thousands of steps costs one short read."""
    rows = list(JobStep.objects.using(using).filter(job_id=job_id).order_by("-seq")[:steps.SHOWN])[::-1]
    if not rows:
        return EMPTY
    now = db_now(using)
    cells = [(step.seq, step.name, steps.state(step, now, local_time), local_time(step.at),
              _preview(_as(step.result, masked)) if step.done else EMPTY) for step in rows]
    return _table(("step", "name", "state", "at", "result"), cells,
                  f"the last {steps.SHOWN} of {rows[-1].seq}" if rows[0].seq > 1 else "")


def events_table(job_id: int, using: str, masked: bool) -> str:
    """The events sent to a job, the newest (steps.SHOWN), and the step of the wait that took each."""
    rows = list(JobEvent.objects.using(using).filter(job_id=job_id).order_by("-pk")[:steps.SHOWN])[::-1]
    if not rows:
        return EMPTY
    cells = [(event.name, local_time(event.sent_at),
              f"by step {event.taken_seq}" if event.taken_seq is not None else "not yet: kept for a wait",
              _preview(_as(event.data, masked))) for event in rows]
    return _table(("event", "sent", "taken", "data"), cells, "")


def _as(value: object, masked: bool) -> object:
    return mask_secrets(value) if masked else value


def _table(head: tuple[str, ...], rows: list[tuple], note: str) -> str:
    return format_html(
        "<table><thead><tr>{}</tr></thead><tbody>{}</tbody></table>{}",
        format_html_join("", "<th>{}</th>", ((cell,) for cell in head)),
        format_html_join("", "<tr>{}</tr>", ((format_html_join("", "<td>{}</td>", ((c,) for c in row)),)
                                             for row in rows)),
        format_html("<p>{}</p>", note) if note else "",
    )


class SendEventForm(forms.Form):
    """Checked as send_event checks them, so a bad name or data is a form error, not a
    refusal per selected job."""

    name = forms.CharField(max_length=steps.EVENT_NAME_LENGTH,
                           help_text="The event a wait of the handler names.")
    data = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 4}),
                           help_text="JSON (empty: null).")

    def clean_name(self) -> str:
        try:
            return steps.check_event_name(self.cleaned_data["name"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_data(self) -> object:
        text = self.cleaned_data["data"].strip()
        try:
            value = parse_json(text, "data") if text else None
            dump_payload(value, "the event's data")  # NaN, too deep or too large: refused by send_event
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None
        return value


def send_event(model_admin: admin.ModelAdmin, request, queryset) -> TemplateResponse | None:
    """Ask for the event's name and data, then send it to each selected job that has not
    ended (each one line in its history); the others are counted and named."""
    form = SendEventForm(request.POST if "apply" in request.POST else None)
    if not form.is_valid():
        return TemplateResponse(request, "admin/leases_tasks/job/send_event.html", {
            **model_admin.admin_site.each_context(request), "title": "Send an event", "form": form,
            "jobs": queryset.order_by("pk").values_list("pk", "name")[:100],
            "selected": request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME), "opts": model_admin.model._meta,
        })
    name, data = form.cleaned_data["name"], form.cleaned_data["data"]
    sent, refused = 0, []
    for job in queryset.order_by("pk"):
        try:
            steps.send_event(job.pk, name, data, using=model_admin.using)
        except ValueError as exc:
            refused.append(str(exc))
            continue
        sent += 1
        model_admin.log_change(request, job, f"Sent the event {name!r} from the admin.")
    text = f"Sent the event {name!r} to {sent} of {sent + len(refused)} selected job(s)."
    if refused:
        text += f" Not sent: {refused[0]}" + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else "")
    model_admin.message_user(request, text, messages.SUCCESS if sent else messages.WARNING)
    return None
