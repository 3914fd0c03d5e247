"""The free index of resources ends with the id: the claims' order (longest free, ties by id) read straight from it on PostgreSQL too, which sorted every free slot of a pool."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases', '0005_verdict_log'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='resource',
            name='leases_resource_free',
        ),
        migrations.AddIndex(
            model_name='resource',
            index=models.Index(fields=['pool', 'busy_before', 'id'], name='leases_resource_free'),
        ),
    ]
