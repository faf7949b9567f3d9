"""The operators' admin: read-only pages for operations, orders and invoices.

Nothing here edits a row: there is no add, change or delete. Operators act
through the desk's buttons (payments.desk.views), which call payments.desk.services.
Money is shown by each currency's exponent (payments.money), times in one
format (payments.desk.display.when), and a refused page names the permission
it needs (templates/403.html).
"""

from __future__ import annotations

__all__ = ["BADGE_COLOURS", "OperationAdmin", "ReadOnlyAdmin"]

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import SEARCH_VAR
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, Prefetch, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince
from rest_framework_api_key.admin import APIKeyModelAdmin
from rest_framework_api_key.models import APIKey

from payments.desk import services as desk
from payments.desk.display import (
    AGED_STATES,
    BADGE_COLOURS,
    entity_link,
    key_values,
    money_line,
    pretty_json,
    provider_requests,
    provider_view_table,
    reference_link,
    stale_badge,
    state_badge,
    when,
)
from payments.desk.evidence import evidence_html, operation_label, query_title, why_waiting
from payments.desk.filters import DateRangeFilter
from payments.desk.lists import (
    EXACT_COUNT_UP_TO,
    BoundedListMixin,
    KindFilter,
    NothingRanFilter,
    operation_id_in,
    operations_search_help,
    operations_search_note,
    search_operations,
)
from payments.desk.views.actions import DESK_ACTIONS, DeskAction
from payments.desk.views.mixin import DeskViewsMixin
from payments.desk.views.payment import errors_shown
from payments.desk.views.queries import (
    attempts_of,
    first_error_of,
    follow_up_kinds,
    follow_up_q,
    follow_ups_not_succeeded,
    last_error_of,
    lookups_of,
    stale_q,
    with_attempts,
    with_state_since,
)
from payments.desk.views.rq_links import job_link
from payments.desk.views.search import lead_from_provider
from payments.engine.handlers import money_moved
from payments.models import (
    ApiClient,
    ClaimState,
    ClientApiKey,
    Operation,
    OperationEvent,
    OperationState,
    StepClaim,
)
from payments.money import format_money, money_of


class NamedPermissionsMixin:
    """Say which permission a refused admin page needs (the styled 403 page shows it).

    Django's own views raise a bare PermissionDenied; these checks run first
    with the same rules and name the permission. Nobody adds, edits or deletes
    here, whatever their permissions: every write goes through a service.
    """

    opts: Any
    has_view_or_change_permission: Callable[..., bool]

    def _view_permission(self) -> str:
        return f"{self.opts.app_label}.view_{self.opts.model_name}"

    def _require_view(self, request: HttpRequest) -> None:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied(self._view_permission())

    def _read_only(self) -> PermissionDenied:
        return PermissionDenied(
            f"nobody edits {self.opts.verbose_name_plural} here: they change only through "
            "their services (the desk's actions for operations)"
        )

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self._require_view(request)
        return super().changelist_view(request, extra_context)  # type: ignore[misc]

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        self._require_view(request)
        if request.method == "POST":
            raise self._read_only()
        return super().change_view(request, object_id, form_url, extra_context)  # type: ignore[misc]

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        self._require_view(request)
        return super().history_view(request, object_id, extra_context)  # type: ignore[misc]

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        raise self._read_only()

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        raise self._read_only()


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
        "reference",
        "attempts",
        "claimed",
        "outcome",
    )  # who claimed and when it settled: in the audit trail below; the provider's view above

    @admin.display(description="provider reference")
    def reference(self, obj: StepClaim) -> str:
        return reference_link(obj.provider_reference)

    @admin.display(description="claimed at")
    def claimed(self, obj: StepClaim) -> str:
        return when(obj.claimed_at)

    @admin.display(description="state")
    def claim_state(self, obj: StepClaim) -> str:
        return state_badge(obj.state)

    @admin.display(description="result / error")
    def outcome(self, obj: StepClaim) -> str:
        if not obj.error:
            return key_values(obj.result)
        error = format_html("<small>{}</small>", obj.error)
        first = first_error_of(obj.operation, step=obj.step).text
        if first and first != obj.error:  # a later look or release wrote over it
            error = format_html(
                '{}<br><small class="desk-first-error">first error: {}</small>', error, first
            )
        return format_html("{}{}", key_values(obj.result), error) if obj.result else error


class OperationEventInline(ReadOnlyInline):
    model = OperationEvent
    verbose_name = "audit event"
    verbose_name_plural = "Audit trail"
    ordering = ("created_at", "id")
    fields = readonly_fields = (
        "event_time",
        "step",
        "from_badge",
        "to_badge",
        "actor",
        "reason",
        "requests_shown",
    )

    @admin.display(description="when")
    def event_time(self, obj: OperationEvent) -> str:
        return when(obj.created_at)

    @admin.display(description="from")
    def from_badge(self, obj: OperationEvent) -> str:
        return state_badge(obj.from_state)

    @admin.display(description="to")
    def to_badge(self, obj: OperationEvent) -> str:
        return state_badge(obj.to_state)

    @admin.display(description="provider requests (HTTP status, request id)")
    def requests_shown(self, obj: OperationEvent) -> str:
        return provider_requests(obj.requests)


#: States a person must look at: there, an empty last error is filled from the audit trail.
WAITING_FOR_A_PERSON = frozenset(
    {OperationState.UNCERTAIN, OperationState.NEEDS_REVIEW, OperationState.FAILED}
)


class FollowUpFilter(admin.SimpleListFilter):
    """Follow-ups (ledger, sales counter) are hidden unless asked for: a third of rows, no money."""

    title = "follow-ups"
    parameter_name = "followups"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("all", "Shown"),
            ("only", "Only follow-ups"),
            ("open", "Only follow-ups not succeeded"),
        ]

    def choices(self, changelist: Any) -> Any:
        for choice in super().choices(changelist):
            if choice["display"] == "All":  # the default: no parameter
                choice["display"] = "Hidden"
            yield choice

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "all":
            return queryset
        if value == "only":
            return queryset.filter(follow_up_q())
        if value == "open":  # what Needs attention counts as not succeeded
            return queryset.filter(pk__in=follow_ups_not_succeeded(EXACT_COUNT_UP_TO + 1))
        if request.GET.get("kind") in follow_up_kinds():
            return queryset  # a follow-up kind asked for by name
        if operation_id_in(request.GET.get(SEARCH_VAR, "")) is not None:
            return queryset  # one operation asked for by its id ("#17"), follow-up or not
        return queryset.exclude(follow_up_q())


class LeaseFilter(admin.SimpleListFilter):
    """Running operations whose worker's lease ran out: stuck until the sweeper takes them."""

    title = "lease"
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("stale", "Stale (running, lease expired)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "stale":
            return queryset.filter(stale_q())
        return queryset


@admin.register(Operation)
class OperationAdmin(NamedPermissionsMixin, DeskViewsMixin, BoundedListMixin, admin.ModelAdmin):
    """Operations: find them, read them, and act through the desk."""

    list_display = (
        "key", "kind", "entity_link", "amount", "badge", "state_age", "attempts_shown", "updated",
    )  # fmt: skip
    list_display_links = ("key",)
    list_filter = (
        FollowUpFilter, "state", LeaseFilter, NothingRanFilter, KindFilter,
        ("created_at", DateRangeFilter),
    )  # fmt: skip
    # The search is routed by the term's shape (get_search_results); this shows the box.
    search_fields = ("key",)
    ordering = ("-pk",)  # newest first, on the primary key
    list_per_page = 50
    actions = ("query_selected",)
    inlines = (StepClaimInline, OperationEventInline)

    @property
    def search_help_text(self) -> str:  # type: ignore[override]
        """In the words of the entities the installed handlers declare (read per page)."""
        return operations_search_help()

    fields = readonly_fields = (
        "key",
        "tenant_shown",
        "kind",
        "entity_link",
        "money",
        "badge",
        "state_age",
        "provider_side",
        "attempts_shown",
        "last_error_shown",
        "next_attempt",
        "lease_owner",
        "lease_expires",
        "rq_job",
        "dispatched",
        "params_pretty",
        "result_pretty",
        "attempt_links",
        "created",
        "updated",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Operation]:
        # The done claims of a page's operations in one query (the amount column reads
        # what they moved), not one per row.
        done = StepClaim.objects.filter(state=ClaimState.DONE).only(
            "operation_id", "step", "state", "result"
        )
        queryset = (
            super()
            .get_queryset(request)
            .prefetch_related(Prefetch("claims", queryset=done, to_attr="done_claims"))
        )
        return with_attempts(with_state_since(queryset))

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Operation], search_term: str
    ) -> tuple[QuerySet[Operation], bool]:
        """One indexed lookup chosen by the term's shape (payments.desk.lists); any other
        term is an exact operation key or idempotency key. Never duplicates (EXISTS)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        user = request.user
        found = search_operations(
            queryset,
            term,
            may_view=lambda model: user.has_perm(
                f"{model._meta.app_label}.{get_permission_codename('view', model._meta)}"
            ),
        )
        if found is None:
            keyed = StepClaim.objects.filter(operation=OuterRef("pk"), idempotency_key=term)
            found = queryset.filter(Q(key=term) | Exists(keyed))
        if not found.exists():  # a reference no step has: ask the provider
            lead = lead_from_provider(term)
            if lead is not None:
                self.message_user(request, lead.note, messages.WARNING)
                if lead.query is not None:
                    found = queryset.filter(lead.query)
        return found, False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        """The list, with a note saying what a number searched matched (an order, #17 an
        operation): the search box takes both."""
        extra = dict(extra_context or {})
        url = reverse("admin:payments_operation_changelist")
        extra["desk_search_note"] = operations_search_note(request.GET.get(SEARCH_VAR, ""), url)
        return super().changelist_view(request, extra)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # every write goes through the desk

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # --- columns and fields ----------------------------------------------------

    @admin.display(description="state", ordering="state")
    def badge(self, obj: Operation) -> str:
        stale = stale_badge(obj)
        if not stale:
            return state_badge(obj.state)
        return format_html("{} {}", state_badge(obj.state), stale)

    @admin.display(description="amount")
    def amount(self, obj: Operation) -> str:
        """What the operation moved (a capture's captured amount) once done, else what it asks."""
        if obj.state == OperationState.SUCCEEDED:
            moved = money_moved(obj, getattr(obj, "done_claims", None))
            if moved is not None:
                return format_money(*moved)
        return money_of(obj.params)

    @admin.display(description="what it does")
    def money(self, obj: Operation) -> str:
        """On the operation's page: its intent in its handler's words ("€6.00 refund of order
        3", "invoice of order 19 (€19.99) to the accounting system"): not always an amount."""
        return money_line(obj)

    @admin.display(description="in state for", ordering="state_since")
    def state_age(self, obj: Operation) -> str:
        since = getattr(obj, "state_since", None)
        if since is None or obj.state not in AGED_STATES:
            return "-"
        return timesince(since, timezone.now())

    @admin.display(description="attempts", ordering="all_attempts")
    def attempts_shown(self, obj: Operation) -> str:
        """Requests sent for the work; the reconciler's look-ups apart (they charge nothing)."""
        lookups = lookups_of(obj)
        if not lookups:
            return str(attempts_of(obj))
        return format_html(
            '{} <small class="quiet desk-lookups">+&nbsp;{}&nbsp;look-up{}</small>',
            attempts_of(obj),
            lookups,
            "" if lookups == 1 else "s",
        )

    @admin.display(description="last error")
    def last_error_shown(self, obj: Operation) -> str:
        if obj.last_error:
            return errors_shown(obj)
        if obj.state not in WAITING_FOR_A_PERSON:
            return "-"  # a resumed or finished operation: its last reason is no error
        seen = why_waiting([obj.pk]).get(obj.pk)
        if seen:  # the fence's last look, in the provider's words
            return seen
        reason = last_error_of(obj)
        if not reason:
            return "-"
        return format_html(
            '{} <small class="quiet">(no error recorded: the last audit row\'s reason)</small>',
            reason,
        )

    @admin.display(description="seen at its system")
    def provider_side(self, obj: Operation) -> str:
        table = provider_view_table(
            obj.claims.order_by("claimed_at", "pk"), obj.params, what=money_line(obj)
        )
        evidence = evidence_html(obj)
        if table or evidence:
            return format_html("{}{}", evidence, table)
        if obj.state in (OperationState.SUCCEEDED, OperationState.FAILED):
            return mark_safe('<span class="quiet">No lookup recorded.</span>')
        return format_html(
            '<span class="quiet">Not looked up yet: “{}” asks {}.</span>',
            query_title(obj),
            operation_label(obj),
        )

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: Operation) -> str:
        return when(obj.updated_at)

    @admin.display(description="created at", ordering="created_at")
    def created(self, obj: Operation) -> str:
        return when(obj.created_at)

    @admin.display(description="next attempt at")
    def next_attempt(self, obj: Operation) -> str:
        return when(obj.next_attempt_at)

    @admin.display(description="lease expires at")
    def lease_expires(self, obj: Operation) -> str:
        return when(obj.lease_expires_at)

    @admin.display(description="dispatched at")
    def dispatched(self, obj: Operation) -> str:
        return when(obj.dispatched_at)

    @admin.display(description="acts on", ordering="entity_id")
    def entity_link(self, obj: Operation) -> str:
        """The operation's entity in its handler's words: "Order 42", "Booking 7d1c…"."""
        return entity_link(obj, self.admin_site)

    @admin.display(description="tenant")
    def tenant_shown(self, obj: Operation) -> str:
        """Whose key it is: an API client by name ("shop-eu (client:3)"), the project's own
        tenant as written ("hotel:42"), "-" for none."""
        if not obj.tenant:
            return "-"
        client = ApiClient.of_tenant(obj.tenant)
        return obj.tenant if client is None else f"{client.name} ({obj.tenant})"

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
        """The declared desk actions (DESK_ACTIONS, in their order: the look-up first, the
        one that may lose money last), each enabled or with the reason it is not; an
        action on one step once per step waiting to be settled. No action is named here:
        each declares its permissions, its refusal and its title."""
        if not self.has_reconcile_permission(request):
            return []
        available = desk.available_actions(op)
        info = f"admin:{self.opts.app_label}_{self.opts.model_name}"
        return [
            _button(info, op, action, _refused(request, op, action, step, available), step)
            for action in DESK_ACTIONS.values()
            for step in (available.settleable_steps if action.per_step else [""])
        ]


def _refused(
    request: HttpRequest, op: Operation, action: DeskAction, step: str, available: Any
) -> str:
    """Why the button is off ("" when it may be pressed): a permission the user lacks, then
    what the operation's state refuses (desk.available_actions), then the action's own
    refusal (its `refusal`, the one its confirmation page answers 409 with)."""
    missing = [p for p in action.permissions if not request.user.has_perm(p)]
    if missing:
        return f"it needs the permission {missing[0]}"
    if available.refused_all:
        return str(available.refused_all)
    refused = available.refused.get(action.name, "")
    if not refused and action.refusal is not None:
        refused = action.refusal(op, step)
    return refused


def _button(
    info: str, op: Operation, action: DeskAction, refused: str, step: str = ""
) -> dict[str, Any]:
    if step:
        url = reverse(f"{info}_desk_step", args=[op.pk, step, action.name])
        label = action.title.replace("step", step)
    else:
        url = reverse(f"{info}_desk", args=[op.pk, action.name])
        label = action.title_for(op) if action.title_for is not None else action.title
    return {
        "action": action.name,
        "label": label,
        "url": url,
        "refused": refused,
        "danger": action.danger,
    }


class ReadOnlyAdmin(NamedPermissionsMixin, admin.ModelAdmin):
    """Browse only: the business rows are written by their services."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# --- API clients and their keys (djangorestframework-api-key's admin) ---------------


class ClientApiKeyInline(admin.TabularInline):
    model = ClientApiKey
    fields = ("prefix", "name", "created", "expiry_date", "revoked")
    readonly_fields = ("prefix", "name", "created")
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(ApiClient)
class ApiClientAdmin(admin.ModelAdmin):
    """A client of the JSON API; its keys are created, rotated and revoked under it."""

    list_display = ("name", "is_active", "created_at")
    search_fields = ("name",)
    inlines = [ClientApiKeyInline]


@admin.register(ClientApiKey)
class ClientApiKeyAdmin(APIKeyModelAdmin):
    """Create a key (shown once), or revoke one. Rotate: add a new key, then revoke the old."""

    # The package declares these as fixed-length tuples; ours are longer on purpose.
    list_display = (*APIKeyModelAdmin.list_display, "client")  # type: ignore[assignment]
    list_filter = ("client", "revoked", "created")  # type: ignore[assignment]
    search_fields = ("name", "prefix", "client__name")  # type: ignore[assignment]


# The package's own APIKey model is not used (keys belong to clients): keep it off the desk.
if admin.site.is_registered(APIKey):
    admin.site.unregister(APIKey)
