"""Refund an order from its page: the confirmation, then the refund handler's desk hook.

GET shows what will be refunded (a duplicate charge's whole amount filled in)
and asks a reason; POST calls `payments.desk.refund.refund_entity`, which
owns the permission check, the derived key and the audit row; then the
admin's log entry, a message and a redirect to the order's page.
"""

from __future__ import annotations

import re
import uuid
from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.core.validators import RegexValidator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html

from payments.desk import refund as desk_refund
from payments.desk.views.base import operator_of
from payments.desk.views.payment import Movement, entity_operations, money_summary, movements
from payments.exceptions import PaymentsError
from payments.models import OperationState
from payments.money import format_money, major_units

#: What an amount may look like: ASCII digits, an optional point and decimals.
PLAIN_AMOUNT = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,6})?", re.ASCII)
COMMA_REFUSED = "Type the amount with a point for decimals and no thousands separator, e.g. 12.50"


def amount_example(currency: str) -> str:
    """An amount as the currency writes it, for help texts: "49.99", "5000" for ¥, "49.999"."""
    unit = major_units(1, currency)
    return "5000" if unit == 1 else str(Decimal(50) - unit)


class RefundForm(forms.Form):
    amount = forms.CharField(
        max_length=32,
        label="Amount",
    )
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        max_length=1000,
        help_text="Why you refund (kept in the audit trail forever).",
    )
    charge = forms.CharField(max_length=255, required=False, widget=forms.HiddenInput)
    action_id = forms.CharField(max_length=32, widget=forms.HiddenInput)
    #: The newest refund operation of the order this page showed (0: none).
    seen = forms.IntegerField(min_value=0, widget=forms.HiddenInput)

    def __init__(
        self, *args: Any, currency: str, asked: list[desk_refund.AskedRefund], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.currency = currency
        self.asked = {a.operation.pk: a for a in asked}
        for name in list(self.data):  # an acknowledgement posted from a refusal page
            found = ACKNOWLEDGEMENT.fullmatch(name)
            if found and int(found.group(1)) in self.asked:
                self.acknowledge(self.asked[int(found.group(1))])
        self.fields["amount"].help_text = (
            f"In the order's currency, in its usual units ({amount_example(currency)}),"
            " with a point for decimals."
        )

    def clean_amount(self) -> int:
        """Minor units, from what was typed in major units ("49.99" -> 4999).

        Only ASCII digits with an optional point are read: a comma may be a
        decimal comma or a thousands separator, so it is refused rather than
        guessed; exponents, infinities, NaNs and other scripts' digits too.
        """
        typed = self.cleaned_data["amount"].strip()
        if "," in typed:
            raise forms.ValidationError(COMMA_REFUSED)
        if not PLAIN_AMOUNT.fullmatch(typed):
            raise forms.ValidationError(f"Type an amount such as {amount_example(self.currency)}.")
        unit = major_units(1, self.currency)  # one minor unit in major units (0.01, 1 for ¥)
        minor = Decimal(typed) / unit
        if minor != minor.to_integral_value() or minor <= 0:
            raise forms.ValidationError(f"Type a positive amount in steps of {unit}.")
        return int(minor)

    def clean_seen(self) -> int:
        seen = int(self.cleaned_data["seen"])
        if seen and seen not in self.asked:
            raise forms.ValidationError("This page is out of date: open it again.")
        return seen

    def acknowledge(self, asked: desk_refund.AskedRefund) -> None:
        """Ask the operator to tick that they saw `asked` (and only it) before refunding again.

        The field is named after the operation: a page rendered before it was
        asked has no such field, so a browser restoring a form cannot tick it.
        """
        for name in [n for n in self.fields if ACKNOWLEDGEMENT.fullmatch(n)]:
            del self.fields[name]
        pk = str(asked.operation.pk)
        self.fields[f"again_{pk}"] = forms.CharField(
            label=f"Refund again: I have seen {asked.line()}",
            widget=OperationCheckbox(pk),
            validators=[RegexValidator(f"^{pk}$", "Tick the box to refund again.")],
            error_messages={"required": "Tick the box to refund again, or go back."},
        )

    def newest_seen(self) -> int:
        """The newest refund the operator saw: the one acknowledged, else the page's."""
        acknowledged = [
            int(value)
            for name, value in self.cleaned_data.items()
            if ACKNOWLEDGEMENT.fullmatch(name)
        ]
        return max([self.cleaned_data["seen"], *acknowledged])


#: The name of a "Refund again" acknowledgement: the operation's id after it.
ACKNOWLEDGEMENT = re.compile(r"again_([0-9]{1,18})")


class OperationCheckbox(forms.CheckboxInput):
    """A checkbox that posts an operation's id, never ticked unless that id was posted.

    Django's CheckboxInput posts a boolean; here the value names what was seen.
    """

    def __init__(self, value: str) -> None:
        super().__init__(attrs={"value": value}, check_test=lambda posted: posted == value)

    def format_value(self, value: Any) -> str | None:
        return None  # the value attribute is the operation's, whatever was posted

    def value_from_datadict(self, data: Any, files: Any, name: str) -> Any:
        return data.get(name, "")


def refund_urls(admin: Any) -> list[URLPattern]:
    """The refund confirmation's URL, for the order admin's get_urls."""
    return [
        path(
            "<path:object_id>/refund/",
            admin.admin_site.admin_view(
                lambda request, object_id: refund_view(admin, request, object_id)
            ),
            name=f"{admin.opts.app_label}_{admin.opts.model_name}_refund",
        )
    ]


def refund_view(admin: Any, request: HttpRequest, object_id: str) -> HttpResponse:
    """GET: what will be refunded, the refunds asked already, a reason; POST: ask, log, redirect."""
    permission = desk_refund.refund_permission(admin.opts.model_name)
    may_view = f"{admin.opts.app_label}.{get_permission_codename('view', admin.opts)}"
    if not request.user.has_perm(may_view):
        raise PermissionDenied(may_view)
    if not request.user.has_perm(permission):
        raise PermissionDenied(permission)
    order = admin.get_object(request, unquote(object_id))
    if order is None:
        raise Http404(f"order {object_id!r} does not exist")
    ops = entity_operations("order", order.pk)
    rows = movements("order", order.pk, ops)
    charge = str(request.POST.get("charge") or request.GET.get("charge") or "")
    if any(m.what == "charge" and m.reference == charge and not m.duplicate for m in rows) or any(
        m.original and m.reference == charge for m in rows
    ):
        charge = ""  # the order's own charge: its ordinary refund
    duplicate = next(
        (m for m in rows if m.duplicate and not m.original and m.reference == charge), None
    )
    asked = desk_refund.refunds_asked("order", order.pk)
    change_url = reverse("admin:shop_order_change", args=[order.pk])
    initial = {
        "charge": charge,
        "action_id": uuid.uuid4().hex,
        "seen": asked[0].operation.pk if asked else 0,
    }
    if duplicate is not None and duplicate.amount is not None:  # give the duplicate back whole
        initial["amount"] = str(major_units(duplicate.amount, order.currency))
    data = request.POST.copy() if request.method == "POST" else None
    if data is not None:
        data["charge"] = charge
    form = RefundForm(data, initial=initial, currency=order.currency, asked=asked)
    status = 200
    if request.method == "POST" and form.is_valid():
        try:
            op, created = desk_refund.refund_entity(
                "order",
                order.pk,
                user=operator_of(request),
                amount=form.cleaned_data["amount"],
                reason=form.cleaned_data["reason"],
                action_id=form.cleaned_data["action_id"],
                seen=form.newest_seen(),
                charge=form.cleaned_data["charge"],
            )
        except desk_refund.UnseenRefund as exc:
            if duplicate is None and desk_refund.refund_refused("order", order.pk):
                # No tick could refund now: the page says why below, and offers none.
                form.add_error(None, f"Nothing was refunded: {exc.news}.")
            else:
                form.acknowledge(exc.asked)
                form.add_error(None, f"Nothing was refunded: {exc.detail}")
            asked = desk_refund.refunds_asked("order", order.pk)
            status = 409
        except PaymentsError as exc:
            form.add_error(None, f"Nothing was refunded: {getattr(exc, 'detail', exc)}")
            status = 409
        else:
            what = format_money(form.cleaned_data["amount"], order.currency)
            message = (
                f"Refund {op.key} of {what} asked: {form.cleaned_data['reason']}"
                if created
                else f"This page had already asked for refund {op.key}; nothing was asked twice."
            )
            admin.log_change(request, order, message)
            admin.message_user(request, message, messages.SUCCESS if created else messages.WARNING)
            return HttpResponseRedirect(change_url)
    context = {
        **admin.admin_site.each_context(request),
        "title": f"Refund order {order.pk}",
        "opts": admin.opts,
        "original": order,
        "form": form,
        "money": money_summary(order, rows),
        "asked": asked,
        "left": _left(order, duplicate, asked),
        "refused": "" if duplicate else desk_refund.refund_refused("order", order.pk),
        "duplicate": duplicate.row() if duplicate else None,
        "charge": charge,
        "change_url": change_url,
        "refund_kinds": desk_refund.refund_kinds(),
        "amount_label": format_html("Amount ({})", order.currency.upper()),
    }
    request.current_app = admin.admin_site.name
    return TemplateResponse(request, "admin/shop/order/refund_confirm.html", context, status=status)


def _left(order: Any, duplicate: Movement | None, asked: list[desk_refund.AskedRefund]) -> str:
    """What is left to refund of the charge this page refunds, refunds in flight counted."""
    if duplicate is None:
        left = desk_refund.refund_left("order", order.pk)
        return "-" if left is None else format_money(left, order.currency)
    if duplicate.amount is None:
        return "-"
    taken = sum(
        int(a.operation.params.get("amount") or 0)
        for a in asked
        if a.operation.state != OperationState.FAILED
        and desk_refund.refunded_payment(a.operation) == duplicate.reference
    )
    return format_money(max(duplicate.amount - taken, 0), order.currency)
