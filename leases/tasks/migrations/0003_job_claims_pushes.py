"""Job.claims fences outcomes (Job.attempt now counts only the tries that count),
Job.pushes counts merged pushes, Job.bounced_at starts the grace of a job no worker can run."""
from django.db import migrations, models
from django.db.models import F


def fence_from_attempts(apps, schema_editor):
    """Every claim so far also counted as an attempt."""
    Job = apps.get_model("leases_tasks", "Job")
    Job.objects.using(schema_editor.connection.alias).update(claims=F("attempt"))


class Migration(migrations.Migration):

    dependencies = [
        ('leases_tasks', '0002_job_queue'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='bounced_at',
            field=models.DateTimeField(blank=True, help_text='When a worker without its handler first gave it back.', null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='claims',
            field=models.PositiveIntegerField(default=0, help_text='Times claimed by a worker; fences outcomes.'),
        ),
        migrations.AddField(
            model_name='job',
            name='pushes',
            field=models.PositiveIntegerField(default=1, help_text='Pushes merged into this job by its key.'),
        ),
        migrations.AlterField(
            model_name='job',
            name='attempt',
            field=models.PositiveIntegerField(default=0, help_text='Tries used so far (of max attempts).'),
        ),
        migrations.RunPython(fence_from_attempts, migrations.RunPython.noop),
    ]
