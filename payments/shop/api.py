"""The shop's API helpers: which orders a client of the JSON API may reach.

Shared by the shop's example operations (checkout, captures, refunds); the
fence's API plumbing (payments.api.base) knows no order.
"""

from __future__ import annotations

from django.db.models import Q, QuerySet
from rest_framework.request import Request

from payments.api.base import ApiError, caller_client
from payments.api.keys import BOOTSTRAP_CLIENT
from payments.models import ApiClient
from payments.shop.models import Order


def owned_orders(client: ApiClient) -> QuerySet[Order]:
    """The orders `client` may reach: its own; for the bootstrap client also those of nobody.

    Orders without a client are those from before migration 0012 (0013 gives
    them their first operation's client, else the bootstrap client's; a
    previous release's web process may still
    write some during the deploy) and those the tools make (`create_order`
    without a client).
    """
    mine = Q(client=client)
    if client.name == BOOTSTRAP_CLIENT:
        mine |= Q(client__isnull=True)
    return Order.objects.filter(mine)


def caller_order(request: Request, order_id: int) -> Order:
    """The caller's order `order_id`, or ApiError 404: another client's order is not there."""
    order = owned_orders(caller_client(request)).filter(pk=order_id).first()
    if order is None:
        raise order_not_found(order_id)
    return order


def order_not_found(order_id: int) -> ApiError:
    return ApiError(404, "order_not_found", f"Order {order_id} does not exist.")
