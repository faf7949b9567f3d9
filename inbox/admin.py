"""Read-only admin for inbox entries: they are written and purged by the services only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from inbox.models import InboxEntry


@admin.register(InboxEntry)
class InboxEntryAdmin(admin.ModelAdmin):
    """List and search handled messages; no add, change or delete."""

    list_display = ("consumer", "message_id", "handled_at")
    list_filter = ("consumer",)
    # Exact match: ids are pasted whole from logs, and a substring search would
    # scan the whole table.
    search_fields = ("message_id__exact",)
    # Newest first, by id (recorded order): read through the primary key, so that no
    # index on handled_at is written for each message (migration 0003).
    ordering = ("-id",)
    # No column sorts: handled_at has no index of its own, and a sort would read every row.
    sortable_by = ()
    # The default paginator counts the whole table; the inbox can be large.
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
