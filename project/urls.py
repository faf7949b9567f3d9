from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from django_rq import urls as django_rq_urls

from payments.desk.rq_access import guarded_urlpatterns
from payments.observability.health import healthz
from payments.observability.metrics import metrics_view
from payments.webhooks.views import provider_webhook

urlpatterns = [
    # django-rq's pages, each behind its permission (payments/desk/rq_access.py).
    path("admin/rq/", include((guarded_urlpatterns(django_rq_urls.urlpatterns), "django_rq"))),
    path("admin/", admin.site.urls),
    path("api/", include("payments.urls")),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("webhooks/provider", provider_webhook, name="provider_webhook"),
    # Adyen's signed notifications (the URL configured in Adyen's Customer Area).
    path("adyen/", include("payments.adyen.urls")),
]
