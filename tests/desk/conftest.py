"""Fixtures of the desk and admin tests: operators with their permissions."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from tests.support.users import NEW_ATTEMPT, RECONCILE, VIEW, make_user


@pytest.fixture
def viewer(db) -> User:
    return make_user("vera", *VIEW)


@pytest.fixture
def operator(db) -> User:
    return make_user("alice", *VIEW, RECONCILE)


@pytest.fixture
def senior(db) -> User:
    return make_user("sam", *VIEW, RECONCILE, NEW_ATTEMPT)
