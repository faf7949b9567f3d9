from __future__ import annotations

from django.urls import path

from payments.adyen.views import notifications

urlpatterns = [path("notifications/", notifications, name="adyen_notifications")]
