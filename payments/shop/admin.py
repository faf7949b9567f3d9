"""The shop's pages in the admin: orders (each one's payment page) and invoices.

Registered by the shop's own app, as each business package registers its own
pages: a project without the shop has none of these. Read-only, like every
desk list (payments.admin.ReadOnlyAdmin); operators act through the desk's
buttons on the order's payment page (payments.desk.views.payment, refund).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import SEARCH_VAR
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from payments.admin import ReadOnlyAdmin
from payments.desk.display import reference_link, state_badge, when
from payments.desk.filters import DateRangeFilter
from payments.desk.lists import BoundedListMixin
from payments.desk.views.payment import one_moment, payment_context
from payments.desk.views.refund import refund_urls
from payments.models import Operation
from payments.money import format_money
from payments.shop.lists import RecentCurrencyFilter, orders_search_note, search_orders
from payments.shop.models import Invoice, Order

__all__ = ["InvoiceAdmin", "OrderAdmin"]


@admin.register(Order)
class OrderAdmin(BoundedListMixin, ReadOnlyAdmin):
    # No e-mail in the list: an operator needs it on one order's page at most (and may search it).
    list_display = ("id", "amount_display", "status", "created")
    list_filter = ("status", RecentCurrencyFilter, ("created_at", DateRangeFilter))
    search_fields = ("=id",)  # routed by the term's shape: get_search_results
    search_help_text = (
        "Order id or the customer's e-mail (exact, any case). A provider's or another "
        "system's reference, or an operation key: search the operations."
    )
    ordering = ("-pk",)  # newest first, on the primary key
    fields = readonly_fields = (
        "id", "amount_display", "status", "customer_email", "created", "updated", "operations",
    )  # fmt: skip

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Order], search_term: str
    ) -> tuple[QuerySet[Order], bool]:
        """The order id, or the customer's e-mail through its index (payments.desk.lists)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        found = search_orders(queryset, term)
        return (queryset.none() if found is None else found), False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """The list, with a note naming where to look for a term that is no order id or
        e-mail (a provider reference, an operation key: the operations search)."""
        extra = dict(extra_context or {})
        operations = None
        if request.user.has_perm("payments.view_operation"):
            operations = reverse("admin:payments_operation_changelist")
        extra["desk_search_note"] = orders_search_note(request.GET.get(SEARCH_VAR, ""), operations)
        return super().changelist_view(request, extra)

    def get_urls(self) -> list[Any]:
        return refund_urls(self) + super().get_urls()

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        """The order's page is its payment's: money, charges, refunds, provider timeline.

        Read at one moment, the order's own fields included (rendered inside it): a
        refund settled while the page is read never shows settled in one part and
        not in another.
        """
        with one_moment():
            order = self.get_object(request, unquote(object_id))
            extra = dict(extra_context or {})
            if order is not None and request.user.has_perm("payments.view_operation"):
                extra["payment"] = payment_context(request, order)
            response = super().change_view(request, object_id, form_url, extra)
            if hasattr(response, "render"):
                response.render()  # the operations field is read at render time
        return response

    @admin.display(description="amount", ordering="amount")
    def amount_display(self, obj: Order) -> str:
        return format_money(obj.amount, obj.currency)

    @admin.display(description="created at", ordering="created_at")
    def created(self, obj: Order) -> str:
        return when(obj.created_at)

    @admin.display(description="updated at", ordering="updated_at")
    def updated(self, obj: Order) -> str:
        return when(obj.updated_at)

    @admin.display(description="operations")
    def operations(self, obj: Order) -> str:
        ops = Operation.objects.filter(entity_type="order", entity_id=str(obj.pk)).order_by("pk")
        if not ops:
            return "-"
        # A follow-up's key ("19:record_sale") names its parent's id, not an order: say so.
        return format_html_join(
            mark_safe("<br>"),
            '<a href="{}">{}</a> {}{}',
            ((reverse("admin:payments_operation_change", args=[o.pk]), o.key, state_badge(o.state),
              format_html(' <small class="quiet">follow-up ({}) of operation {}</small>',
                          o.kind, o.parent_id) if o.parent_id else "")
             for o in ops),
        )  # fmt: skip


@admin.register(Invoice)
class InvoiceAdmin(ReadOnlyAdmin):
    list_display = ("number", "order", "amount_display", "reference", "created")
    search_fields = ("=number", "=provider_reference", "=order__id")
    ordering = ("-created_at",)
    fields = readonly_fields = (
        "number", "order", "amount_display", "reference", "created",
    )  # fmt: skip

    @admin.display(description="amount", ordering="amount")
    def amount_display(self, obj: Invoice) -> str:
        return format_money(obj.amount, obj.currency)

    @admin.display(description="provider reference", ordering="provider_reference")
    def reference(self, obj: Invoice) -> str:
        return reference_link(obj.provider_reference)

    @admin.display(description="created at", ordering="created_at")
    def created(self, obj: Invoice) -> str:
        return when(obj.created_at)
