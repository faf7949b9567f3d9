"""The shop's models, moved here from `payments` (its migration 0027) without a write.

The tables stay as they are (`payments_order`, ...; each model names its
`db_table`): these operations change the migration state only, except on a
database where payments 0027 dropped them (empty, the shop not installed then),
where they are made. The content
types of the five models move with them, so the permissions attached to
them ("refund_order", "view_order", ...), and the groups and users holding
those, now read `shop.<codename>` and keep every grant.
"""

import django.db.models.deletion
import django.db.models.functions.text
from django.conf import settings
from django.core.exceptions import FieldDoesNotExist
from django.db import migrations, models

from payments.shop.migrations import _tables

MODELS = ["order", "invoice", "creditnote", "ledgerentry", "salesday"]


def _relabel(apps, schema_editor, old, new):
    """Move the models' content types from app label `old` to `new`, their permissions and
    every grant of those with them.

    A fresh database has none yet (post_migrate creates them under `new`). Where
    one under `new` exists already (a process of the new release read it before
    this ran, or post_migrate of an earlier try made it), the permissions move to
    it: one of the same codename there takes over the groups and users holding
    the old one; the admin's history follows; the old content type goes.
    """
    content_type = apps.get_model("contenttypes", "ContentType")
    permission = apps.get_model("auth", "Permission")
    db = schema_editor.connection.alias
    for model in MODELS:
        source = content_type.objects.using(db).filter(app_label=old, model=model).first()
        if source is None:
            continue
        target = content_type.objects.using(db).filter(app_label=new, model=model).first()
        if target is None:
            source.app_label = new
            source.save(update_fields=["app_label"])
            continue
        for held in permission.objects.using(db).filter(content_type=source):
            twin = (
                permission.objects.using(db)
                .filter(content_type=target, codename=held.codename)
                .first()
            )
            if twin is None:
                held.content_type = target
                held.save(update_fields=["content_type"])
                continue
            _move_grants(apps, db, held.pk, twin.pk)
            held.delete()
        if "django_admin_log" in schema_editor.connection.introspection.table_names():
            schema_editor.execute(
                "UPDATE django_admin_log SET content_type_id = %s WHERE content_type_id = %s",
                [target.pk, source.pk],
            )
        source.delete()


def _move_grants(apps, db, old, new):
    """Give every group and user holding permission `old` permission `new` too."""
    holders = [apps.get_model("auth", "Group")._meta.get_field("permissions")]
    try:
        user = apps.get_model(settings.AUTH_USER_MODEL)
        holders.append(user._meta.get_field("user_permissions"))
    except (LookupError, FieldDoesNotExist):
        pass  # a user model without permissions of its own
    for field in holders:
        through = field.remote_field.through
        owner = next(
            f.attname
            for f in through._meta.fields
            if f.is_relation and f.related_model is not field.remote_field.model
        )
        rows = through.objects.using(db)
        have = set(rows.filter(permission_id=new).values_list(owner, flat=True))
        rows.bulk_create(
            through(**{owner: holder, "permission_id": new})
            for holder in rows.filter(permission_id=old).values_list(owner, flat=True)
            if holder not in have
        )


def make_missing_tables(apps, schema_editor):
    """Make the tables a database lacks: one where payments 0027 dropped them, empty,
    because the shop was not installed then. Tables already there are the shop's."""
    _tables.make_missing_tables(apps, schema_editor, "shop")


def move_content_types(apps, schema_editor):
    _relabel(apps, schema_editor, "payments", "shop")


def move_content_types_back(apps, schema_editor):
    _relabel(apps, schema_editor, "shop", "payments")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("payments", "0027_shop_models_moved"),
        ("contenttypes", "0002_remove_content_type_name"),
        # The permissions and the grants of groups and users move with the content types.
        ("auth", "0012_alter_user_first_name_max_length"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="Order",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        (
                            "idempotency_key",
                            models.CharField(blank=True, max_length=255, null=True),
                        ),
                        (
                            "request_fingerprint",
                            models.CharField(blank=True, db_default="", max_length=64),
                        ),
                        ("amount", models.PositiveBigIntegerField()),
                        ("currency", models.CharField(max_length=3)),
                        (
                            "status",
                            models.CharField(
                                choices=[
                                    ("pending", "Pending"),
                                    ("processing", "Processing"),
                                    ("paid", "Paid"),
                                    ("payment_failed", "Payment failed"),
                                    ("partially_refunded", "Partially refunded"),
                                    ("refunded", "Refunded"),
                                ],
                                default="pending",
                                max_length=20,
                            ),
                        ),
                        ("customer_email", models.EmailField(max_length=254)),
                        ("refunded_amount", models.PositiveBigIntegerField(default=0)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("updated_at", models.DateTimeField(auto_now=True)),
                        (
                            "client",
                            models.ForeignKey(
                                blank=True,
                                db_index=False,
                                null=True,
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="orders",
                                to="payments.apiclient",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "payments_order",
                        "permissions": [
                            (
                                "refund_order",
                                "Can refund an order from the desk (its charge or a duplicate)",
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="LedgerEntry",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("amount", models.BigIntegerField()),
                        ("currency", models.CharField(max_length=3)),
                        ("provider_reference", models.CharField(max_length=255)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        (
                            "order",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="ledger_entries",
                                to="shop.order",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "payments_ledgerentry",
                    },
                ),
                migrations.CreateModel(
                    name="Invoice",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("number", models.CharField(max_length=32, unique=True)),
                        ("amount", models.PositiveBigIntegerField()),
                        ("currency", models.CharField(max_length=3)),
                        ("provider_reference", models.CharField(max_length=255)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        (
                            "order",
                            models.OneToOneField(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="invoice",
                                to="shop.order",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "payments_invoice",
                    },
                ),
                migrations.CreateModel(
                    name="CreditNote",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("number", models.CharField(max_length=32, unique=True)),
                        ("amount", models.PositiveBigIntegerField()),
                        ("currency", models.CharField(max_length=3)),
                        ("provider_reference", models.CharField(max_length=255, unique=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        (
                            "order",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="credit_notes",
                                to="shop.order",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "payments_creditnote",
                    },
                ),
                migrations.CreateModel(
                    name="SalesDay",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("day", models.DateField()),
                        ("currency", models.CharField(max_length=3)),
                        ("orders", models.PositiveIntegerField(default=0)),
                        ("total", models.BigIntegerField(default=0)),
                    ],
                    options={
                        "db_table": "payments_salesday",
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("day", "currency"), name="payments_salesday_uniq"
                            )
                        ],
                    },
                ),
                migrations.AddIndex(
                    model_name="order",
                    index=models.Index(
                        django.db.models.functions.text.Lower("customer_email"),
                        name="payments_order_email_lower",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="order",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("amount__gt", 0)), name="payments_order_amount_positive"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="order",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("refunded_amount__lte", models.F("amount"))),
                        name="payments_order_refunds_within_amount",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="order",
                    constraint=models.UniqueConstraint(
                        fields=("client", "idempotency_key"), name="payments_order_client_key_uniq"
                    ),
                ),
            ],
        ),
        migrations.RunPython(make_missing_tables, migrations.RunPython.noop),
        migrations.RunPython(move_content_types, move_content_types_back),
    ]
