"""Follow-ups of a paid order: local-only message handlers behind the inbox.

A paid order's step (the checkout's `mark_paid`, the capture's `record`) writes
one operation row per follow-up in its own transaction
(payments.shop.entities.write_follow_ups_in_tx) (the outbox, never an after-commit enqueue from a handler).
The engine delivers each as an RQ message whose id is derived from the
operation key, so every redelivery carries the same message id and the inbox
runs the handler once: its writes, its inbox row and the operation's
`succeeded` commit together. The writes here are deliberately not idempotent
on their own (a ledger line, a counter): the inbox is what keeps them exactly
once.
"""

from __future__ import annotations

from datetime import date

from django.db import connection

from payments.checkout.names import (
    COUNT_SALE,
    LEDGER_CONSUMER,
    RECORD_SALE,
    SALES_STATS_CONSUMER,
)
from payments.fence import Follows, message
from payments.models import Operation
from payments.shop.entities import ORDER_PAID, write_follow_ups_in_tx  # noqa: F401  (re-exported)
from payments.shop.models import LedgerEntry, SalesDay

#: The kinds this package adds to every paid order, in the order they are written.
FOLLOW_UPS = (RECORD_SALE, COUNT_SALE)


@message(RECORD_SALE, consumer=LEDGER_CONSUMER, follows=Follows(ORDER_PAID), inline=True)
def record_sale(op: Operation) -> None:
    """Write the order's sales-ledger line. Runs in the message's inbox transaction."""
    LedgerEntry.objects.create(
        order_id=op.params["order_id"],
        amount=op.params["amount"],
        currency=op.params["currency"],
        provider_reference=op.params["reference"],
    )


@message(COUNT_SALE, consumer=SALES_STATS_CONSUMER, follows=Follows(ORDER_PAID), inline=True)
def count_sale(op: Operation) -> None:
    """Add the order to its day's sales counter. Runs in the message's inbox transaction."""
    add_to_sales_day(op.created_at.date(), op.params["currency"], op.params["amount"])


#: One order more on a day's counter: the day's row is created by its first order
#: (a concurrent first order waits on the unique key, then adds to the row it made).
ADD_TO_SALES_DAY = f"""
INSERT INTO {SalesDay._meta.db_table} (day, currency, orders, total)
VALUES (%(day)s, %(currency)s, 1, %(amount)s)
ON CONFLICT ON CONSTRAINT {SalesDay.UNIQUE_CONSTRAINT}
DO UPDATE SET orders = {SalesDay._meta.db_table}.orders + 1,
              total = {SalesDay._meta.db_table}.total + EXCLUDED.total
"""


def add_to_sales_day(day: date, currency: str, amount: int) -> None:
    """Count one order of `amount` on `day`'s counter: one statement, the row made if missing.

    The ORM would read the row (get_or_create, with a savepoint to create it)
    and then add to it: three round trips on a day's first order, two after.
    """
    with connection.cursor() as cursor:
        cursor.execute(ADD_TO_SALES_DAY, {"day": day, "currency": currency, "amount": amount})
