"""The JSON API's URLs: every operation's views under /api/ (their plumbing is payments.api)."""

from __future__ import annotations

from django.urls import path

from payments.api import views
from payments.checkout import api as checkout
from payments.refunds import api as refunds

app_name = "payments_api"

urlpatterns = [
    path("orders", checkout.orders, name="orders"),
    path("orders/<int:order_id>", checkout.order_detail, name="order"),
    path("orders/<int:order_id>/checkout", checkout.checkout, name="checkout"),
    path("orders/<int:order_id>/refunds", refunds.refunds, name="refunds"),
    path("operations/<path:key>", views.operation_detail, name="operation"),
]
