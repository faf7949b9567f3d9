"""Clients and keys from the command line: `create_api_client` and `revoke_api_key`."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from payments.models import ApiClient, ClientApiKey

pytestmark = pytest.mark.django_db


def run(*args: str, **options) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


def accepted(key: str) -> bool:
    """Whether the API lets `key` in (an unknown order is 404 for a known caller)."""
    return (
        Client(headers={"Authorization": f"Bearer {key}"}).get("/api/orders/1").status_code == 404
    )


def test_create_api_client__makes_the_client_and_prints_the_key_alone_last():
    out = run("create_api_client", "shop-a")
    key = out.strip().splitlines()[-1]
    assert ApiClient.objects.filter(name="shop-a", is_active=True).exists()
    assert ClientApiKey.objects.get_from_key(key).client.name == "shop-a"
    assert accepted(key)


def test_create_api_client__again_adds_a_key_to_the_same_client():
    first = run("create_api_client", "shop-a").strip().splitlines()[-1]
    out = run("create_api_client", "shop-a", "--key-name", "rotation 2")
    second = out.strip().splitlines()[-1]
    assert first != second and accepted(first) and accepted(second)
    assert ApiClient.objects.filter(name="shop-a").count() == 1
    assert "already exists" in out
    assert ClientApiKey.objects.get_from_key(second).name == "rotation 2"


def test_create_api_client__refuses_an_inactive_client_and_a_bad_name():
    ApiClient.objects.create(name="old-shop", is_active=False)
    with pytest.raises(CommandError, match="inactive"):
        run("create_api_client", "old-shop")
    with pytest.raises(CommandError, match="name"):
        run("create_api_client", " ")
    assert not ClientApiKey.objects.exists()


def test_revoke_api_key__refuses_the_key_at_once():
    key = run("create_api_client", "shop-a").strip().splitlines()[-1]
    prefix = key.split(".")[0]
    out = run("revoke_api_key", prefix, "--noinput")
    assert "Revoked" in out and prefix in out
    assert not accepted(key)
    assert "already revoked" in run("revoke_api_key", prefix, "--noinput")


def test_revoke_api_key__an_unknown_prefix_is_an_error():
    with pytest.raises(CommandError, match="No API key"):
        run("revoke_api_key", "nope", "--noinput")


def test_create_api_client__a_long_name_gets_a_shortened_key_name():
    name = "s" * 60  # "<name> key" would not fit ClientApiKey.name (50)
    key = run("create_api_client", name).strip().splitlines()[-1]
    row = ClientApiKey.objects.get(prefix=key.partition(".")[0])
    assert row.client.name == name and row.name == "s" * 46 + " key"


def test_create_api_client__a_key_name_over_50_is_an_error_and_writes_nothing():
    with pytest.raises(CommandError, match="at most 50"):
        run("create_api_client", "shop", "--key-name", "k" * 51)
    assert not ApiClient.objects.filter(name="shop").exists()


def test_create_api_client__refuses_the_bootstrap_client():
    with pytest.raises(CommandError, match="API_TOKEN"):
        run("create_api_client", "bootstrap")
    assert not ClientApiKey.objects.exists()


def test_revoke_api_key__no_answer_on_a_closed_stdin_is_no(monkeypatch):
    _, key = ClientApiKey.objects.create_key(name="k", client=ApiClient.objects.create(name="shop"))

    def closed(prompt: str) -> str:
        raise EOFError

    monkeypatch.setattr("builtins.input", closed)
    with pytest.raises(CommandError, match="Aborted"):
        run("revoke_api_key", key.partition(".")[0])
    assert accepted(key)
