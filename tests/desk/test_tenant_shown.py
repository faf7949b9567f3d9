"""An operation's page says whose key it is: an API client by name, a project's tenant."""

from __future__ import annotations

import re

import pytest
from django.db import transaction
from django.urls import reverse

from payments.fence import create_operation_in_tx
from payments.models import ApiClient, Operation
from tests.kit.deposits import TAKE_DEPOSIT
from tests.support.users import VIEW, client_for, make_user

pytestmark = pytest.mark.django_db


def deposit(key: str, tenant: str) -> Operation:
    with transaction.atomic():
        op, _ = create_operation_in_tx(
            key=key, kind=TAKE_DEPOSIT, entity_type="booking", entity_id="b-1",
            params={"amount": 5000}, actor="test", tenant=tenant,
        )  # fmt: skip
    return op


@pytest.mark.parametrize(
    "tenant, shown",
    [("hotel:42", "hotel:42"), ("", "-"), ("client", "client")],
)
def test_the_operation_page__shows_the_tenant_as_written(tenant, shown):
    op = deposit("booking-7", tenant)
    page = client_for(make_user("ann", *VIEW)).get(
        reverse("admin:payments_operation_change", args=[op.pk])
    )
    row = re.search(r"<label>Tenant:</label>\s*<div class=\"readonly\">(.*?)</div>", page.text)
    assert page.status_code == 200 and row is not None, page.text[:2000]
    assert row.group(1) == shown


def test_an_api_clients_operation__shows_the_client_by_name():
    shop = ApiClient.objects.create(name="shop-eu")
    op = deposit("booking-8", shop.tenant)
    page = client_for(make_user("ann", *VIEW)).get(
        reverse("admin:payments_operation_change", args=[op.pk])
    )
    assert f"shop-eu (client:{shop.pk})" in page.text
