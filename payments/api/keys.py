"""API clients and their keys: the service functions the management commands call.

The admin's "API clients" and "Client API keys" pages write the same rows; a
key is shown once, stored hashed (djangorestframework-api-key) with a visible
prefix, and refused at once when revoked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from django.db import transaction

from payments.exceptions import PaymentsError
from payments.models import ApiClient, ClientApiKey

MAX_CLIENT_NAME = 100  # ApiClient.name's max_length
MAX_KEY_NAME = 50  # ClientApiKey.name's max_length
BOOTSTRAP_CLIENT = "bootstrap"  # payments.api.base.BOOTSTRAP_CLIENT: API_TOKEN's client


class KeyRefused(PaymentsError):
    """A key could not be issued or revoked; nothing was written."""


@dataclass(frozen=True)
class IssuedKey:
    """A new key: its row, and the key itself (shown once, never stored)."""

    client: ApiClient
    client_created: bool
    row: ClientApiKey
    key: str


def issue_key(client_name: str, *, key_name: str = "") -> IssuedKey:
    """Create the client `client_name` if it does not exist, and a new key of it."""
    name = client_name.strip()
    if not name or len(name) > MAX_CLIENT_NAME:
        raise KeyRefused("A client name is 1-100 characters, not only spaces.")
    if name == BOOTSTRAP_CLIENT:
        raise KeyRefused(
            f"{BOOTSTRAP_CLIENT!r} is API_TOKEN's client (it reads every order without a "
            "client): it gets no keys. Create a client of its own for each caller."
        )
    if len(key_name) > MAX_KEY_NAME:
        raise KeyRefused(f"A key name is at most {MAX_KEY_NAME} characters.")
    key_name = key_name or f"{name[: MAX_KEY_NAME - len(' key')]} key"
    with transaction.atomic():
        client, created = ApiClient.objects.get_or_create(name=name)
        if not client.is_active:
            raise KeyRefused(f"Client {name!r} is inactive: activate it in the admin first.")
        row, key = ClientApiKey.objects.create_key(name=key_name, client=client)
    return IssuedKey(client, created, cast(ClientApiKey, row), key)


def revoke_key(prefix: str) -> tuple[ClientApiKey, bool]:
    """Revoke the key with visible prefix `prefix`; (key, whether it was revoked just now)."""
    with transaction.atomic():
        row = ClientApiKey.objects.select_for_update().filter(prefix=prefix).first()
        if row is None:
            raise KeyRefused(f"No API key has the prefix {prefix!r}.")
        if row.revoked:
            return row, False
        row.revoked = True
        row.save(update_fields=["revoked"])
    return row, True
