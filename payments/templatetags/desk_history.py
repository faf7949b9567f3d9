"""Filters of the operation's History page: the desk's time format and an operator's words.

Django's History template (admin/object_history.html) shows its own date
format and the logged message as written; the desk's override of it
(payments/templates/admin/payments/operation/object_history.html) passes both through
these, so the History reads like the rest of the desk.
"""

from __future__ import annotations

from typing import Any

from django import template

from payments.desk.display import history_message, when
from payments.desk.views.actions import outcome_words

register = template.Library()


@register.filter
def desk_when(value: Any) -> str:
    """A time as the desk shows every time ("2026-11-30 20:41:10 UTC")."""
    return when(value)


@register.filter
def desk_words(message: Any) -> str:
    """A logged message with its codes in words (a look-up's outcome, a state's label)."""
    return history_message(str(message), outcome_words())
