"""Verdict: the log of what targets said of resources (bans, rests) and of operators' lifts (see leases.targets)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases', '0004_resource_targets'),
    ]

    operations = [
        migrations.CreateModel(
            name='Verdict',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('pool', models.CharField(max_length=100)),
                ('name', models.CharField(max_length=255)),
                ('target', models.CharField(max_length=255)),
                ('kind', models.CharField(choices=[('ban', 'banned'), ('rest', 'rested'), ('lift', 'lifted')], max_length=4)),
                ('reason', models.CharField(blank=True, default='', max_length=255)),
                ('until', models.DateTimeField(blank=True, help_text='When the ban or rest ends; none for a lift.', null=True)),
                ('at', models.DateTimeField()),
                ('holder', models.CharField(blank=True, default='', help_text='Who said it.', max_length=255)),
                ('job', models.BigIntegerField(blank=True, help_text='The job of the queue whose attempt said it.', null=True)),
            ],
            options={
                'ordering': ['-at', '-id'],
                'indexes': [models.Index(fields=['pool', 'target', 'at'], name='leases_verdict_target'), models.Index(fields=['pool', 'name', 'at'], name='leases_verdict_resource'), models.Index(fields=['job'], name='leases_verdict_job'), models.Index(fields=['at'], name='leases_verdict_at')],
            },
        ),
    ]
