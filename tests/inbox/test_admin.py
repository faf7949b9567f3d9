"""The InboxEntry admin is read-only: rows are written and purged by the services."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import AnonymousUser
from django.db import connection, transaction
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


@pytest.mark.django_db
def test_admin__newest_first_through_an_index_written_anyway() -> None:
    """The changelist's order reads through the primary key (no index on handled_at
    alone, whose entry each handled message would write): plans as on a large table."""
    model_admin = admin.site._registry[InboxEntry]
    request = RequestFactory().get("/")
    request.user = AnonymousUser()
    queryset = model_admin.get_queryset(request).order_by(*model_admin.get_ordering(request))
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = queryset[:100].explain()
    assert "inbox_inboxentry_pkey" in plan and "Sort" not in plan, plan
    indexes = {index.name for index in InboxEntry._meta.indexes}
    assert "inbox_entry_handled_at_idx" not in indexes
