"""Pushes carry an id of their own: the push that made a job and the last one merged into
it, so a push whose reply was lost finds what its statement did (see jobs.push).

Cost on a big table: two nullable columns with no default and no index. MariaDB 10.3+
adds them in place, instantly (a change to the table's metadata, no copy of the rows);
PostgreSQL 11+ records them in its catalog, taking the table's lock only for that moment;
SQLite appends them to the table's definition. Existing rows keep NULL, which no push
looks for: nothing is rewritten and no index is built. The look-up after a lost reply reads
the key's rows through the existing dedupe key index.
"""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases_tasks', '0013_durable_handlers'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='push_id',
            field=models.BigIntegerField(blank=True, editable=False, help_text='Id of the push that made it.', null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='merged_push_id',
            field=models.BigIntegerField(blank=True, editable=False, help_text='Id of the last push merged into it.', null=True),
        ),
    ]
