from __future__ import annotations

from django.urls import path

from payments.checkout import api

app_name = "payments_api"

urlpatterns = [
    path("orders", api.orders, name="orders"),
    path("orders/<int:order_id>", api.order_detail, name="order"),
    path("orders/<int:order_id>/checkout", api.checkout, name="checkout"),
    path("operations/<path:key>", api.operation_detail, name="operation"),
]
