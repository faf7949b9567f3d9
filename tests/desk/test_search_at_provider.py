"""Search by a provider reference no step has: the provider is asked, its metadata leads."""

from __future__ import annotations

import socket
import threading

import pytest

from payments.desk.views import search as search_view
from payments.models import StepClaim
from tests.support import builders, flows
from tests.support.users import VIEW, client_for, make_user

CHANGELIST = "/admin/payments/operation/"


def search(term: str) -> str:
    client = client_for(make_user("vera", *VIEW))
    return client.get(CHANGELIST, {"q": term}, follow=True).content.decode()


@pytest.mark.django_db
def test_search__a_lost_answer_s_reference_leads_to_its_operation(provider):
    op, claim, reference = builders.uncertain(key="lost-pi", charged=True)
    assert not StepClaim.objects.filter(provider_reference=reference).exists()

    page = search(reference)

    assert f"No step has {reference}" in page and "operation lost-pi" in page
    assert f'href="/admin/payments/operation/{op.pk}/change/' in page


# Transactional: the checkout runs in a real worker (a claim must commit before its call).
@pytest.mark.django_db(transaction=True)
def test_search__a_charge_outside_the_fence_leads_to_its_order_s_operations(provider, queue):
    order, _, duplicate = flows.charged_twice(queue)

    page = search(duplicate)

    assert f"No step has {duplicate}" in page and f"order {order.pk}" in page
    assert "twice-1" in page  # the order's checkout


@pytest.mark.django_db
def test_search__an_unknown_provider_id_says_the_provider_does_not_know_it(provider):
    page = search("pi_doesnotexist0000")
    assert "the provider does not know it" in page


@pytest.fixture
def silent_provider(settings):
    """A provider that accepts connections and never answers (a hung process behind its
    port: in an operator's incident walk a search then waited the client's 10 s)."""
    server = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody reads
    port = server.getsockname()[1]
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "PROVIDER_URL": f"http://127.0.0.1:{port}",
        "PROVIDER_READ_TIMEOUT": 3.0,  # the lookup left behind ends soon after the test
    }
    try:
        yield port
    finally:
        server.close()


@pytest.mark.django_db
def test_search__a_provider_that_never_answers__the_page_says_so_within_the_search_wait(
    silent_provider, monkeypatch
):
    # raising=False: the old page had no wait of its own (it failed on what it says)
    monkeypatch.setattr(search_view, "SEARCH_WAIT_SECONDS", 0.3, raising=False)

    page = search("pi_hungatthatmoment0")

    assert "No step has pi_hungatthatmoment0" in page
    assert "did not answer within 0.3 s" in page


@pytest.mark.django_db
def test_search__every_lookup_still_waiting__asks_nothing_and_says_so(provider, monkeypatch):
    """During an outage each search would queue one more retrieve behind the hung ones;
    with every place taken, the page asks nothing and says why, at once."""
    taken = threading.BoundedSemaphore(1)
    taken.acquire()
    monkeypatch.setattr(search_view, "_FREE", taken, raising=False)

    page = search("pi_behindthequeue000")

    assert "No step has pi_behindthequeue000" in page
    assert "was not asked: 4 earlier searches still wait for its answers" in page
