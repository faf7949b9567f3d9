"""Admin login lockout (django-axes): after AXES_FAILURE_LIMIT wrong passwords, the right
one is refused too until the cool-off has passed.

Issue 14: after 50 wrong admin passwords the right one logged in.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import F
from django.test import Client

from tests.support.users import make_user

pytestmark = pytest.mark.django_db

LOGIN = "/admin/login/?next=/admin/"


def login(client: Client, username: str, password: str):
    return client.post(LOGIN, {"username": username, "password": password})


def logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def test_lockout__after_the_failure_limit_the_right_password_is_refused_for_the_cool_off():
    make_user("ada")
    make_user("bob")
    right = "pw-ada-1x!"  # tests.support.users' password
    assert settings.AXES_ENABLED and 1 <= settings.AXES_FAILURE_LIMIT <= 10
    client = Client()

    for _ in range(settings.AXES_FAILURE_LIMIT):
        assert login(client, "ada", "wrong password").status_code in (200, 429)
        assert not logged_in(client)

    refused = login(client, "ada", right)
    assert refused.status_code == 429
    assert not logged_in(client)
    # The lockout is for this username from this address: another operator still logs in.
    other = Client()
    assert login(other, "bob", "pw-bob-1x!").status_code == 302
    assert logged_in(other)

    # The cool-off has passed: the right password works again (and resets the count).
    AccessAttempt.objects.update(
        attempt_time=F("attempt_time") - settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    )
    accepted = login(client, "ada", right)
    assert accepted.status_code == 302
    assert logged_in(client)


def test_lockout__settings_come_from_the_environment():
    # project/settings.py reads AXES_FAILURE_LIMIT and AXES_COOLOFF_MINUTES (defaults 5, 15).
    assert settings.AXES_COOLOFF_TIME >= timedelta(minutes=1)
    assert "axes.middleware.AxesMiddleware" == settings.MIDDLEWARE[-1]
    assert settings.AUTHENTICATION_BACKENDS[0] == "axes.backends.AxesStandaloneBackend"
