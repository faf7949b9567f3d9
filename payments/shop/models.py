"""The shop's records: orders, their invoices and credit notes, the sales ledger.

An example of fenced business, in an app of its own (label `shop`): the fence
(`payments`) never imports it. Its tables keep the names they had when these
models lived in `payments` (migration payments 0027 and shop 0001 moved them
without touching a row), so `db_table` is set on each.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Lower

SALES_DAY_UNIQUE_CONSTRAINT = "payments_salesday_uniq"


class OrderStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # created, not yet checked out
    PROCESSING = "processing", "Processing"  # a checkout operation is under way
    PAID = "paid", "Paid"  # charged, invoiced
    PAYMENT_FAILED = "payment_failed", "Payment failed"  # declined or given up
    PARTIALLY_REFUNDED = "partially_refunded", "Partially refunded"  # paid, part given back
    REFUNDED = "refunded", "Refunded"  # paid, all given back


ORDER_KEY_CONSTRAINT = "payments_order_client_key_uniq"


class Order(models.Model):
    """A customer's order; amounts in minor units (cents).

    It belongs to the API client that created it: the API finds it for that
    client only. An order without a client (made before migration 0012, or by
    the tools) is the bootstrap client's (`payments.shop.api.owned_orders`).
    """

    KEY_CONSTRAINT = ORDER_KEY_CONSTRAINT

    client = models.ForeignKey(
        "payments.ApiClient",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="orders",
        db_index=False,  # the (client, idempotency_key) unique index leads with client_id
    )
    #: The Idempotency-Key of the POST that created it; NULL (not "") when sent without one,
    #: as NULLs never collide in the unique index.
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    #: What that POST asked for (sha256 of its fields): the same key with another body is 409.
    #: A default in the database too: a previous release's INSERT, which does not name the
    #: column, still works during the deploy.
    request_fingerprint = models.CharField(max_length=64, blank=True, db_default="")
    amount = models.PositiveBigIntegerField()
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=20, choices=OrderStatus, default=OrderStatus.PENDING)
    customer_email = models.EmailField()
    #: Minor units given back by succeeded refunds (their credit notes add up to it).
    refunded_amount = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "payments_order"
        constraints = [
            models.CheckConstraint(
                condition=Q(amount__gt=0), name="payments_order_amount_positive"
            ),
            models.CheckConstraint(
                condition=Q(refunded_amount__lte=models.F("amount")),
                name="payments_order_refunds_within_amount",
            ),
            # Built CONCURRENTLY by migration 0012 (a unique index; NULL keys never collide).
            models.UniqueConstraint(
                fields=["client", "idempotency_key"], name=ORDER_KEY_CONSTRAINT
            ),
        ]
        indexes = [
            # The desk's search by e-mail, any case (payments.desk.lists; migration 0017).
            models.Index(Lower("customer_email"), name="payments_order_email_lower"),
        ]
        permissions = [
            ("refund_order", "Can refund an order from the desk (its charge or a duplicate)"),
        ]

    def __str__(self) -> str:
        return f"Order {self.pk}"


class Invoice(models.Model):
    """The invoice of a paid order; one per order, enforced by the database."""

    order = models.OneToOneField(Order, on_delete=models.PROTECT, related_name="invoice")
    number = models.CharField(max_length=32, unique=True)
    amount = models.PositiveBigIntegerField()
    currency = models.CharField(max_length=3)
    provider_reference = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "payments_invoice"

    def __str__(self) -> str:
        return self.number


class CreditNote(models.Model):
    """The credit note of one succeeded refund; one per refund operation (its local step)."""

    order = models.ForeignKey(Order, on_delete=models.PROTECT, related_name="credit_notes")
    number = models.CharField(max_length=32, unique=True)
    amount = models.PositiveBigIntegerField()
    currency = models.CharField(max_length=3)
    provider_reference = models.CharField(max_length=255, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "payments_creditnote"

    def __str__(self) -> str:
        return self.number


class LedgerEntry(models.Model):
    """A sales-ledger line written for a paid order (protected by the inbox, not a constraint)."""

    order = models.ForeignKey(Order, on_delete=models.PROTECT, related_name="ledger_entries")
    amount = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    provider_reference = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "payments_ledgerentry"

    def __str__(self) -> str:
        return f"{self.order_id}: {self.amount} {self.currency}"


class SalesDay(models.Model):
    """Revenue per day and currency: a counter that a duplicate message would inflate."""

    day = models.DateField()
    currency = models.CharField(max_length=3)
    orders = models.PositiveIntegerField(default=0)
    total = models.BigIntegerField(default=0)

    UNIQUE_CONSTRAINT = SALES_DAY_UNIQUE_CONSTRAINT

    class Meta:
        db_table = "payments_salesday"
        constraints = [
            models.UniqueConstraint(fields=["day", "currency"], name=SALES_DAY_UNIQUE_CONSTRAINT),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.currency}: {self.orders} orders, {self.total}"
