"""Adyen's notifications on the desk, read-only: what Adyen signed and what each one did."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from payments.adyen.models import Notification


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    """Every stored notification item; written only by the endpoint, never by hand."""

    list_display = (
        "received_at",
        "event_code",
        "success",
        "psp_reference",
        "original_reference",
        "merchant_reference",
        "amount",
        "currency",
        "outcome",
    )
    list_filter = ("event_code", "success", "outcome")
    search_fields = ("psp_reference", "original_reference", "merchant_reference")
    ordering = ("-received_at", "-pk")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
