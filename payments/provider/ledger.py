"""The provider's intents and refunds as the fence audit reads them (its declared `ledger`).

Listed by `created` (consistent; the search API lags and never decides); an
intent counts as taken when it succeeded, for what it received (a capture may
take part of what it held), a refund when it succeeded.
"""

from __future__ import annotations

from payments.engine.facts import SystemUnavailable
from payments.engine.systems import Ledger, LedgerEntry
from payments.provider.client import PaymentIntent, ProviderClient, Refund
from payments.provider.errors import ProviderError


def intent_entry(intent: PaymentIntent) -> LedgerEntry:
    """An intent as a ledger entry: what it received, else what it asked."""
    return LedgerEntry(
        id=intent.id,
        succeeded=intent.status == "succeeded",
        metadata=dict(intent.metadata),
        amount=intent.amount_received or intent.amount,
        created=intent.created,
    )


def refund_entry(refund: Refund) -> LedgerEntry:
    """A refund as a ledger entry, under the intent it refunds."""
    return LedgerEntry(
        id=refund.id,
        succeeded=refund.status == "succeeded",
        metadata=dict(refund.metadata),
        amount=refund.amount,
        created=refund.created,
        parent=refund.payment_intent,
    )


def ledger(listed_from: int, listed_to: int) -> Ledger:
    """The provider's intents and refunds created in [listed_from, listed_to];
    SystemUnavailable (its cause the provider's error) when it cannot be listed."""
    try:
        return _listed(listed_from, listed_to)
    except ProviderError as exc:
        raise SystemUnavailable(f"{type(exc).__name__}: {exc}") from exc


def _listed(listed_from: int, listed_to: int) -> Ledger:
    with ProviderClient.from_settings() as client:
        return Ledger(
            payments=[
                intent_entry(i)
                for i in client.list_payment_intents(created_gte=listed_from, created_lte=listed_to)
            ],
            refunds=[
                refund_entry(r)
                for r in client.list_refunds(created_gte=listed_from, created_lte=listed_to)
            ],
        )
