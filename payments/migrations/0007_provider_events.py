"""Provider events: signed webhooks and listed events, stored before they are handled."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('payments', '0006_api_clients'),
    ]

    operations = [
        migrations.CreateModel(
            name='ProviderEvent',
            fields=[
                ('id', models.CharField(max_length=255, primary_key=True, serialize=False)),
                ('type', models.CharField(max_length=100)),
                ('created', models.DateTimeField()),
                ('payload', models.JSONField()),
                ('object_id', models.CharField(blank=True, db_index=True, max_length=255)),
                ('received_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('handled_at', models.DateTimeField(blank=True, null=True)),
                ('outcome', models.CharField(blank=True, max_length=40)),
                ('operation', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='provider_events', to='payments.operation')),
            ],
            options={
                'ordering': ['created', 'id'],
                'indexes': [models.Index(fields=['handled_at', 'received_at'], name='payments_event_pending')],
            },
        ),
    ]
