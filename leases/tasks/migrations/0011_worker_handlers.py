"""Worker.handlers and Worker.handed_back: which handlers a worker process can run, and
which jobs it handed back for want of one (see leases.tasks.jobs.handoff)."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases_tasks', '0010_claim_index_ends_with_id'),
    ]

    operations = [
        migrations.AddField(
            model_name='worker',
            name='handlers',
            field=models.TextField(blank=True, default=''),
        ),
        migrations.AddField(
            model_name='worker',
            name='handed_back',
            field=models.TextField(blank=True, default=''),
        ),
    ]
