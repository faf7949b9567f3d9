"""The InboxEntry admin is read-only: rows are written and purged by the services."""

from __future__ import annotations

from django.contrib import admin
from django.test import RequestFactory

from inbox.models import InboxEntry


def test_admin__registered_read_only() -> None:
    model_admin = admin.site._registry[InboxEntry]
    request = RequestFactory().get("/")

    assert model_admin.list_display == ("consumer", "message_id", "handled_at")
    assert model_admin.list_filter == ("consumer",)
    assert model_admin.search_fields == ("message_id__exact",)
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)
    assert not model_admin.has_delete_permission(request)
