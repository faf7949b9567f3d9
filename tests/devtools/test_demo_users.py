"""`make run`'s demo users: an operator with exactly the manual's permissions, a senior with more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from devtools.management.commands.runstack import (
    OPERATOR_PERMISSIONS,
    SENIOR_PERMISSIONS,
    Command,
)

MANUAL = Path(__file__).resolve().parents[2] / "docs" / "operators.md"


@pytest.mark.django_db
def test_demo_users__operator_holds_exactly_what_the_manual_gives():
    passwords = Command()._demo_users()

    users = get_user_model().objects
    operator, senior = users.get(username="operator"), users.get(username="senior")
    assert set(passwords) == {"operator", "senior"}
    held = {p.codename for p in operator.user_permissions.all()}
    assert held == set(OPERATOR_PERMISSIONS)
    assert {p.codename for p in senior.user_permissions.all()} == set(SENIOR_PERMISSIONS)
    manual = MANUAL.read_text()
    operators = re.search(r"operators\.permissions\.set\(.*?codename__in=\[(.*?)\]", manual, re.S)
    assert set(re.findall(r'"(\w+)"', operators.group(1))) == held
    assert Command()._demo_users() == {}  # once
