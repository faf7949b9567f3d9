"""Operation keys get a scope: derived keys (follow-ups, new attempts) can never collide with
a client's, and a follow-up names its parent."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('payments', '0002_fenceauditrun_ledgerentry_salesday'),
    ]

    operations = [
        migrations.AddField(
            model_name='operation',
            name='parent',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='follow_ups', to='payments.operation'),
        ),
        migrations.AddField(
            model_name='operation',
            name='scope',
            field=models.CharField(choices=[('client', 'Client'), ('derived', 'Derived')], default='client', max_length=16),
        ),
        migrations.AddConstraint(
            model_name='operation',
            constraint=models.UniqueConstraint(fields=('scope', 'key'), name='payments_operation_scope_key_uniq'),
        ),
        # Removed after the new one exists: keys stay unique throughout.
        migrations.RemoveConstraint(
            model_name='operation',
            name='payments_operation_key_uniq',
        ),
    ]
