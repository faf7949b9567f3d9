"""One desk action on one operation, and the bulk query: confirmation, service, log.

Each action follows django's `user_change_password`: explicit permission
checks, GET shows what will happen with the operation's steps and a reason
field, POST calls one service of `payments.desk.services` (which owns the transaction
and the audit row), then `log_change`, `message_user` and a redirect. A
refused action shows the form again with what was typed and why nothing
changed. Nothing here edits a row itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html, format_html_join
from django.utils.text import Truncator

from payments.conf import payments_settings
from payments.desk import services as desk
from payments.desk.display import (
    entity_link,
    money_line,
    provider_view_table,
    reference_link,
    state_badge,
    succeeded_at_provider,
    when,
)
from payments.desk.evidence import (
    QUERY_KINDS,
    SETTLED_OUTCOMES,
    after_query,
    evidence_html,
    incident,
    look_of,
    mark_failed_words,
    no_handler,
    operation_label,
    query_kind,
    query_tally,
    query_title,
    system_label,
    system_words,
)
from payments.desk.rules import declined_payment_method, settleable_claim
from payments.desk.views.base import DeskBase, operator_of
from payments.desk.views.queries import moneyless_kinds
from payments.engine import fence
from payments.engine.handlers import get_handler, registered_handlers
from payments.engine.steps import replay_allowed
from payments.exceptions import PaymentsError
from payments.models import (
    INCIDENT_LOOKS,
    UNSETTLED_CLAIM_STATES,
    LookShowed,
    Operation,
    OperationState,
    StepClaim,
)

# --- forms -----------------------------------------------------------------------


class ReasonForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        max_length=1000,
        help_text="Why you decide this (kept in the audit trail forever).",
    )


class QueryForm(forms.Form):
    """Querying the provider is not a judgement: no reason is asked."""


class NewAttemptForm(ReasonForm):
    """A new attempt's payment method: never the one the provider just declined by default.

    Left empty on the page. After a decline it is required, and the declined
    method is taken again only with "Charge the declined payment method again"
    ticked (the customer says it will work now); without a decline, blank keeps
    the method the attempt used. The service checks the same again.
    """

    payment_method = forms.CharField(
        max_length=255,
        required=False,
        label="Payment method",
        widget=forms.TextInput(attrs={"autocomplete": "off", "spellcheck": "false"}),
    )
    charge_declined_again = forms.BooleanField(
        required=False,
        label="Charge the declined payment method again",
        help_text="Only when the customer confirmed it will work now (their bank allows it).",
    )
    # The method first, then its confirmation (after a decline only), then why.
    field_order = ["payment_method", "charge_declined_again", "reason"]

    def __init__(self, *args: Any, operation: Operation | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        params = (operation.params or {}) if operation is not None else {}
        self.previous = str(params.get("payment_method") or "")
        self.declined = (
            declined_payment_method(
                operation, list(operation.claims.all()), get_handler(operation.kind)
            )
            if operation is not None
            else ""
        )
        field = self.fields["payment_method"]
        if self.declined:
            field.help_text = (
                f"The provider declined {self.declined} at this attempt: enter the payment "
                "method the customer authorised for the new one (pm_…). To charge "
                f"{self.declined} again, enter it and tick the box below."
            )
        else:
            del self.fields["charge_declined_again"]
            field.help_text = (
                f"The payment method the customer authorised (pm_…); blank: {self.previous}, "
                "as the last attempt (the provider did not decline it)."
            )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        method = (data.get("payment_method") or "").strip()
        data["payment_method"] = method
        if not self.declined or data.get("charge_declined_again"):
            return data
        if not method:
            self.add_error(
                "payment_method",
                f"The provider declined {self.declined}: enter the payment method the customer "
                "authorised for the new attempt.",
            )
        elif method == self.declined:
            self.add_error(
                "payment_method",
                f"The provider declined {method} at this attempt: enter another one, or tick "
                "“Charge the declined payment method again” if the customer confirmed it will "
                "work now.",
            )
        return data


class MarkSucceededForm(ReasonForm):
    reference = forms.CharField(
        max_length=255,
        label="Provider reference",
        # Wide enough for a whole `pi_…` id (27 characters at Stripe) and then some.
        widget=forms.TextInput(
            attrs={
                "class": "vTextField desk-reference",
                "size": 48,
                "style": "width: 48ch; max-width: 100%",
                "spellcheck": "false",
                "autocomplete": "off",
            }
        ),
        help_text="The step's id at the provider; it is checked before anything changes.",
    )

    field_order = ["reference", "reason"]


@dataclass(frozen=True)
class ActionDone:
    """An action that completed otherwise than asked (a step marked failed that the
    provider showed succeeded, recorded done): audited and shown as a warning."""

    message: str
    warning: bool = True


@dataclass(frozen=True)
class DeskAction:
    """One button of the desk: its confirmation page and the service it calls."""

    name: str
    title: str
    verb: str
    form: type[forms.Form]
    permissions: tuple[str, ...]
    run: Callable[[Operation, str, HttpRequest, dict[str, Any]], str | ActionDone]
    #: It acts on one step, named in its URL; the others act on the whole operation.
    per_step: bool = False
    #: Why the state refuses it outright for (operation, step), "" when it does not:
    #: checked on GET and POST before anything is asked, answered 409, and final
    #: (nothing typed would change it). None: only the state's general refusals apply
    #: (`desk.available_actions`), checked and answered the same way.
    refusal: Callable[[Operation, str], str] | None = None
    #: Its title for an operation, when the title depends on it (the system's name).
    title_for: Callable[[Operation], str] | None = None
    #: Its verb for an operation (the confirmation's "Yes, ..."), when it depends on it.
    verb_for: Callable[[Operation], str] | None = None
    #: The template saying what it will do, included under "What will happen" ("": none).
    explains: str = ""
    #: What its confirmation page says beyond every action's: (operation, step) -> context.
    page: Callable[[Operation, str], dict[str, Any]] | None = None
    #: The message's level once it ran, from the operation as it is then; by default a
    #: success, or a warning for an ActionDone that says so.
    level_after: Callable[[Operation], int] | None = None
    #: It may lose money if pressed wrongly: its button is drawn as a danger (red).
    danger: bool = False


def _nothing_to_ask(op: Operation, step: str) -> str:
    """Why there is nothing to look up: the operation's handler calls no external system."""
    spec = registered_handlers().get(op.kind)
    if spec is not None and not spec.effects:
        return "its steps call no external system that can be asked"
    if op.state in (OperationState.SUCCEEDED, OperationState.FAILED) and not any(
        c.state in UNSETTLED_CLAIM_STATES for c in op.claims.all()
    ):
        return (
            f"it {op.state} and no step of it waits to be settled: there is nothing to ask "
            f"{operation_label(op)} (each step's look-ups are on this page)"
        )
    return ""


def _run_query(op: Operation, step: str, request: HttpRequest, data: dict[str, Any]) -> ActionDone:
    report = desk.query_provider([op.pk], user=operator_of(request))
    row = report.rows[0] if report.rows else None
    asked = f"Queried {operation_label(op)}"
    if row is None:
        return ActionDone(f"{asked}: nothing to settle.")
    # Green only for a look-up that settled something (level_after reads the state then).
    words = query_words(row, operation_label(op))
    return ActionDone(f"{asked}: {words}.", warning=row.outcome not in SETTLED)


def _seen(row: Any) -> str:
    """What the look behind an unsettled query row saw, and the next look ("" when settled)."""
    return "" if row.outcome in SETTLED_OUTCOMES else after_query(row.operation_id)


#: What a look-up's outcome means, in an operator's words (payments.engine.recovery's names);
#: `{who}` is the system asked (`outcome_words`).
QUERY_WORDS = {
    "done": "{who} shows the step succeeded; it is recorded done",
    "failed": "{who} refused the step; it is recorded failed",
    "still_uncertain": "read: {who} shows nothing decisive yet; still waiting",
    "needs_review": "nothing decisive at {who} past the grace period: under review, "
    "the fence keeps looking",
    "nothing_to_settle": "nothing was waiting to be settled",
    "already_settled": "settled meanwhile by someone else",
    "retry_later": "not read: {who} did not answer",
    "busy": "not read: someone else holds the step now",
    "not_asked": "not asked: the time for this query ran out (the systems answer slowly); ask "
    "again, or let the reconciler, which keeps looking",
}


def outcome_words(who: str = "its system") -> dict[str, str]:
    """QUERY_WORDS with the system named (`who`: "Adyen"; a row with no system at hand,
    the History's or the desk log's, says "its system")."""
    return {code: words.format(who=who) for code, words in QUERY_WORDS.items()}


#: Outcomes that settled something: the only ones a success message (green ✓) may carry.
SETTLED = frozenset({"done", "failed", "reversed"})


def query_words(row: Any, who: str = "its system") -> str:
    """One look-up's result: what `who` (the system, "Adyen") showed, then the state it left
    (if it moved)."""
    words = QUERY_WORDS.get(row.outcome, row.outcome.replace("_", " ")).format(who=who)
    seen = _seen(row)
    if seen:
        words = f"{words} [{seen}]"
    if row.state_after == row.state_before:
        return f"{words} (state unchanged: {row.state_after.replace('_', ' ')})"
    after = row.state_after.replace("_", " ")
    runs = " (the operation runs its next steps)" if row.state_after in desk.WORKER_STATES else ""
    return f"{words}; now {after}{runs}"


def query_level(rows: list[Any]) -> int:
    """Success only when every look-up settled something; otherwise a warning."""
    return (
        messages.SUCCESS if rows and all(r.outcome in SETTLED for r in rows) else messages.WARNING
    )


def _run_resume(op: Operation, step: str, request: HttpRequest, data: dict[str, Any]) -> str:
    desk.resume(op, user=operator_of(request), reason=data["reason"])
    return f"Resumed with the same key: {data['reason']}"


def _run_mark_succeeded(op: Operation, step: str, request: HttpRequest, data: dict) -> str:
    ref = data["reference"]
    desk.mark_step_succeeded(
        op, step, reference=ref, user=operator_of(request), reason=data["reason"]
    )
    return f"Marked step {step} succeeded with {ref}: {data['reason']}"


def _run_mark_failed(
    op: Operation, step: str, request: HttpRequest, data: dict
) -> str | ActionDone:
    marked = desk.mark_step_failed(op, step, user=operator_of(request), reason=data["reason"])
    if marked.found_succeeded:  # done, otherwise than asked: say so, as a warning
        return ActionDone(f"Not marked failed: {marked.detail}")
    return f"Marked step {step} failed: {data['reason']}"


def _run_new_attempt(op: Operation, step: str, request: HttpRequest, data: dict) -> str:
    new = desk.start_new_attempt(
        op,
        user=operator_of(request),
        reason=data["reason"],
        payment_method=data.get("payment_method") or None,
        charge_declined_again=bool(data.get("charge_declined_again")),
    )
    return f"Started a new attempt {new.key}: {data['reason']}"


def _mark_failed_plan(op: Operation, step: str) -> dict[str, Any]:
    """What "mark failed" will do for this step, for its confirmation page to say."""
    claim = op.claims.filter(step=step).first()
    if claim is None:
        return {}
    request = claim.request or {}
    effect = get_handler(op.kind).effects.get(step)
    voids = str(getattr(effect, "VOIDS", ""))
    # The object the step works on (its effect's TARGET), voided first (an intent is
    # cancelled).
    item = str(getattr(effect, "TARGET", "") or "")
    # Else the object the last look found under the step's key (the press voids that one).
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    target = (
        claim.provider_reference
        or (str(request.get(item) or "") if item else "")
        or str(view.get("reference") or "")
    )
    return {
        # The provider showed it succeeded: the page offers "mark succeeded" with it instead.
        "provider_succeeded": succeeded_at_provider(claim),
        "may_have_happened": str(getattr(effect, "MAY_HAVE_HAPPENED", "")),
        "voids": voids,
        "void_target": target,
        "last_request_at": fence.last_request_at(claim),
        "grace_minutes": payments_settings().reconcile_grace // 60,
        "no_read": not system_words(claim).reads,
        "replay_first": op.state not in desk.WORKER_STATES
        and not claim.provider_reference
        and replay_allowed(claim),
    }


def _refusal(op: Operation, spec: DeskAction, step: str) -> str:
    """Say why the state forbids `spec` now ("" when it allows it); POST re-checks anyway."""
    available = desk.available_actions(op)
    if step:
        if step not in available.settleable_steps:
            return _not_settleable(op, step)
        return spec.refusal(op, step) if spec.refusal is not None else ""
    refused = available.refused.get(spec.name, "")
    return refused or (spec.refusal(op, "") if spec.refusal is not None else "")


def _not_settleable(op: Operation, step: str) -> str:
    """Why `step` cannot be settled now, in the rule's own words ("a worker holds step
    charge until 15:44"), as the service would refuse it."""
    try:
        settleable_claim(op, list(op.claims.all()), step, get_handler(op.kind))
    except PaymentsError as exc:
        return str(getattr(exc, "detail", exc))
    return f"step {step} is not waiting to be settled"  # it became settleable meanwhile


def asked_in_this_state(op: Operation, step: str) -> bool:
    """Tell whether the provider was asked about `step` since the operation entered its state."""
    claim = next((c for c in op.claims.all() if c.step == step), None)
    view = claim.provider_view if claim is not None else None
    checked = parse_datetime(str(view.get("checked_at") or "")) if isinstance(view, dict) else None
    since = getattr(op, "state_since", None) or op.updated_at
    return checked is not None and checked >= since


def mark_failed_refusal(op: Operation, step: str) -> str:
    """Why "mark failed" is off: the provider showed the step succeeded, or nobody asked it
    about the step in this state ("" when it may be pressed)."""
    claim = next((c for c in op.claims.all() if c.step == step), None)
    who = system_label(claim) if claim is not None else operation_label(op)
    reference = succeeded_at_provider(claim) if claim is not None else ""
    if reference:
        return (
            f"{who} showed step {step} succeeded ({reference}) at its last look-up: "
            "mark it succeeded with that reference instead"
        )
    look = look_of(claim) if claim is not None else None
    if look is not None and look.showed == LookShowed.IN_PROGRESS:
        # Its object exists and is neither done nor refused (a pending refund): asked, and
        # marking it failed could fail what still succeeds.
        detail = f": {Truncator(look.detail).chars(200)}" if look.detail else ""
        then = (
            f"The fence looks again at {when(look.next_look_at)} and settles it when {who} "
            "shows it done or refused"
            if look.next_look_at
            else f"The fence no longer looks ({look.hold or 'held'}): check {who}'s dashboard"
        )
        return (
            f"{who} showed step {step} still in progress at the last look "
            f"({when(look.last_look_at)}{detail}): it may still succeed. {then}"
        )
    if look is not None and look.in_flight_since is not None:
        # Refused as the press is (desk.mark_step_failed), whatever was asked since: the
        # request held there may still take the money.
        return (
            f"a request under step {step}'s key is in flight at {who} since "
            f"{when(look.in_flight_since)}: it may still succeed. The fence looks again at "
            f"{when(look.next_look_at)} and settles it when {who} answers"
        )
    if asked_in_this_state(op, step):
        return ""
    if claim is not None and look is not None and look.showed in INCIDENT_LOOKS:
        # Asking now would meet the same silence: say what is awaited, and until when.
        return (
            f"{who} has not given an answer about step {step} at the last look "
            f"({when(look.last_look_at)}: {Truncator(look.detail).chars(200) or look.get_showed_display()}); "
            f"the fence looks again at {when(look.next_look_at)} and settles it when "
            f"{who} answers. Marking it failed needs {who}'s answer first "
            f"({mark_failed_words(claim)})"
        )
    return (
        f"nobody has asked {system_label(claim) if claim else operation_label(op)} about "
        f"step {step} since the operation became {op.get_state_display().lower()}: "
        f"“{query_title(op)}” first"
    )


def action_title(spec: DeskAction, step: str, op: Operation) -> str:
    """The action as its button names it: "Mark refund succeeded" for step refund, "Query
    Adyen now" for an operation on Adyen."""
    if spec.title_for is not None:
        return spec.title_for(op)
    return spec.title.replace("step", step) if step else spec.title


def _form_for(spec: DeskAction, op: Operation, step: str, data: Any) -> forms.Form:
    """The action's form, worded for this operation's kind and step."""
    form_class = spec.form
    if form_class is NewAttemptForm:
        if "payment_method" in (op.params or {}):
            return NewAttemptForm(data, operation=op)
        form_class = ReasonForm  # this kind's attempts take no payment method (a refund)
    form = form_class(data, initial={"reference": _known_reference(op, step)} if step else None)
    if "reference" in form.fields:
        example = _reference_example(op, step)
        form.fields["reference"].help_text = (
            f"The id of step {step} at the provider{f' ({example})' if example else ''}; "
            "it is checked with the provider before anything changes."
        )
    return form


def _known_reference(op: Operation, step: str) -> str:
    """The step's reference as recorded or last seen at the provider ("" when none is known)."""
    claim = op.claims.filter(step=step).first()
    if claim is None:
        return ""
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    return claim.provider_reference or str(view.get("reference") or "")


def _reference_example(op: Operation, step: str) -> str:
    """What a reference of this kind's step looks like ("re_…"), from one already recorded."""
    known = (
        StepClaim.objects.filter(operation__kind=op.kind, step=step)
        .exclude(provider_reference="")
        .order_by("-pk")
        .values_list("provider_reference", flat=True)
        .first()
    )
    prefix, underscore, _ = (known or "").partition("_")
    return f"{prefix}_…" if underscore and prefix else ""


def _hook_says(hook: Callable[..., Any] | None) -> str:
    """What a handler's hook does, in its own words (the first sentence of its docstring)."""
    if hook is None:
        return ""
    doc = (hook.__doc__ or "").strip()
    first = doc.split(". ", 1)[0].splitlines()[0].strip().rstrip(".") if doc else ""
    return first or hook.__name__.replace("_", " ")


def _settled_level(op: Operation) -> int:
    """A look-up that settled nothing is no success: green only once the operation
    succeeded or runs again."""
    settled = op.state == OperationState.SUCCEEDED or op.state in desk.WORKER_STATES
    return messages.SUCCESS if settled else messages.WARNING


def _next_key(op: Operation, step: str) -> dict[str, Any]:
    """The new attempt's key, for its confirmation page to show, and the incident of the
    operation's system if there is one now (the press asks that system first)."""
    found = incident()
    system = operation_label(op)
    current = found is not None and (system in found.systems or not found.systems)
    return {"next_key": _next_key_or_blank(op), "incident": found if current else None}


def _next_key_or_blank(op: Operation) -> str:
    try:
        return desk.next_attempt_key(op)
    except desk.DeskError:
        return ""


def _query_report_message(rows: list[Any], summary: str) -> str:
    """The bulk query's result: the counts, then each operation with what came back, in the
    words of the system it asked."""
    ops = Operation.objects.in_bulk([row.operation_id for row in rows])
    asked = {pk: operation_label(op) for pk, op in ops.items()}

    def line(row: Any) -> tuple[str, str]:
        """The line's kind (QUERY_KINDS), and its words without the kind said twice."""
        kind = query_kind(row.outcome)
        words = query_words(row, asked.get(row.operation_id, "its system"))
        return kind, words.removeprefix(f"{QUERY_KINDS[kind].lower()}: ")

    items = format_html_join(
        "",
        '<li class="desk-query-row desk-query-{}"><strong>{}</strong>: <a href="{}">{}</a>: {} {}'
        "</li>",
        (
            (
                kind,
                QUERY_KINDS[kind],
                reverse("admin:payments_operation_change", args=[row.operation_id]),
                row.key,
                words,
                state_badge(row.state_after),
            )
            for row in rows
            for kind, words in [line(row)]
        ),
    )
    return format_html(
        'Queried their systems for {} operation(s): {}.<ul class="desk-query-report">{}</ul>',
        len(rows),
        query_tally([row.outcome for row in rows]),
        items,
    )


RECONCILE = ("payments.reconcile_operation",)


def _explains(name: str) -> str:
    return f"admin/payments/operation/desk_explains/{name}.html"


#: The desk's actions, in the order of their buttons on an operation's page: ordered by
#: safety, the look-up first, the one that may lose money (mark failed) last.
DESK_ACTIONS = {
    a.name: a
    for a in (
        DeskAction("query_provider", "Query provider now", "Query the provider", QueryForm,
                   RECONCILE, _run_query, level_after=_settled_level, title_for=query_title,
                   refusal=_nothing_to_ask, verb_for=lambda op: f"query {operation_label(op)}",
                   explains=_explains("query_provider")),
        DeskAction("resume", "Resume with the same key", "Resume", ReasonForm, RECONCILE,
                   _run_resume, explains=_explains("resume")),
        DeskAction("mark_succeeded", "Mark step succeeded", "Check and mark succeeded",
                   MarkSucceededForm, RECONCILE, _run_mark_succeeded, per_step=True,
                   explains=_explains("mark_succeeded")),
        DeskAction("new_attempt", "Start a new attempt", "Start a new attempt", NewAttemptForm,
                   (*RECONCILE, "payments.start_new_attempt"), _run_new_attempt,
                   page=_next_key, explains=_explains("new_attempt")),
        DeskAction("mark_failed", "Mark step failed", "Check and mark failed", ReasonForm,
                   RECONCILE, _run_mark_failed, per_step=True, refusal=mark_failed_refusal,
                   page=_mark_failed_plan, explains=_explains("mark_failed"), danger=True),
    )
}  # fmt: skip


class ActionViewsMixin(DeskBase):
    """The confirmation pages of the desk's buttons, and the changelist's bulk query."""

    # --- one action on one operation -------------------------------------------

    def desk_action_view(
        self, request: HttpRequest, object_id: str, action: str, step: str = ""
    ) -> HttpResponse:
        """GET: confirm what will happen; POST: do it through the desk, log, redirect."""
        spec = DESK_ACTIONS.get(action)
        if spec is None or spec.per_step != bool(step):
            raise Http404("no such desk action")
        self._check_permissions(request, spec.permissions)
        op = self.get_object(request, unquote(object_id))
        if op is None:
            raise Http404(f"operation {object_id!r} does not exist")
        change_url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[op.pk]
        )
        if op.kind not in registered_handlers():  # its page says so beside every button
            self.message_user(request, f"Nothing was changed: {no_handler(op)}.", messages.ERROR)
            return HttpResponseRedirect(change_url)
        form = _form_for(spec, op, step, request.POST if request.method == "POST" else None)
        status, refused_now = 200, ""
        # Refused by the server, not only by a greyed-out button: a direct GET or POST of
        # its page asks nothing of the provider, changes nothing and answers 409, whether
        # the action's own refusal or the state's says no (a resume, a new attempt
        # answered 200 where a refused mark-failed answered 409).
        refused = _refusal(op, spec, step)
        if refused:
            status = 409
            if request.method == "POST":
                form.is_valid()  # bound, so that the refusal shows beside what was typed
                form.add_error(None, f"Nothing was changed: {refused}")
        elif request.method == "POST" and form.is_valid():
            try:
                # The desk service owns the transaction (and keeps HTTP calls out of it).
                message = spec.run(op, step, request, form.cleaned_data)
            except PaymentsError as exc:
                # Refused: the same form again, with what was typed and why nothing changed.
                form.add_error(None, f"Nothing was changed: {getattr(exc, 'detail', exc)}")
                status = 409
                if spec.refusal is not None:  # nothing typed would change the answer
                    refused_now = str(getattr(exc, "detail", exc))
                op = self.get_object(request, unquote(object_id)) or op  # it may have moved
                # Asked again of the operation as it is now, not as it was before the press.
                refused = _refusal(op, spec, step) or refused_now
            else:
                done = message if isinstance(message, ActionDone) else ActionDone(message, False)
                self.log_change(request, op, done.message)
                level = messages.WARNING if done.warning else messages.SUCCESS
                if spec.level_after is not None and not done.warning:
                    op = self.get_object(request, unquote(object_id)) or op
                    level = spec.level_after(op)
                self.message_user(request, done.message, level)
                return HttpResponseRedirect(change_url)
        handler = get_handler(op.kind)
        context = {
            **self.admin_site.each_context(request),
            "title": f"{action_title(spec, step, op)}: {op.key}",
            "action_title": action_title(spec, step, op),
            "opts": self.opts,
            "original": op,
            "action": spec,
            "step": step,
            "form": form,
            # How the page words this operation: the handler's steps and money line,
            # never a checkout's (a refund is not a charge).
            "money_line": money_line(op),
            # What the line is: an amount only where a step's system moves money.
            "money_label": "What" if op.kind in moneyless_kinds() else "Amount",
            # In run order, as the handler declares them.
            "provider_steps": [s for s in handler.step_order if s in handler.effects],
            "other_steps": [s for s in handler.step_order if s in handler.steps],
            "on_failure": _hook_says(handler.on_failure),
            "on_resume": _hook_says(handler.on_resume),
            "asks_payment_method": isinstance(form, NewAttemptForm),
            "claims": [
                {
                    "claim": c,
                    "badge": state_badge(c.state),
                    "reference": reference_link(c.provider_reference),
                }
                for c in op.claims.order_by("claimed_at", "pk")
            ],
            "state_badge": state_badge(op.state),
            # The entity in its handler's words, linked when this operator may view it.
            "entity": entity_link(op, self.admin_site, request.user),
            # What the system showed, else the fence's looks (a system without reads shows
            # nothing: its looks and holds are what the operator has).
            "provider_view": provider_view_table(
                op.claims.order_by("claimed_at", "pk"), op.params, what=money_line(op)
            )
            or evidence_html(op),
            "mark_succeeded_url": reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_desk_step",
                args=[op.pk, step, "mark_succeeded"],
            )
            if step
            else "",
            **(spec.page(op, step) if spec.page is not None else {}),
            "system": operation_label(op),
            # The confirmation's words: "Yes, query Adyen", "Yes, resume".
            "verb": spec.verb_for(op) if spec.verb_for is not None else spec.verb.lower(),
            # Whether every system the operation's steps call offers a read.
            "system_reads": all(system_words(c).reads for c in op.claims.all()),
            "change_url": change_url,
            # A refused mark-failed keeps its button off: pressing again changes nothing.
            "refused": refused,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/payments/operation/desk_confirm.html", context, status=status
        )

    # --- the changelist bulk action ------------------------------------------------

    @admin.action(description="Query their systems now", permissions=["reconcile"])
    def query_selected(self, request: HttpRequest, queryset: QuerySet[Operation]):
        """Ask the provider about the selected operations, after a confirmation page."""
        if request.POST.get("post"):
            ops = list(queryset)
            try:
                report = desk.query_provider([op.pk for op in ops], user=operator_of(request))
            except PaymentsError as exc:
                self.message_user(request, f"Nothing was changed: {exc}", messages.ERROR)
                return None
            by_pk = {op.pk: op for op in ops}
            for row in report.rows:
                self.log_change(
                    request,
                    by_pk[row.operation_id],
                    f"Queried {operation_label(by_pk[row.operation_id])}: {row.outcome}",
                )
            self.message_user(
                request,
                _query_report_message(report.rows, report.summary()),
                query_level(report.rows),
            )
            return None  # back to the changelist
        context = {
            **self.admin_site.each_context(request),
            "title": "Query their systems now",
            "opts": self.opts,
            "queryset": queryset,
            "rows": [
                {
                    "op": op,
                    "badge": state_badge(op.state),
                    "amount": money_line(op),
                    "entity": entity_link(op, self.admin_site, request.user),
                }
                for op in queryset
            ],
            "action_checkbox_name": "_selected_action",
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/payments/operation/query_selected_confirmation.html", context
        )
