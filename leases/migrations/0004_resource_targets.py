"""ResourceTarget: what one target (a site) says of a resource: bans, rests and pace (see leases.targets)."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases', '0003_slots_cooldown_waiters'),
    ]

    operations = [
        migrations.CreateModel(
            name='ResourceTarget',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('pool', models.CharField(max_length=100)),
                ('name', models.CharField(max_length=255)),
                ('target', models.CharField(max_length=255)),
                ('banned_until', models.DateTimeField(blank=True, null=True)),
                ('ban_reason', models.CharField(blank=True, default='', max_length=255)),
                ('rested_until', models.DateTimeField(blank=True, null=True)),
                ('next_start_at', models.DateTimeField(blank=True, null=True)),
                ('updated_at', models.DateTimeField()),
            ],
            options={
                'ordering': ['pool', 'name', 'target'],
                'indexes': [models.Index(fields=['pool', 'name'], name='leases_target_of_resource'), models.Index(fields=['banned_until'], name='leases_target_banned')],
                'constraints': [models.UniqueConstraint(fields=('pool', 'target', 'name'), name='leases_resource_target')],
            },
        ),
    ]
