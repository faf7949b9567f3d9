"""Operators with exactly the permissions a test names (the desk's fixtures build on these)."""

from __future__ import annotations

from django.contrib.auth.models import Permission, User
from django.test import Client

VIEW = ("payments.view_operation", "shop.view_order", "shop.view_invoice")
RECONCILE = "payments.reconcile_operation"
NEW_ATTEMPT = "payments.start_new_attempt"


def make_user(username: str, *perms: str, staff: bool = True) -> User:
    """A staff user holding exactly `perms` (app_label.codename)."""
    user = User.objects.create_user(username, password=f"pw-{username}-1x!", is_staff=staff)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return User.objects.get(pk=user.pk)  # a fresh instance: no stale permission cache


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client
