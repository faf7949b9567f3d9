"""Order services: the only writers of Order rows outside the checkout handler."""

from __future__ import annotations

import hashlib
import json

from django.db import IntegrityError, transaction

from payments.exceptions import OperationConflict
from payments.models import ApiClient
from payments.shop.models import Order

#: ISO 4217 codes accepted for orders (lower case, as the provider expects).
CURRENCIES = frozenset(
    "aud brl cad chf cny czk dkk eur gbp hkd huf idr ils inr jpy krw mxn myr nok nzd php "
    "pln ron sek sgd thb try usd zar".split()
)


def create_order(
    *, amount: int, currency: str, email: str, client: ApiClient | None = None
) -> Order:
    """Create a pending order of `client`; the caller has validated the values.

    Without a client (the tools, the tests) the order is the bootstrap client's.
    """
    return Order.objects.create(
        amount=amount, currency=currency.lower(), customer_email=email, client=client
    )


def create_order_once(
    *, key: str, client: ApiClient, amount: int, currency: str, email: str
) -> tuple[Order, bool]:
    """Create `client`'s order under Idempotency-Key `key`; (order, created).

    Claim by INSERT: the unique (client, idempotency_key) index decides which of
    two racing requests creates the order; the other gets it back (created
    False). The same key with other values raises OperationConflict.
    """
    fields = {"amount": amount, "currency": currency.lower(), "customer_email": email}
    digest = _fingerprint(fields)
    try:
        with transaction.atomic():  # a savepoint when the caller has a transaction open
            order = Order.objects.create(
                client=client, idempotency_key=key, request_fingerprint=digest, **fields
            )
        return order, True
    except IntegrityError as exc:
        if not _is_key_taken(exc):
            raise
    existing = Order.objects.get(client=client, idempotency_key=key)
    if existing.request_fingerprint != digest:
        raise OperationConflict(key, existing_kind="order", existing_entity=f"order {existing.pk}")
    return existing, False


def _fingerprint(fields: dict[str, object]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _is_key_taken(exc: IntegrityError) -> bool:
    """Tell whether `exc` is the (client, idempotency_key) unique violation."""
    diag = getattr(exc.__cause__, "diag", None)
    return diag is not None and diag.constraint_name == Order.KEY_CONSTRAINT
