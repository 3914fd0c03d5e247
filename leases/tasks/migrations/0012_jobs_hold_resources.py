"""Jobs that hold resources: a job's pool, target, affinity, turn and lease; affinities and
turns; the claim index with the pool's lane (see leases.tasks.jobs.leasing)."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases_tasks', '0011_worker_handlers'),
    ]

    operations = [
        migrations.CreateModel(
            name='Affinity',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('pool', models.CharField(max_length=100)),
                ('affinity', models.CharField(help_text='The affinity key (KEY is reserved in MySQL).', max_length=255)),
                ('name', models.CharField(help_text="The resource's name.", max_length=255)),
                ('updated_at', models.DateTimeField()),
            ],
            options={
                'verbose_name_plural': 'affinities',
            },
        ),
        migrations.CreateModel(
            name='PoolTurn',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('pool', models.CharField(max_length=100)),
                ('queue', models.CharField(max_length=100)),
                ('target', models.CharField(blank=True, default='', max_length=255)),
                ('last_turn', models.BigIntegerField(default=0)),
            ],
        ),
        migrations.RemoveIndex(
            model_name='job',
            name='leases_job_claim',
        ),
        migrations.AddField(
            model_name='job',
            name='affinity',
            field=models.CharField(blank=True, default='', help_text='Jobs of one affinity key run on the resource they last used.', max_length=255),
        ),
        migrations.AddField(
            model_name='job',
            name='lease_token',
            field=models.BigIntegerField(blank=True, help_text="That lease's fencing token.", null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='pool',
            field=models.CharField(blank=True, default='', help_text='The pool whose resource it holds while it runs.', max_length=100),
        ),
        migrations.AddField(
            model_name='job',
            name='resource_id',
            field=models.BigIntegerField(blank=True, help_text='The resource row its attempt holds.', null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='target',
            field=models.CharField(blank=True, default='', help_text='Bans, rests and pace of resources count per target (a site).', max_length=255),
        ),
        migrations.AddField(
            model_name='job',
            name='turn',
            field=models.BigIntegerField(default=0, help_text="Its place among its pool's jobs: targets take turns."),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(fields=['status', 'queue', 'pool', '-priority', 'turn', 'run_at', 'id'], name='leases_job_claim'),
        ),
        migrations.AddConstraint(
            model_name='affinity',
            constraint=models.UniqueConstraint(fields=('pool', 'affinity'), name='leases_affinity_key'),
        ),
        migrations.AddConstraint(
            model_name='poolturn',
            constraint=models.UniqueConstraint(fields=('pool', 'queue', 'target'), name='leases_pool_turn'),
        ),
    ]
