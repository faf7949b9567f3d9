from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from payments.observability.health import healthz
from payments.observability.metrics import metrics_view

urlpatterns = [
    path("admin/rq/", include("django_rq.urls")),
    path("admin/", admin.site.urls),
    path("api/", include("payments.urls")),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
]
