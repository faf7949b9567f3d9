"""Needs attention lists the cases to work, oldest first, a page at a time."""

from __future__ import annotations

import pytest
from django.urls import reverse

from payments.desk.views import attention
from tests.support import builders
from tests.support.users import VIEW, client_for, make_user

pytestmark = pytest.mark.django_db


def test_cases__paginated_oldest_first_with_links_to_the_next_page(provider, monkeypatch):
    monkeypatch.setattr(attention, "CASES_PER_PAGE", 1)
    builders.uncertain(key="first-stuck", charged=False)
    builders.uncertain(key="then-stuck", charged=False)
    client = client_for(make_user("vera", *VIEW))
    url = reverse("admin:payments_operation_needs_attention")

    one, two = client.get(url), client.get(url, {"page": 2})

    assert [r["operation"].key for r in one.context["cases"].rows] == ["first-stuck"]
    assert [r["operation"].key for r in two.context["cases"].rows] == ["then-stuck"]
    assert "Page 1 of 2" in one.content.decode() and 'href="?page=2"' in one.content.decode()
