"""The operators' admin: read-only pages for operations, orders and invoices.

Nothing here edits a row: there is no add, change or delete. Operators act
through the desk's buttons (payments.desk.views), which call payments.desk.services.
"""

from __future__ import annotations

__all__ = ["BADGE_COLOURS", "InvoiceAdmin", "OperationAdmin", "OrderAdmin"]

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince

from payments.desk import services as desk
from payments.desk.display import (
    AGED_STATES,
    BADGE_COLOURS,
    key_values,
    pretty_json,
    state_badge,
    when,
)
from payments.desk.views import DESK_ACTIONS, DeskViewsMixin, job_link, with_state_since
from payments.models import (
    Invoice,
    Operation,
    OperationEvent,
    Order,
    StepClaim,
)


class ReadOnlyInline(admin.TabularInline):
    """An inline that shows rows and never edits them; visible to whoever may view operations."""

    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("payments.view_operation")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class StepClaimInline(ReadOnlyInline):
    model = StepClaim
    verbose_name = "step"
    verbose_name_plural = "Steps (claims)"
    ordering = ("claimed_at", "pk")
    fields = readonly_fields = (
        "step",
        "claim_state",
        "idempotency_key",
        "provider_reference",
        "attempts",
        "claimed",
        "outcome",
    )  # who claimed and when it settled: in the audit trail below

    @admin.display(description="claimed at")
    def claimed(self, obj: StepClaim) -> str:
        return when(obj.claimed_at)

    @admin.display(description="state")
    def claim_state(self, obj: StepClaim) -> str:
        return state_badge(obj.state)

    @admin.display(description="result / error")
    def outcome(self, obj: StepClaim) -> str:
        if obj.error and not obj.result:
            return format_html("<small>{}</small>", obj.error)
        if obj.error:
            return format_html("{}<small>{}</small>", key_values(obj.result), obj.error)
        return key_values(obj.result)


class OperationEventInline(ReadOnlyInline):
    model = OperationEvent
    verbose_name = "audit event"
    verbose_name_plural = "Audit trail"
    ordering = ("created_at", "id")
    fields = readonly_fields = ("event_time", "step", "from_badge", "to_badge", "actor", "reason")

    @admin.display(description="when")
    def event_time(self, obj: OperationEvent) -> str:
        return when(obj.created_at)

    @admin.display(description="from")
    def from_badge(self, obj: OperationEvent) -> str:
        return state_badge(obj.from_state)

    @admin.display(description="to")
    def to_badge(self, obj: OperationEvent) -> str:
        return state_badge(obj.to_state)


@admin.register(Operation)
class OperationAdmin(DeskViewsMixin, admin.ModelAdmin):
    """Operations: find them, read them, and act through the desk."""

    list_display = ("key", "kind", "order_link", "badge", "state_age", "attempts", "updated")
    list_display_links = ("key",)
    list_filter = ("state", "kind")
    search_fields = (
        "key",
        "=entity_id",
        "=claims__provider_reference",
        "=claims__idempotency_key",
    )
    search_help_text = (
        "Operation key, order id, provider reference (pi_…) or idempotency key (fence_…)."
    )
    ordering = ("-updated_at",)
    list_per_page = 50
    actions = ("query_selected",)
    inlines = (StepClaimInline, OperationEventInline)
    fields = readonly_fields = (
        "key",
        "kind",
        "order_link",
        "badge",
        "state_age",
        "attempts",
        "last_error",
        "next_attempt_at",
        "lease_owner",
        "lease_expires_at",
        "rq_job",
        "dispatched_at",
        "params_pretty",
        "result_pretty",
        "attempt_links",
        "created_at",
        "updated_at",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Operation]:
        return with_state_since(super().get_queryset(request))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # every write goes through the desk

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # --- columns and fields ----------------------------------------------------

    @admin.display(description="state", ordering="state")
    def badge(self, obj: Operation) -> str:
        return state_badge(obj.state)

    @admin.display(description="in state for", ordering="state_since")
    def state_age(self, obj: Operation) -> str:
        since = getattr(obj, "state_since", None)
        if since is None or obj.state not in AGED_STATES:
            return "-"
        return timesince(since, timezone.now())

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: Operation) -> str:
        # Compact and sortable by eye: the list must fit beside the filters.
        return when(obj.updated_at)

    @admin.display(description="order", ordering="entity_id")
    def order_link(self, obj: Operation) -> str:
        if obj.entity_type != "order":
            return f"{obj.entity_type} {obj.entity_id}"
        url = reverse("admin:payments_order_change", args=[obj.entity_id])
        return format_html('<a href="{}">Order {}</a>', url, obj.entity_id)

    @admin.display(description="RQ job")
    def rq_job(self, obj: Operation) -> str:
        link = job_link(obj)
        if link is None:
            return "-"
        if link.url is None:
            return format_html("{} <small>({})</small>", link.job_id, link.status)
        return format_html(
            '<a href="{}">{}</a> <small>({})</small>', link.url, link.job_id, link.status
        )

    @admin.display(description="params")
    def params_pretty(self, obj: Operation) -> str:
        return pretty_json(obj.params)

    @admin.display(description="result")
    def result_pretty(self, obj: Operation) -> str:
        return pretty_json(obj.result)

    @admin.display(description="attempts chain")
    def attempt_links(self, obj: Operation) -> str:
        links = []
        if obj.retry_of_id and obj.retry_of is not None:
            links.append(("new attempt of", obj.retry_of_id, obj.retry_of.key))
        links += [("retried as", r.pk, r.key) for r in obj.retries.order_by("pk")]
        if not links:
            return "-"
        return format_html_join(
            mark_safe("<br>"),
            '{} <a href="{}">{}</a>',
            ((label, reverse("admin:payments_operation_change", args=[pk]), key)
             for label, pk, key in links),
        )  # fmt: skip

    # --- the desk's buttons on the operation page -----------------------------

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ):
        op = self.get_object(request, unquote(object_id))
        extra = dict(extra_context or {})
        if op is not None:
            extra["desk_buttons"] = self._desk_buttons(request, op)
        return super().change_view(request, object_id, form_url, extra)

    def _desk_buttons(self, request: HttpRequest, op: Operation) -> list[dict[str, Any]]:
        """The actions this user may use, each enabled or with the reason it is not."""
        if not self.has_reconcile_permission(request):
            return []
        available = desk.available_actions(op)
        info = f"admin:{self.opts.app_label}_{self.opts.model_name}"
        buttons = [_button(info, op, "query_provider", "")]
        buttons.append(_button(info, op, "resume", available.refused.get("resume", "")))
        for step in available.settleable_steps:
            buttons.append(_button(info, op, "mark_succeeded", "", step))
            buttons.append(_button(info, op, "mark_failed", "", step))
        if self.has_new_attempt_permission(request):
            buttons.append(
                _button(info, op, "new_attempt", available.refused.get("new_attempt", ""))
            )
        return buttons


def _button(info: str, op: Operation, action: str, refused: str, step: str = "") -> dict[str, Any]:
    if step:
        url = reverse(f"{info}_desk_step", args=[op.pk, step, action])
        label = f"{DESK_ACTIONS[action].title.replace('step', step)}"
    else:
        url = reverse(f"{info}_desk", args=[op.pk, action])
        label = DESK_ACTIONS[action].title
    return {"action": action, "label": label, "url": url, "refused": refused}


class ReadOnlyAdmin(admin.ModelAdmin):
    """Browse only: the business rows are written by their services."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Order)
class OrderAdmin(ReadOnlyAdmin):
    # No e-mail in the list: an operator needs it on one order's page at most.
    list_display = ("id", "amount_display", "currency", "status", "created_at")
    list_filter = ("status", "currency")
    search_fields = ("=id",)
    ordering = ("-created_at",)
    fields = readonly_fields = (
        "id", "amount_display", "currency", "status", "customer_email", "created_at",
        "updated_at", "operations",
    )  # fmt: skip

    @admin.display(description="amount", ordering="amount")
    def amount_display(self, obj: Order) -> str:
        return f"{obj.amount / 100:.2f}"

    @admin.display(description="operations")
    def operations(self, obj: Order) -> str:
        ops = Operation.objects.filter(entity_type="order", entity_id=str(obj.pk)).order_by("pk")
        if not ops:
            return "-"
        return format_html_join(
            mark_safe("<br>"),
            '<a href="{}">{}</a> {}',
            ((reverse("admin:payments_operation_change", args=[o.pk]), o.key, state_badge(o.state))
             for o in ops),
        )  # fmt: skip


@admin.register(Invoice)
class InvoiceAdmin(ReadOnlyAdmin):
    list_display = ("number", "order", "amount", "currency", "provider_reference", "created_at")
    search_fields = ("=number", "=provider_reference", "=order__id")
    ordering = ("-created_at",)
    fields = readonly_fields = (
        "number", "order", "amount", "currency", "provider_reference", "created_at",
    )  # fmt: skip


# The admin index links to the Needs attention page (the template only adds a box).
admin.site.index_template = "admin/payments/index.html"
