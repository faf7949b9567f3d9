"""The JSON API's URLs: every operation's views under /api/ (their plumbing is payments.api)."""

from __future__ import annotations

from django.conf import settings
from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from payments.api import schema, views  # noqa: F401  (schema: the auth extension)
from payments.api.base import json_not_found
from payments.captures import api as captures
from payments.checkout import api as checkout
from payments.refunds import api as refunds

app_name = "payments_api"

urlpatterns = [
    path("orders", checkout.orders, name="orders"),
    path("orders/<int:order_id>", checkout.order_detail, name="order"),
    path("orders/<int:order_id>/checkout", checkout.checkout, name="checkout"),
    path("orders/<int:order_id>/refunds", refunds.refunds, name="refunds"),
    path("orders/<int:order_id>/captures", captures.captures, name="captures"),
    re_path(r"^operations/(?P<key>(?s:.+))$", views.operation_detail, name="operation"),
    path(
        "schema",
        SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]),
        name="schema",
    ),
]
if settings.DEBUG:
    urlpatterns.append(
        path(
            "docs",
            SpectacularSwaggerView.as_view(
                url_name="payments_api:schema", authentication_classes=[], permission_classes=[]
            ),
            name="docs",
        )
    )
# Any other path (newlines included) answers the documented JSON 404.
urlpatterns.append(re_path(r"^(?P<path>(?s:.*))$", json_not_found, name="not_found"))
