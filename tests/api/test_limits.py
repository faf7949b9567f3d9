"""The API's limits hold: atomic under concurrency (real Redis, real threads), and the
wrong-key limit counts the peer address, not what a client writes in X-Forwarded-For."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connection
from django.test import Client

from payments.models import ApiClient, ClientApiKey
from payments.shop.models import Order
from tests.support.config import TEST_REDIS_URL

TOKEN = "limits-token-that-is-long-enough-0123456789"


@pytest.fixture
def redis_limits(settings, redis_conn):
    """Count in the test Redis database (flushed around the test), as production does.

    The cache is pointed there too, so that the counting of the previous code (DRF's
    history in the cache) met the same real Redis.
    """
    settings.API_TOKEN = TOKEN
    settings.API_RATE_REDIS_URL = TEST_REDIS_URL
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": TEST_REDIS_URL,
        }
    }
    return redis_conn


def rates(settings, client: str = "600/min", failed_auth: str = "20/min") -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"client": client, "failed_auth": failed_auth},
    }


def at_once(count: int, request) -> Counter[int]:
    """Send `request(i)` from `count` threads released together; count the statuses."""
    ready = threading.Barrier(count)
    statuses: list[int] = []

    def send(i: int) -> None:
        try:
            ready.wait()
            statuses.append(request(i).status_code)
        finally:
            connection.close()  # each thread had its own connection

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Counter(statuses)


@pytest.mark.django_db(transaction=True)  # the threads' own connections must see the rows
def test_client_limit__60_concurrent_requests_at_30_per_minute_pass_at_most_30(
    settings, redis_limits
):
    # Every attempt holds a wrong-key count while its key is checked (taken back when it
    # is right): 60 at once from one address would meet that limit first.
    rates(settings, client="30/min", failed_auth="600/min")
    shop = ApiClient.objects.create(name="shop-a")
    _, key = ClientApiKey.objects.create_key(name="k", client=shop)
    order = Order.objects.create(amount=100, currency="eur", customer_email="a@x.io", client=shop)
    statuses = at_once(
        60,
        lambda _: Client(headers={"Authorization": f"Bearer {key}"}).get(f"/api/orders/{order.pk}"),
    )
    assert statuses[200] == 30, statuses
    assert statuses[429] == 30, statuses


@pytest.mark.django_db(transaction=True)  # the threads' own connections must see the rows
def test_wrong_key_limit__60_concurrent_wrong_keys_get_at_most_20_answers(settings, redis_limits):
    rates(settings)
    statuses = at_once(
        60, lambda _: Client(headers={"Authorization": "Bearer wrong"}).get("/api/orders/1")
    )
    assert statuses[401] <= 20 and statuses[429] >= 40, statuses


@pytest.mark.django_db
def test_wrong_key_limit__a_new_made_up_forwarded_for_each_time_does_not_escape_it(
    settings, redis_limits
):
    rates(settings)
    statuses = [
        Client(headers={"Authorization": "Bearer wrong", "X-Forwarded-For": f"10.9.{i}.1"})
        .get("/api/orders/1")
        .status_code
        for i in range(60)
    ]
    assert statuses[:20] == [401] * 20 and set(statuses[20:]) == {429}


@pytest.mark.django_db
def test_wrong_key_limit__naming_another_address_does_not_lock_that_address_out(
    settings, redis_limits
):
    rates(settings)
    attacker = Client(
        headers={"Authorization": "Bearer wrong", "X-Forwarded-For": "192.0.2.7"},
        REMOTE_ADDR="198.51.100.1",
    )
    assert {attacker.get("/api/orders/1").status_code for _ in range(25)} == {401, 429}
    victim = Client(headers={"Authorization": f"Bearer {TOKEN}"}, REMOTE_ADDR="192.0.2.7")
    assert victim.get("/api/orders/1").status_code == 404  # let in: the order is unknown


@pytest.mark.django_db
def test_wrong_key_limit__behind_a_trusted_proxy_counts_the_address_it_saw(settings, redis_limits):
    rates(settings)
    settings.API_TRUSTED_PROXIES = 1
    proxy = "10.0.0.1"  # every request arrives from the proxy

    def wrong_from(forwarded: str) -> int:
        return (
            Client(
                headers={"Authorization": "Bearer wrong", "X-Forwarded-For": forwarded},
                REMOTE_ADDR=proxy,
            )
            .get("/api/orders/1")
            .status_code
        )

    # A made-up entry left of the proxy's own is the client's text: still one address.
    assert [wrong_from(f"10.9.{i}.1, 203.0.113.5") for i in range(21)][-1] == 429
    # Another client behind the same proxy is counted apart.
    assert wrong_from("203.0.113.6") == 401


@pytest.mark.parametrize(
    ("proxies", "forwarded", "address"),
    [
        (0, "1.1.1.1", "10.0.0.1"),
        (1, "", "10.0.0.1"),
        (1, "1.1.1.1", "1.1.1.1"),
        (1, "6.6.6.6, 1.1.1.1", "1.1.1.1"),
        (2, "6.6.6.6, 1.1.1.1, 10.0.0.2", "1.1.1.1"),
        (3, "1.1.1.1, 10.0.0.2", "1.1.1.1"),
    ],
)
def test_client_address__is_the_right_most_entry_no_trusted_proxy_wrote(
    settings, rf, proxies, forwarded, address
):
    from payments.api.limits import client_address  # new in this change

    settings.API_TRUSTED_PROXIES = proxies
    request = rf.get("/", REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR=forwarded)
    assert client_address(request) == address


@pytest.mark.django_db(transaction=True)  # the threads' own connections must see the rows
def test_wrong_key_limit__60_concurrent_wrong_keys_get_at_most_20_lookups(
    settings, redis_limits, monkeypatch
):
    rates(settings)
    real = ClientApiKey.objects.get_from_key
    lookups: list[str] = []
    lock = threading.Lock()

    def counting(key: str):
        with lock:
            lookups.append(key)
        return real(key)

    monkeypatch.setattr(ClientApiKey.objects, "get_from_key", counting)
    statuses = at_once(
        60, lambda i: Client(headers={"Authorization": f"Bearer wrong{i}.x"}).get("/api/orders/1")
    )
    assert len(lookups) <= 20, (len(lookups), statuses)
    assert statuses[401] == len(lookups) and statuses[429] == 60 - len(lookups), statuses


@pytest.mark.django_db
def test_wrong_key_limit__right_keys_from_one_address_do_not_lock_it_out(settings, redis_limits):
    rates(settings, failed_auth="3/min")
    shop = ApiClient.objects.create(name="shop-a")
    _, key = ClientApiKey.objects.create_key(name="k", client=shop)
    right = Client(headers={"Authorization": f"Bearer {key}"})
    assert {right.get("/api/orders/999999").status_code for _ in range(10)} == {404}


@pytest.mark.django_db
def test_limits__redis_down_is_a_json_503_with_retry_after(settings, caplog):
    settings.API_TOKEN = TOKEN
    settings.API_RATE_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    answer = Client(
        headers={"Authorization": f"Bearer {TOKEN}"}, raise_request_exception=False
    ).get("/api/orders/1")
    assert answer.status_code == 503, answer.content
    assert answer.json()["error"]["code"] == "rate_limiter_unavailable"
    assert int(answer["Retry-After"]) > 0
    assert any(r.levelname == "WARNING" and "rate limiter" in r.message for r in caplog.records)


class FakeTime:
    """The clock `payments.api.limits` reads (`time.time()`), set by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.mark.django_db
def test_client_limit__30_before_and_30_after_a_window_boundary_pass_about_30(
    settings, redis_limits, monkeypatch
):
    rates(settings, client="30/min")
    shop = ApiClient.objects.create(name="shop-a")
    _, key = ClientApiKey.objects.create_key(name="k", client=shop)
    client = Client(headers={"Authorization": f"Bearer {key}"})
    boundary = 1_800_000_000 // 60 * 60 + 60
    clock = FakeTime(boundary - 0.1)
    monkeypatch.setattr("payments.api.limits.time", clock)
    statuses = [client.get("/api/orders/999999").status_code for _ in range(30)]
    clock.now = boundary + 0.1
    statuses += [client.get("/api/orders/999999").status_code for _ in range(30)]
    assert statuses[:30] == [404] * 30
    assert statuses.count(404) <= 31, Counter(statuses)


@pytest.mark.django_db
def test_wrong_key_limit__ipv6_addresses_of_one_64_count_as_one(settings, redis_limits):
    rates(settings)
    statuses = [
        Client(headers={"Authorization": "Bearer wrong"}, REMOTE_ADDR=f"2001:db8::{i:x}")
        .get("/api/orders/1")
        .status_code
        for i in range(30)
    ]
    assert statuses[:20] == [401] * 20 and set(statuses[20:]) == {429}


@pytest.mark.parametrize(
    ("proxies", "peer", "forwarded", "address"),
    [
        (0, "2001:db8:1:2:3:4:5:6", "", "2001:db8:1:2::/64"),
        (0, "::ffff:192.0.2.1", "", "192.0.2.1"),
        (1, "10.0.0.1", "2001:db8::1", "2001:db8::/64"),
        (1, "10.0.0.1", "not-an-address", "10.0.0.1"),
        (2, "10.0.0.1", "unknown, 10.0.0.2", "10.0.0.1"),
    ],
)
def test_client_address__ipv6_by_its_64_and_no_text_that_is_no_address(
    settings, rf, proxies, peer, forwarded, address
):
    from payments.api.limits import client_address

    settings.API_TRUSTED_PROXIES = proxies
    request = rf.get("/", REMOTE_ADDR=peer, HTTP_X_FORWARDED_FOR=forwarded)
    assert client_address(request) == address


@pytest.mark.django_db
def test_wrong_key_limit__retrying_while_locked_out_does_not_keep_the_address_out(
    settings, redis_limits, monkeypatch
):
    rates(settings)
    start = 1_800_000_000 // 60 * 60 + 1
    clock = FakeTime(start)
    monkeypatch.setattr("payments.api.limits.time", clock)
    wrong = Client(headers={"Authorization": "Bearer wrong"})
    assert {wrong.get("/api/orders/1").status_code for _ in range(20)} == {401}
    right = Client(headers={"Authorization": f"Bearer {TOKEN}"})
    statuses = []
    for second in range(60, 120):  # once a second through the next window
        clock.now = start + second
        statuses.append(right.get("/api/orders/999999").status_code)
    assert statuses[0] == 429 and 404 in statuses, Counter(statuses)
