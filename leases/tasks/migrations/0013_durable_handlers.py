"""Durable handlers: their steps and the events sent to jobs; a job's awaited event and a
request to cancel its running attempt (see leases.tasks.jobs.steps)."""
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases_tasks', '0012_jobs_hold_resources'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='cancel_requested_at',
            field=models.DateTimeField(blank=True, help_text='When cancelling its running attempt was asked.', null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='waiting_for',
            field=models.CharField(blank=True, db_default='', default='', help_text="What a suspended durable job waits for: 'sleep' or 'event:<name>'.", max_length=210),
        ),
        migrations.CreateModel(
            name='JobEvent',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=200)),
                ('data', models.JSONField(blank=True, null=True)),
                ('sent_at', models.DateTimeField()),
                ('taken_seq', models.PositiveIntegerField(blank=True, null=True)),
                ('job', models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='events', to='leases_tasks.job')),
            ],
            options={
                'verbose_name': 'job event',
                'ordering': ['job', 'id'],
                'indexes': [models.Index(fields=['job', 'name', 'taken_seq', 'id'], name='leases_job_event')],
            },
        ),
        migrations.CreateModel(
            name='JobStep',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('seq', models.PositiveIntegerField()),
                ('name', models.CharField(max_length=200)),
                ('result', models.JSONField(blank=True, null=True)),
                ('done', models.BooleanField(default=True)),
                ('until', models.DateTimeField(blank=True, null=True)),
                ('at', models.DateTimeField()),
                ('job', models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='steps', to='leases_tasks.job')),
            ],
            options={
                'verbose_name': 'job step',
                'ordering': ['job', 'seq'],
                'constraints': [models.UniqueConstraint(fields=('job', 'seq'), name='leases_job_step')],
            },
        ),
    ]
