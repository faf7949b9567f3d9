"""API fuzzing by tools that neither wrote the API nor know it.

Schemathesis reads the served OpenAPI schema and generates requests for every
operation (valid and invalid, its examples, its coverage cases), then chains
them statefully along the links it infers (an order created, then read,
checked out and refunded); every one of its checks runs on every answer, with
a fixed seed so that a failure replays. A schema-valid request refused, a
schema-invalid one accepted, a status or body the schema does not list, a 5xx:
each is a failure. Hypothesis then posts random bodies and headers: no 5xx,
and a 4xx writes nothing.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from django.core.cache import cache
from django.core.wsgi import get_wsgi_application
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig

from payments.models import Operation
from payments.shop.models import Order

TOKEN = "fuzz-token-that-is-long-enough-0123456789"
SEED = 28  # the issue that made every check run
#: Per operation: a few hundred requests in all (examples, coverage, fuzzing).
MAX_EXAMPLES = 250
#: Stateful chains of up to 6 calls each: every link is exercised by many of them.
CHAINS = 100

CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": SEED,
        "generation": {"max-examples": MAX_EXAMPLES, "mode": "all"},
        # The bootstrap client's key, as the schema's security scheme: schemathesis also
        # sends requests without it or with a wrong one, and checks they are refused.
        "auth": {"openapi": {"clientKey": {"bearer": TOKEN}}},
    }
)
schema = schemathesis.openapi.from_wsgi("/api/schema", get_wsgi_application(), config=CONFIG)


@pytest.fixture(autouse=True)
def _api_token(settings):  # noqa: PT004 - named for what it sets
    settings.API_TOKEN = TOKEN
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"client": "100000/min", "failed_auth": "100000/min"},
    }
    cache.clear()


@pytest.mark.django_db(transaction=True)  # the WSGI app commits like a server does
@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_api__schemathesis_every_check_finds_nothing(case):
    case.call_and_validate()


ApiWorkflow = schema.as_state_machine()


@pytest.mark.django_db(transaction=True)  # the WSGI app commits like a server does
def test_api__schemathesis_stateful_chains_find_nothing():
    ApiWorkflow.run(
        settings=settings(
            max_examples=CHAINS,
            stateful_step_count=6,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(
        st.sampled_from(["amount", "currency", "email", "payment_method", "x"]), json_values
    ).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
)
keys = st.none() | st.text(max_size=300)


@pytest.mark.django_db
@given(
    path=st.sampled_from(
        ["/api/orders", "/api/orders/1/checkout", "/api/orders/1/refunds", "/api/orders/x/refunds"]
    ),
    body=bodies,
    key=keys,
    content_type=st.sampled_from(
        ["application/json", "text/plain", "application/json; charset=latin-1", ""]
    ),
)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_api__random_bodies_and_headers_get_no_5xx_and_a_4xx_writes_nothing(
    path, body, key, content_type
):
    cache.clear()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if key is not None:
        try:
            key.encode("latin-1")
        except UnicodeEncodeError:
            key = key.encode("utf-8").decode("latin-1")  # what a raw header would carry
        headers["Idempotency-Key"] = key
    before = (Order.objects.count(), Operation.objects.count())
    response = Client(headers=headers).generic("POST", path, body, content_type=content_type)
    assert response.status_code < 500, response.content[:300]
    if 400 <= response.status_code < 500:
        assert response.json()["error"]["code"]
        assert (Order.objects.count(), Operation.objects.count()) == before
