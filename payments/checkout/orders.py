"""Order services: the only writers of Order rows outside the checkout handler."""

from __future__ import annotations

from payments.models import ApiClient, Order

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
