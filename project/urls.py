from __future__ import annotations

from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from django_rq import urls as django_rq_urls

from payments.desk.rq_access import guarded_urlpatterns
from payments.observability.health import healthz
from payments.observability.metrics import metrics_view
from payments.webhooks.views import provider_webhook

urlpatterns = [
    # django-rq's pages, each behind its permission (payments/desk/rq_access.py).
    path("admin/rq/", include((guarded_urlpatterns(django_rq_urls.urlpatterns), "django_rq"))),
    # The shop's pages moved with its models to the app `shop` (payments 0027): a bookmark
    # or a ticket's link to an order's old page still lands on it (302: not cached, so a
    # rollback to the release before finds its own pages again).
    re_path(
        r"^admin/payments/(?P<model>order|invoice)/(?P<rest>.*)$",
        RedirectView.as_view(
            url="/admin/shop/%(model)s/%(rest)s", permanent=False, query_string=True
        ),
    ),
    path("admin/", admin.site.urls),
    path("api/", include("payments.urls")),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("webhooks/provider", provider_webhook, name="provider_webhook"),
    # Adyen's signed notifications (the URL configured in Adyen's Customer Area).
    path("adyen/", include("payments.adyen.urls")),
]
