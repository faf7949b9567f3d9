"""The provider client's classification table, row by row, over real sockets.

Provider answers come from the fake provider (a real HTTP server) or, for
answers the fake never gives (403, broken bodies, resets), from a scripted raw
TCP server. Failures that cannot be produced on loopback (DNS, connect
timeout) are raised by a transport adapter with the exception chain requests
builds, so they still travel through the client's own request path.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import (
    ConnectTimeoutError,
    MaxRetryError,
    NameResolutionError,
    ProtocolError,
    ReadTimeoutError,
)

from devtools.fake_provider.server import FakeProviderServer
from payments.engine.outcomes import Outcome
from payments.provider.client import (
    PaymentIntent,
    ProviderClient,
    Refund,
    build_metadata_query,
    encode_form,
)
from payments.provider.errors import (
    CAPTURE_AMOUNT_TOO_LARGE,
    CHARGE_ALREADY_REFUNDED,
    PAYMENT_INTENT_NOT_REFUNDABLE,
    PAYMENT_INTENT_UNEXPECTED_STATE,
    REFUND_AMOUNT_TOO_LARGE,
    CardDeclined,
    IdempotencyConflict,
    InvalidRequest,
    ProviderError,
    ResourceMissing,
    TransientProviderError,
    UncertainProviderError,
)
from tests.support.provider import TEST_API_KEY, FakeClock, make_client

CARD = {"amount": 1000, "currency": "eur", "payment_method": "pm_card_visa"}
INTENT_JSON = {
    "id": "pi_scripted",
    "object": "payment_intent",
    "amount": 1000,
    "currency": "eur",
    "status": "succeeded",
    "metadata": {"step": "s1"},
    "created": 1_700_000_000,
}


def create(client: ProviderClient, key: str = "op:1:charge", **overrides: Any) -> PaymentIntent:
    args: dict[str, Any] = {**CARD, "metadata": {"step": key}, "idempotency_key": key}
    return client.create_payment_intent(**(args | overrides))


# --- a scripted raw TCP server for answers the fake never gives ----------------

Action = Callable[[socket.socket], None]


def respond(status: int, body: bytes | dict | None = None, headers: dict | None = None) -> Action:
    payload = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")

    def act(conn: socket.socket) -> None:
        lines = [f"HTTP/1.1 {status} Scripted", f"Content-Length: {len(payload)}"]
        lines += ["Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)

    return act


def hang_up(conn: socket.socket) -> None:
    """Read the request, then close without a byte of answer."""


def reset(conn: socket.socket) -> None:
    """Read the request, then abort the connection with a TCP RST."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def broken_chunked(conn: socket.socket) -> None:
    """Start a chunked 200 and close in the middle of a chunk."""
    conn.sendall(b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n20\r\n{"id": "pi_')


class ScriptedServer:
    """Accept connections on loopback; answer each with the next scripted action."""

    def __init__(self, *actions: Action, read_request: bool = True) -> None:
        self._actions = deque(actions)
        self._read_request = read_request
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(2)
                if self._read_request:
                    self.requests.append(_read_http_request(conn))
                    (self._actions.popleft() if self._actions else respond(500))(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


def _read_http_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(*actions: Action, read_request: bool = True) -> ScriptedServer:
        servers.append(ScriptedServer(*actions, read_request=read_request))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def scripted_client(server: ScriptedServer) -> ProviderClient:
    return ProviderClient(server.url, TEST_API_KEY, connect_timeout=1, read_timeout=1)


# --- the classification table over HTTP answers --------------------------------

ANSWER_TABLE = [
    # (status, body, headers, expected class, outcome)
    (
        402,
        {"error": {"type": "card_error", "code": "card_declined"}},
        {},
        CardDeclined,
        Outcome.PERMANENT,
    ),
    (400, {"error": {"type": "idempotency_error"}}, {}, IdempotencyConflict, Outcome.CONFLICT),
    (
        400,
        {"error": {"type": "invalid_request_error", "param": "amount"}},
        {},
        InvalidRequest,
        Outcome.PERMANENT,
    ),
    (
        404,
        {"error": {"type": "invalid_request_error", "code": "resource_missing"}},
        {},
        ResourceMissing,
        Outcome.PERMANENT,
    ),
    (404, b"not found", {}, InvalidRequest, Outcome.PERMANENT),
    (
        401,
        {"error": {"type": "invalid_request_error"}},
        {},
        TransientProviderError,
        Outcome.TRANSIENT,
    ),
    (
        403,
        {"error": {"type": "invalid_request_error"}},
        {},
        TransientProviderError,
        Outcome.TRANSIENT,
    ),
    (
        409,
        {"error": {"code": "idempotency_key_in_use"}},
        {},
        TransientProviderError,
        Outcome.TRANSIENT,
    ),
    (429, {"error": {"code": "rate_limit"}}, {}, TransientProviderError, Outcome.TRANSIENT),
    (400, {"error": {"code": "rate_limit"}}, {}, TransientProviderError, Outcome.TRANSIENT),
    (500, {"error": {"type": "api_error"}}, {}, UncertainProviderError, Outcome.UNCERTAIN),
    (502, b"<html>bad gateway</html>", {}, UncertainProviderError, Outcome.UNCERTAIN),
    (
        503,
        {"error": {"type": "api_error"}},
        {"Stripe-Should-Retry": "false"},
        UncertainProviderError,
        Outcome.UNCERTAIN,
    ),
    (
        500,
        {"error": {"type": "api_error"}},
        {"Stripe-Should-Retry": "true"},
        TransientProviderError,
        Outcome.TRANSIENT,
    ),
    (
        402,
        {"error": {"type": "card_error"}},
        {"Stripe-Should-Retry": "false"},
        CardDeclined,
        Outcome.PERMANENT,
    ),
    (
        400,
        {"error": {"type": "invalid_request_error"}},
        {"Stripe-Should-Retry": "false"},
        InvalidRequest,
        Outcome.PERMANENT,
    ),
    (200, b"{not json", {}, UncertainProviderError, Outcome.UNCERTAIN),
    (200, {"object": "list"}, {}, UncertainProviderError, Outcome.UNCERTAIN),
    (302, b"", {"Location": "/elsewhere"}, UncertainProviderError, Outcome.UNCERTAIN),
]


@pytest.mark.parametrize(("status", "body", "headers", "error_class", "outcome"), ANSWER_TABLE)
def test_answer__classified_by_table(scripted, status, body, headers, error_class, outcome):
    server = scripted(respond(status, body, {"Request-Id": "req_scripted", **headers}))
    with pytest.raises(error_class) as info:
        create(scripted_client(server))
    assert type(info.value) is error_class
    assert info.value.outcome is outcome
    assert info.value.http_status == status
    assert info.value.request_id == "req_scripted"
    assert server.connections == 1  # never retried on its own


def test_answer__replayed_header_marks_error(scripted):
    server = scripted(
        respond(500, {"error": {"type": "api_error"}}, {"Idempotent-Replayed": "true"})
    )
    with pytest.raises(UncertainProviderError) as info:
        create(scripted_client(server))
    assert info.value.replayed is True


def test_request__form_encoded_with_bearer_and_idempotency_key(scripted):
    server = scripted(respond(200, INTENT_JSON))
    intent = create(
        scripted_client(server), key="op:7:charge", metadata={"order": "7", "step": "charge"}
    )
    assert intent == PaymentIntent(
        "pi_scripted", "succeeded", 1000, "eur", {"step": "s1"}, 1_700_000_000
    )
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/payment_intents HTTP/1.1"
    assert f"Authorization: Bearer {TEST_API_KEY}" in lines
    assert "Idempotency-Key: op:7:charge" in lines
    assert "Content-Type: application/x-www-form-urlencoded" in lines
    assert body.decode().split("&") == [
        "amount=1000",
        "currency=eur",
        "confirm=true",
        "payment_method=pm_card_visa",
        "metadata%5Border%5D=7",
        "metadata%5Bstep%5D=charge",
    ]


# --- transport failures ----------------------------------------------------------


def test_connection_refused__transient():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    client = ProviderClient(
        f"http://127.0.0.1:{port}", TEST_API_KEY, connect_timeout=1, read_timeout=1
    )
    with pytest.raises(TransientProviderError) as info:
        create(client)
    assert info.value.outcome is Outcome.TRANSIENT
    assert isinstance(info.value.__cause__, requests.ConnectionError)


@pytest.mark.parametrize("action", [hang_up, reset, broken_chunked], ids=lambda a: a.__name__)
def test_connection_lost_after_send__uncertain(scripted, action):
    server = scripted(action)
    with pytest.raises(UncertainProviderError) as info:
        create(scripted_client(server))
    assert info.value.outcome is Outcome.UNCERTAIN
    assert info.value.__cause__ is not None
    assert len(server.requests) == 1 and server.connections == 1


def test_accepted_then_closed_before_reading__uncertain(scripted):
    server = scripted(read_request=False)
    with pytest.raises(UncertainProviderError):
        create(scripted_client(server))


class RaisingAdapter(HTTPAdapter):
    """Raise a prepared exception instead of sending, as urllib3 would have."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(max_retries=0)
        self.exc = exc

    def send(self, *args: Any, **kwargs: Any) -> requests.Response:
        raise self.exc


def _pool_error(reason: Exception) -> MaxRetryError:
    # No pool behind it: the classifier reads the exception's type only.
    return MaxRetryError(None, "/v1/payment_intents", reason)  # type: ignore[arg-type]


TRANSPORT_TABLE = [
    (
        requests.ConnectionError(
            _pool_error(
                # No connection behind it: the classifier reads the exception's type only.
                NameResolutionError("nowhere.invalid", None, socket.gaierror(-2, "x"))  # type: ignore[arg-type]
            )
        ),
        Outcome.TRANSIENT,
    ),
    (
        requests.exceptions.ConnectTimeout(_pool_error(ConnectTimeoutError(None, "timed out"))),
        Outcome.TRANSIENT,
    ),
    (requests.exceptions.MissingSchema("no scheme"), Outcome.TRANSIENT),
    (
        # No pool behind it: the classifier reads the exception's type only.
        requests.exceptions.ReadTimeout(ReadTimeoutError(None, "/", "read timed out")),  # type: ignore[arg-type]
        Outcome.UNCERTAIN,
    ),
    (
        requests.ConnectionError(
            ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))
        ),
        Outcome.UNCERTAIN,
    ),
    (
        requests.exceptions.ChunkedEncodingError(ProtocolError("Connection broken")),
        Outcome.UNCERTAIN,
    ),
]


@pytest.mark.parametrize(("exc", "outcome"), TRANSPORT_TABLE, ids=lambda v: type(v).__name__)
def test_transport_failure__classified_by_table(exc, outcome):
    session = requests.Session()
    session.mount("http://", RaisingAdapter(exc))
    client = ProviderClient(
        "http://provider.test", TEST_API_KEY, connect_timeout=1, read_timeout=1, session=session
    )
    with pytest.raises(ProviderError) as info:
        create(client)
    assert info.value.outcome is outcome
    assert info.value.__cause__ is exc


# --- the same rows against the real fake provider -------------------------------


def test_create__success_then_replay_is_marked(fake_provider):
    client = make_client(fake_provider)
    first = create(client)
    again = create(client)
    assert first.status == "succeeded" and first.replayed is False
    assert again.id == first.id and again.replayed is True
    assert fake_provider.state.succeeded_count() == 1


def test_decline__card_declined_with_intent_id(fake_provider):
    with pytest.raises(CardDeclined) as info:
        create(make_client(fake_provider), payment_method="pm_card_chargeDeclined")
    error = info.value
    assert (error.outcome, error.http_status, error.code) == (
        Outcome.PERMANENT,
        402,
        "card_declined",
    )
    assert error.decline_code == "generic_decline"
    assert error.request_id.startswith("req_")
    [intent] = fake_provider.state.intents()
    assert error.payment_intent_id == intent["id"]
    assert client_retrieve(fake_provider, intent["id"]).last_error_code == "card_declined"


def client_retrieve(server: FakeProviderServer, pi_id: str) -> PaymentIntent:
    return make_client(server).retrieve_payment_intent(pi_id)


def test_key_reuse_with_other_params__conflict(fake_provider):
    client = make_client(fake_provider)
    create(client)
    with pytest.raises(IdempotencyConflict) as info:
        create(client, amount=2000)
    assert info.value.outcome is Outcome.CONFLICT
    assert info.value.error_type == "idempotency_error"


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"amount": 0}, "amount"),
        ({"currency": "euro"}, "currency"),
        ({"payment_method": "pm_nope"}, "payment_method"),
    ],
)
def test_invalid_request__permanent_with_param(fake_provider, overrides, param):
    with pytest.raises(InvalidRequest) as info:
        create(make_client(fake_provider), **overrides)
    assert (info.value.outcome, info.value.http_status, info.value.param) == (
        Outcome.PERMANENT,
        400,
        param,
    )


def test_retrieve_unknown__resource_missing(fake_provider):
    with pytest.raises(ResourceMissing) as info:
        make_client(fake_provider).retrieve_payment_intent("pi_unknown")
    assert (info.value.outcome, info.value.http_status) == (Outcome.PERMANENT, 404)


def test_wrong_api_key__transient(fake_provider):
    fake_provider.state.configure(api_key="sk_test_right")
    with pytest.raises(TransientProviderError) as info:
        create(make_client(fake_provider, api_key="sk_test_wrong"))
    assert info.value.http_status == 401
    assert fake_provider.state.intents() == []


@pytest.mark.parametrize(
    ("mode", "error_class", "charges"),
    [
        ("rate_limit", TransientProviderError, 0),
        ("fail_before", TransientProviderError, 0),
        ("fail_after", UncertainProviderError, 1),
        ("drop_after_accept", UncertainProviderError, 1),
    ],
)
def test_fault__classified(fake_provider, mode, error_class, charges):
    fake_provider.state.enqueue_faults(mode)
    with pytest.raises(error_class):
        create(make_client(fake_provider))
    assert fake_provider.state.succeeded_count() == charges


def test_fail_after__replay_stays_uncertain_and_marked(fake_provider):
    fake_provider.state.enqueue_faults("fail_after")
    client = make_client(fake_provider)
    with pytest.raises(UncertainProviderError):
        create(client)
    with pytest.raises(UncertainProviderError) as info:
        create(client)
    assert info.value.replayed is True and info.value.http_status == 500


def test_retry_after_transient_or_drop__same_key_charges_once(fake_provider):
    fake_provider.state.enqueue_faults("fail_before")
    fake_provider.state.enqueue_faults("drop_after_accept")
    client = make_client(fake_provider)
    for expected in (TransientProviderError, UncertainProviderError):
        with pytest.raises(expected):
            create(client)
    assert create(client).replayed is True
    assert fake_provider.state.succeeded_count() == 1


def test_read_timeout__uncertain(fake_provider):
    fake_provider.state.configure(slow_delay=0.4)
    fake_provider.state.enqueue_faults("slow")
    with pytest.raises(UncertainProviderError) as info:
        create(make_client(fake_provider, read_timeout=0.1))
    assert isinstance(info.value.__cause__, requests.exceptions.ReadTimeout)
    assert fake_provider.state.wait_idle(timeout=2)
    assert fake_provider.state.succeeded_count() == 1


def test_same_key_in_flight__transient_409(fake_provider):
    fake_provider.state.configure(slow_delay=0.3)
    fake_provider.state.enqueue_faults("slow")
    first: list[PaymentIntent] = []
    worker = threading.Thread(target=lambda: first.append(create(make_client(fake_provider))))
    worker.start()
    assert fake_provider.state.wait_for_in_flight(1, timeout=2)
    with pytest.raises(TransientProviderError) as info:
        create(make_client(fake_provider))
    worker.join(timeout=3)
    assert (info.value.http_status, info.value.code) == (409, "idempotency_key_in_use")
    # The fake answers as Stripe does (409 + Stripe-Should-Retry: true): the
    # error must still say that the other request may succeed.
    assert info.value.in_flight is True
    assert create(make_client(fake_provider)).id == first[0].id


# --- refunds --------------------------------------------------------------------------

REFUND_JSON = {
    "id": "re_scripted",
    "object": "refund",
    "amount": 400,
    "currency": "eur",
    "payment_intent": "pi_scripted",
    "status": "succeeded",
    "reason": "requested_by_customer",
    "metadata": {"step": "refund"},
    "created": 1_700_000_100,
}


def refund(
    client: ProviderClient, pi_id: str, key: str = "op:1:refund", **overrides: Any
) -> Refund:
    args: dict[str, Any] = {
        "payment_intent": pi_id,
        "amount": None,
        "metadata": {"step": key},
        "idempotency_key": key,
    }
    return client.create_refund(**(args | overrides))


def test_refund_request__form_encoded_to_v1_refunds(scripted):
    server = scripted(respond(200, REFUND_JSON), respond(200, REFUND_JSON))
    client = scripted_client(server)
    made = refund(
        client, "pi_scripted", key="op:7:refund", amount=400, reason="requested_by_customer"
    )
    assert made == Refund(
        "re_scripted",
        400,
        "eur",
        "pi_scripted",
        "succeeded",
        "requested_by_customer",
        {"step": "refund"},
        1_700_000_100,
    )
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/refunds HTTP/1.1"
    assert "Idempotency-Key: op:7:refund" in lines
    assert body.decode().split("&") == [
        "payment_intent=pi_scripted",
        "amount=400",
        "reason=requested_by_customer",
        "metadata%5Bstep%5D=op%3A7%3Arefund",
    ]
    refund(client, "pi_scripted")  # amount None: the rest, so no amount and no reason sent
    assert server.requests[1].partition(b"\r\n\r\n")[2].decode().split("&") == [
        "payment_intent=pi_scripted",
        "metadata%5Bstep%5D=op%3A1%3Arefund",
    ]


@pytest.mark.parametrize(
    "body", [b"{not json", {"object": "refund", "id": "re_x"}, {**REFUND_JSON, "id": None}]
)
def test_refund_answer__unreadable_2xx_is_uncertain(scripted, body):
    server = scripted(respond(200, body))
    with pytest.raises(UncertainProviderError):
        refund(scripted_client(server), "pi_scripted")


def test_refund__partial_then_rest_and_replay_is_marked(fake_provider):
    client = make_client(fake_provider)
    pi = create(client)
    part = refund(client, pi.id, key="op:1:refund:a", amount=300, reason="duplicate")
    assert (part.amount, part.currency, part.payment_intent) == (300, "eur", pi.id)
    assert (part.status, part.reason, part.replayed) == ("succeeded", "duplicate", False)
    assert part.id.startswith("re_") and part.metadata == {"step": "op:1:refund:a"}
    again = refund(client, pi.id, key="op:1:refund:a", amount=300, reason="duplicate")
    assert again.id == part.id and again.replayed is True
    rest = refund(client, pi.id, key="op:1:refund:b")
    assert rest.amount == 700 and rest.reason is None
    assert client.retrieve_refund(rest.id) == rest
    assert len(fake_provider.state.refunds(payment_intent=pi.id)) == 2


@pytest.mark.parametrize(
    ("setup", "code"),
    [
        ("over", REFUND_AMOUNT_TOO_LARGE),
        ("full_twice", CHARGE_ALREADY_REFUNDED),
        ("declined", PAYMENT_INTENT_NOT_REFUNDABLE),
    ],
)
def test_refund_refusals__invalid_request_told_apart_by_code(fake_provider, setup, code):
    client = make_client(fake_provider)
    if setup == "declined":
        with pytest.raises(CardDeclined) as declined:
            create(client, payment_method="pm_card_chargeDeclined")
        pi_id = declined.value.payment_intent_id
    else:
        pi_id = create(client).id
    if setup == "full_twice":
        refund(client, pi_id, key="first")
    with pytest.raises(InvalidRequest) as info:
        refund(client, pi_id, amount=1001 if setup == "over" else None)
    error = info.value
    assert type(error) is InvalidRequest
    assert (error.outcome, error.http_status, error.code) == (Outcome.PERMANENT, 400, code)
    assert error.error_type == "invalid_request_error"
    assert code in str(error) and error.request_id.startswith("req_")
    # The refusal is stored for the key: the retry is the same refusal, marked.
    with pytest.raises(InvalidRequest) as replay:
        refund(client, pi_id, amount=1001 if setup == "over" else None)
    assert replay.value.code == code and replay.value.replayed is True


def test_refund_unknown_intent__invalid_request_resource_missing(fake_provider):
    with pytest.raises(InvalidRequest) as info:
        refund(make_client(fake_provider), "pi_unknown")
    assert (info.value.http_status, info.value.code, info.value.param) == (
        400,
        "resource_missing",
        "payment_intent",
    )
    assert info.value.outcome is Outcome.PERMANENT


def test_retrieve_refund_unknown__resource_missing(fake_provider):
    with pytest.raises(ResourceMissing) as info:
        make_client(fake_provider).retrieve_refund("re_unknown")
    assert (info.value.outcome, info.value.http_status) == (Outcome.PERMANENT, 404)


def test_refund_key_reuse_with_other_params__conflict(fake_provider):
    client = make_client(fake_provider)
    pi = create(client)
    refund(client, pi.id, amount=100)
    with pytest.raises(IdempotencyConflict) as info:
        refund(client, pi.id, amount=200)
    assert info.value.outcome is Outcome.CONFLICT


@pytest.mark.parametrize(
    ("mode", "error_class", "refunds"),
    [
        ("rate_limit", TransientProviderError, 0),
        ("fail_before", TransientProviderError, 0),
        ("fail_after", UncertainProviderError, 1),
        ("drop_after_accept", UncertainProviderError, 1),
    ],
)
def test_refund_fault__classified(fake_provider, mode, error_class, refunds):
    client = make_client(fake_provider)
    pi = create(client)
    fake_provider.state.enqueue_faults(mode)
    with pytest.raises(error_class):
        refund(client, pi.id)
    assert len(fake_provider.state.refunds()) == refunds


def test_refund_read_timeout__uncertain_then_replayed(fake_provider):
    pi = create(make_client(fake_provider))
    fake_provider.state.configure(slow_delay=0.4)
    fake_provider.state.enqueue_faults("slow")
    with pytest.raises(UncertainProviderError):
        refund(make_client(fake_provider, read_timeout=0.1), pi.id)
    assert fake_provider.state.wait_idle(timeout=2)
    assert refund(make_client(fake_provider), pi.id).replayed is True
    assert len(fake_provider.state.refunds()) == 1


def test_refund_same_key_in_flight__transient_409(fake_provider):
    pi = create(make_client(fake_provider))
    fake_provider.state.configure(slow_delay=0.3)
    fake_provider.state.enqueue_faults("slow")
    first: list[Refund] = []
    worker = threading.Thread(
        target=lambda: first.append(refund(make_client(fake_provider), pi.id))
    )
    worker.start()
    assert fake_provider.state.wait_for_in_flight(1, timeout=2)
    with pytest.raises(TransientProviderError) as info:
        refund(make_client(fake_provider), pi.id)
    worker.join(timeout=3)
    assert (info.value.http_status, info.value.in_flight) == (409, True)
    assert refund(make_client(fake_provider), pi.id).id == first[0].id


def test_list_refunds__follows_pages_newest_first_for_one_intent():
    clock = FakeClock()
    with FakeProviderServer(clock=clock) as server:
        client = make_client(server)
        pi = create(client, key="c1")
        other = create(client, key="c2")
        ids = []
        for n in range(5):
            ids.append(refund(client, pi.id, key=f"r{n}", amount=100).id)
            clock.advance(10)
        refund(client, other.id, key="other", amount=100)
        assert [r.id for r in client.list_refunds(payment_intent=pi.id, limit=2)] == ids[::-1]
        assert [r.payment_intent for r in client.list_refunds(payment_intent=other.id)] == [
            other.id
        ]
        assert list(client.list_refunds(payment_intent="pi_none")) == []


def test_refund_arguments__checked_before_sending():
    client = ProviderClient("http://127.0.0.1:9", TEST_API_KEY, connect_timeout=1, read_timeout=1)
    for bad in (
        {"payment_intent": ""},
        {"amount": "100"},
        {"amount": True},
        {"reason": "changed_my_mind"},
        {"idempotency_key": ""},
    ):
        with pytest.raises(ValueError):
            refund(client, "pi_x", **bad)
    for bad_id in ("", "re_a/../b"):
        with pytest.raises(ValueError):
            client.retrieve_refund(bad_id)
    with pytest.raises(ValueError):
        next(client.list_refunds(payment_intent="pi_x", limit=101))


def test_refund_logs__carry_ids_not_metadata(fake_provider, caplog):
    caplog.set_level(logging.DEBUG, logger="payments.provider")
    client = make_client(fake_provider)
    pi = create(client)
    made = refund(client, pi.id, key="op:log:refund", metadata={"email": "someone@example.com"})
    with pytest.raises(InvalidRequest):
        refund(client, pi.id, key="op:log:again")
    text = caplog.text
    assert f"pi={pi.id} refund={made.id}" in text and "op:log:refund" in text
    assert "status=400" in text
    for secret in (TEST_API_KEY, "someone@example.com"):
        assert secret not in text


# --- reads, helpers and hygiene ---------------------------------------------------


def test_search__escapes_quotes_and_finds_by_all_pairs(fake_provider):
    client = make_client(fake_provider)
    wanted = create(client, key="it's:1", metadata={"step": "it's", "op": "1"})
    create(client, key="it's:2", metadata={"step": "it's", "op": "2"})
    assert (
        build_metadata_query({"step": "it's", "op": "1"})
        == "metadata['step']:'it\\'s' AND metadata['op']:'1'"
    )
    assert [pi.id for pi in client.search_payment_intents({"step": "it's", "op": "1"})] == [
        wanted.id
    ]


def test_list__follows_pages_newest_first():
    clock = FakeClock()
    with FakeProviderServer(clock=clock) as server:
        client = make_client(server)
        ids = []
        for n in range(5):
            ids.append(create(client, key=f"k{n}").id)
            clock.advance(10)
        assert [pi.id for pi in client.list_payment_intents(limit=2)] == ids[::-1]
        since = int(clock.now) - 30
        assert [pi.id for pi in client.list_payment_intents(created_gte=since, limit=2)] == ids[
            :1:-1
        ]


def test_idempotency_key__length_limit():
    client = ProviderClient("http://127.0.0.1:9", TEST_API_KEY, connect_timeout=1, read_timeout=1)
    for bad in ("", "k" * 256, "line\nbreak"):
        with pytest.raises(ValueError):
            create(client, key=bad)


def test_idempotency_key__255_chars_accepted(fake_provider):
    assert create(make_client(fake_provider), key="k" * 255).status == "succeeded"


def test_encode_form__stripe_style():
    assert encode_form({"a": True, "b": False, "m": {"k": "v"}, "l": ["x"], "n": None, "i": 3}) == [
        ("a", "true"),
        ("b", "false"),
        ("m[k]", "v"),
        ("l[0]", "x"),
        ("i", "3"),
    ]


def test_client__mounts_adapters_without_retries():
    client = ProviderClient("http://x", TEST_API_KEY, connect_timeout=1, read_timeout=2)
    for prefix in ("http://", "https://"):
        assert client._session.get_adapter(prefix + "x").max_retries.total == 0
    assert TEST_API_KEY not in repr(client)


def test_from_settings__reads_payments_settings(settings):
    settings.PAYMENTS = {
        "PROVIDER_URL": "http://provider.example/",
        "PROVIDER_API_KEY": "sk_test_settings",
        "PROVIDER_CONNECT_TIMEOUT": 2,
        "PROVIDER_READ_TIMEOUT": 7,
    }
    client = ProviderClient.from_settings()
    assert (client.base_url, client.connect_timeout, client.read_timeout) == (
        "http://provider.example",
        2.0,
        7.0,
    )


def test_logs__never_carry_key_payment_method_or_bodies(fake_provider, caplog):
    caplog.set_level(logging.DEBUG, logger="payments.provider")
    client = make_client(fake_provider)
    create(client, key="op:log:charge", metadata={"email": "someone@example.com"})
    with pytest.raises(CardDeclined):
        create(client, key="op:log:2", payment_method="pm_card_chargeDeclined")
    text = caplog.text
    assert "op:log:charge" in text and "status=402" in text
    for secret in (TEST_API_KEY, "pm_card", "someone@example.com", "client_secret"):
        assert secret not in text


# --- confirm and cancel --------------------------------------------------------------


def declined(client: ProviderClient, key: str = "op:1:charge") -> str:
    """Create an intent whose first attempt was declined; return its id."""
    with pytest.raises(CardDeclined) as info:
        create(client, key=key, payment_method="pm_card_chargeDeclined")
    assert info.value.payment_intent_id is not None
    return info.value.payment_intent_id


def test_confirm__declined_intent_succeeds_with_a_good_card_and_replays(fake_provider):
    client = make_client(fake_provider)
    pi_id = declined(client)
    before = client.retrieve_payment_intent(pi_id)
    assert (before.status, before.payment_method) == ("requires_payment_method", None)
    assert before.last_error_payment_method == "pm_card_chargeDeclined"
    confirmed = client.confirm_payment_intent(
        pi_id, payment_method="pm_card_visa", idempotency_key="op:1:confirm"
    )
    assert (confirmed.id, confirmed.status, confirmed.replayed) == (pi_id, "succeeded", False)
    assert (confirmed.payment_method, confirmed.last_error_code) == ("pm_card_visa", None)
    again = client.confirm_payment_intent(
        pi_id, payment_method="pm_card_visa", idempotency_key="op:1:confirm"
    )
    assert again.replayed is True and again.status == "succeeded"
    assert fake_provider.state.succeeded_count() == 1


def test_confirm__decline_is_card_declined_with_intent_id_and_status(fake_provider):
    client = make_client(fake_provider)
    pi_id = declined(client)
    with pytest.raises(CardDeclined) as info:
        client.confirm_payment_intent(
            pi_id, payment_method="pm_card_chargeDeclinedInsufficientFunds", idempotency_key="c"
        )
    error = info.value
    assert (error.outcome, error.http_status, error.decline_code) == (
        Outcome.PERMANENT,
        402,
        "insufficient_funds",
    )
    assert (error.payment_intent_id, error.payment_intent_status) == (
        pi_id,
        "requires_payment_method",
    )
    assert error.as_dict()["payment_intent_status"] == "requires_payment_method"


def test_confirm__succeeded_intent_is_invalid_request_with_unexpected_state(fake_provider):
    client = make_client(fake_provider)
    pi = create(client)
    with pytest.raises(InvalidRequest) as info:
        client.confirm_payment_intent(
            pi.id, payment_method="pm_card_visa", idempotency_key="op:1:confirm"
        )
    error = info.value
    assert type(error) is InvalidRequest and error.outcome is Outcome.PERMANENT
    assert (error.http_status, error.code) == (400, PAYMENT_INTENT_UNEXPECTED_STATE)
    assert (error.payment_intent_id, error.payment_intent_status) == (pi.id, "succeeded")
    assert error.as_dict()["payment_intent_status"] == "succeeded"
    assert PAYMENT_INTENT_NOT_REFUNDABLE == PAYMENT_INTENT_UNEXPECTED_STATE


def test_confirm__unknown_intent_is_resource_missing(fake_provider):
    with pytest.raises(ResourceMissing):
        make_client(fake_provider).confirm_payment_intent(
            "pi_missing", payment_method="pm_card_visa", idempotency_key="k"
        )


def test_confirm_fault__fail_before_is_transient_then_the_same_key_charges_once(fake_provider):
    client = make_client(fake_provider)
    pi_id = declined(client)
    fake_provider.state.enqueue_faults("fail_before")
    with pytest.raises(TransientProviderError):
        client.confirm_payment_intent(pi_id, payment_method="pm_card_visa", idempotency_key="k")
    confirmed = client.confirm_payment_intent(
        pi_id, payment_method="pm_card_visa", idempotency_key="k"
    )
    assert confirmed.status == "succeeded" and fake_provider.state.succeeded_count() == 1


def test_cancel__declined_intent_is_canceled_then_refuses_cancel_and_confirm(fake_provider):
    client = make_client(fake_provider)
    pi_id = declined(client)
    canceled = client.cancel_payment_intent(
        pi_id, idempotency_key="op:1:cancel", cancellation_reason="abandoned"
    )
    assert (canceled.id, canceled.status) == (pi_id, "canceled")
    with pytest.raises(InvalidRequest) as again:
        client.cancel_payment_intent(pi_id)
    assert (again.value.code, again.value.payment_intent_status) == (
        PAYMENT_INTENT_UNEXPECTED_STATE,
        "canceled",
    )
    with pytest.raises(InvalidRequest) as confirm:
        client.confirm_payment_intent(pi_id, payment_method="pm_card_visa", idempotency_key="k")
    assert confirm.value.payment_intent_status == "canceled"
    assert fake_provider.state.succeeded_count() == 0


def test_cancel__succeeded_intent_is_invalid_request_with_its_status(fake_provider):
    client = make_client(fake_provider)
    pi = create(client)
    with pytest.raises(InvalidRequest) as info:
        client.cancel_payment_intent(pi.id, idempotency_key="op:1:cancel")
    assert (info.value.code, info.value.payment_intent_id, info.value.payment_intent_status) == (
        PAYMENT_INTENT_UNEXPECTED_STATE,
        pi.id,
        "succeeded",
    )


def test_confirm_and_cancel_requests__paths_forms_and_keys(scripted):
    server = scripted(
        respond(200, INTENT_JSON), respond(200, INTENT_JSON), respond(200, INTENT_JSON)
    )
    client = scripted_client(server)
    client.confirm_payment_intent(
        "pi_scripted", payment_method="pm_card_visa", idempotency_key="op:7:confirm"
    )
    client.cancel_payment_intent(
        "pi_scripted", idempotency_key="op:7:cancel", cancellation_reason="duplicate"
    )
    client.cancel_payment_intent("pi_scripted")
    sent = [request.partition(b"\r\n\r\n") for request in server.requests]
    heads = [head.decode().split("\r\n") for head, _, _ in sent]
    bodies = [body.decode() for _, _, body in sent]
    assert heads[0][0] == "POST /v1/payment_intents/pi_scripted/confirm HTTP/1.1"
    assert "Idempotency-Key: op:7:confirm" in heads[0]
    assert bodies[0] == "payment_method=pm_card_visa"
    assert heads[1][0] == "POST /v1/payment_intents/pi_scripted/cancel HTTP/1.1"
    assert "Idempotency-Key: op:7:cancel" in heads[1]
    assert bodies[1] == "cancellation_reason=duplicate"
    assert not any(line.startswith("Idempotency-Key") for line in heads[2]) and bodies[2] == ""


def test_confirm_and_cancel_arguments__checked_before_sending():
    client = ProviderClient("http://127.0.0.1:9", TEST_API_KEY, connect_timeout=1, read_timeout=1)
    for bad_id in ("", "pi_a/../b", "pi_a?x=1"):
        with pytest.raises(ValueError):
            client.confirm_payment_intent(
                bad_id, payment_method="pm_card_visa", idempotency_key="k"
            )
        with pytest.raises(ValueError):
            client.cancel_payment_intent(bad_id)
    with pytest.raises(ValueError):
        client.confirm_payment_intent("pi_x", payment_method="", idempotency_key="k")
    with pytest.raises(ValueError):
        client.confirm_payment_intent("pi_x", payment_method="pm_card_visa", idempotency_key="")
    with pytest.raises(ValueError):
        client.cancel_payment_intent("pi_x", cancellation_reason="bored")
    with pytest.raises(ValueError):
        client.cancel_payment_intent("pi_x", idempotency_key="k" * 256)


def test_intent_from_json__expanded_payment_methods_give_their_ids():
    intent = PaymentIntent.from_json(
        {
            **INTENT_JSON,
            "payment_method": {"id": "pm_expanded", "object": "payment_method"},
            "last_payment_error": {"code": "card_declined", "payment_method": "pm_declined"},
        }
    )
    assert (intent.payment_method, intent.last_error_payment_method) == (
        "pm_expanded",
        "pm_declined",
    )
    assert "pm_" not in repr(intent)  # payment methods stay out of logs and reprs


# --- lists: created windows, pages, refund failures -------------------------------------


def test_list__created_window_gte_and_lte(fake_provider):
    clock = FakeClock()
    with FakeProviderServer(clock=clock) as server:
        client = make_client(server)
        start = int(clock.now)
        ids = []
        for n in range(5):
            ids.append(create(client, key=f"k{n}").id)
            clock.advance(10)
        window = client.list_payment_intents(
            created_gte=start + 10, created_lte=start + 30, limit=1
        )
        assert [pi.id for pi in window] == ids[1:4][::-1]
        assert [pi.id for pi in client.list_payment_intents(created_lte=start + 10)] == ids[1::-1]
    with pytest.raises(ValueError):
        make_client(fake_provider).list_payment_intents(limit=0)


LIST_CASES = [
    ("/v1/payment_intents", INTENT_JSON, lambda c: c.list_payment_intents(limit=1), ""),
    (
        "/v1/refunds",
        REFUND_JSON,
        lambda c: c.list_refunds(payment_intent="pi_scripted", limit=1),
        "payment_intent=pi_scripted&",
    ),
    (
        "/v1/events",
        {"id": "evt_1", "object": "event", "type": "x", "created": 1, "data": {"object": {}}},
        lambda c: c.list_events(limit=1),
        "",
    ),
]


@pytest.mark.parametrize(("path", "item", "walk", "query"), LIST_CASES)
def test_lists__follow_starting_after_one_request_per_page(scripted, path, item, walk, query):
    first = {**item, "id": item["id"] + "_a"}
    second = {**item, "id": item["id"] + "_b"}
    server = scripted(
        respond(200, {"object": "list", "data": [first], "has_more": True}),
        respond(200, {"object": "list", "data": [second], "has_more": False}),
    )
    assert [obj.id for obj in walk(scripted_client(server))] == [first["id"], second["id"]]
    lines = [request.split(b"\r\n", 1)[0].decode() for request in server.requests]
    assert lines == [
        f"GET {path}?{query}limit=1 HTTP/1.1",
        f"GET {path}?{query}limit=1&starting_after={first['id']} HTTP/1.1",
    ]


def test_refund__failed_after_success_reads_failed_with_its_reason(fake_provider):
    client = make_client(fake_provider)
    pi = create(client)
    made = refund(client, pi.id, amount=400)
    assert (made.status, made.failure_reason) == ("succeeded", None)
    fake_provider.state.fail_refund(made.id, reason="expired_or_canceled_card")
    fetched = client.retrieve_refund(made.id)
    assert (fetched.status, fetched.failure_reason) == ("failed", "expired_or_canceled_card")
    [listed] = client.list_refunds(payment_intent=pi.id)
    assert listed.failure_reason == "expired_or_canceled_card"
    # The amount is back on the charge: the whole of it can be refunded now.
    assert refund(client, pi.id, key="op:2:refund").amount == 1000


def test_refund__pending_refund_reads_pending(fake_provider):
    fake_provider.state.configure(refund_status="pending")
    client = make_client(fake_provider)
    made = refund(client, create(client).id)
    assert (made.status, made.failure_reason) == ("pending", None)
    fake_provider.state.complete_refund(made.id)
    assert client.retrieve_refund(made.id).status == "succeeded"


# --- manual capture ------------------------------------------------------------------


def hold(client: ProviderClient, key: str = "op:1:charge") -> PaymentIntent:
    """Create a manual intent authorised by a good card; return it, asserted held."""
    intent = create(client, key=key, capture_method="manual")
    assert intent.status == "requires_capture"
    return intent


def test_create_manual__holds_the_amount_then_capture_takes_it_and_replays(fake_provider):
    client = make_client(fake_provider)
    held = hold(client)
    assert (held.capture_method, held.amount_capturable, held.amount_received) == (
        "manual",
        1000,
        0,
    )
    captured = client.capture_payment_intent(held.id, idempotency_key="op:1:capture")
    assert (captured.id, captured.status, captured.replayed) == (held.id, "succeeded", False)
    assert (captured.amount_received, captured.amount_capturable) == (1000, 0)
    again = client.capture_payment_intent(held.id, idempotency_key="op:1:capture")
    assert again.replayed is True and again.amount_received == 1000
    assert fake_provider.state.succeeded_count() == 1
    assert fake_provider.state.stats()["capture"]["replays"] == 1


def test_create_automatic__reads_received_and_nothing_capturable(fake_provider):
    paid = create(make_client(fake_provider))
    assert (paid.capture_method, paid.amount_received, paid.amount_capturable) == (
        "automatic",
        1000,
        0,
    )


def test_capture__partial_amount_with_metadata_merged(fake_provider):
    client = make_client(fake_provider)
    held = hold(client)
    captured = client.capture_payment_intent(
        held.id, idempotency_key="k", amount_to_capture=400, metadata={"shipped": "1"}
    )
    assert (captured.amount, captured.amount_received, captured.amount_capturable) == (
        1000,
        400,
        0,
    )
    assert captured.metadata == {"step": "op:1:charge", "shipped": "1"}


def test_capture__succeeded_intent_is_invalid_request_with_unexpected_state(fake_provider):
    client = make_client(fake_provider)
    paid = create(client)
    with pytest.raises(InvalidRequest) as info:
        client.capture_payment_intent(paid.id, idempotency_key="op:1:capture")
    error = info.value
    assert type(error) is InvalidRequest and error.outcome is Outcome.PERMANENT
    assert (error.http_status, error.code) == (400, PAYMENT_INTENT_UNEXPECTED_STATE)
    assert (error.payment_intent_id, error.payment_intent_status) == (paid.id, "succeeded")


def test_capture__more_than_held_is_invalid_request_too_large(fake_provider):
    client = make_client(fake_provider)
    held = hold(client)
    with pytest.raises(InvalidRequest) as info:
        client.capture_payment_intent(held.id, idempotency_key="k", amount_to_capture=1001)
    error = info.value
    assert type(error) is InvalidRequest and error.outcome is Outcome.PERMANENT
    assert (error.code, error.param) == (CAPTURE_AMOUNT_TOO_LARGE, "amount_to_capture")
    assert (error.payment_intent_id, error.payment_intent_status) == (held.id, "requires_capture")
    assert client.retrieve_payment_intent(held.id).amount_capturable == 1000


def test_capture__unknown_intent_is_resource_missing(fake_provider):
    with pytest.raises(ResourceMissing):
        make_client(fake_provider).capture_payment_intent("pi_missing", idempotency_key="k")


@pytest.mark.parametrize(
    ("mode", "error_class", "captures"),
    [
        ("rate_limit", TransientProviderError, 0),
        ("fail_before", TransientProviderError, 0),
        ("fail_after", UncertainProviderError, 1),
        ("drop_after_accept", UncertainProviderError, 1),
    ],
)
def test_capture_fault__classified_then_the_same_key_captures_once(
    fake_provider, mode, error_class, captures
):
    client = make_client(fake_provider)
    held = hold(client)
    fake_provider.state.enqueue_faults(mode)
    with pytest.raises(error_class):
        client.capture_payment_intent(held.id, idempotency_key="op:1:capture")
    assert fake_provider.state.succeeded_count() == captures
    if mode == "fail_after":
        # The stored 500 is replayed: still uncertain, marked as a replay.
        with pytest.raises(UncertainProviderError) as replay:
            client.capture_payment_intent(held.id, idempotency_key="op:1:capture")
        assert replay.value.replayed is True
    else:
        retried = client.capture_payment_intent(held.id, idempotency_key="op:1:capture")
        assert retried.status == "succeeded" and retried.replayed is (captures == 1)
    assert fake_provider.state.succeeded_count() == 1


def test_capture_read_timeout__uncertain(fake_provider):
    client = make_client(fake_provider, read_timeout=0.1)
    held = hold(client)
    fake_provider.state.configure(slow_delay=0.4)
    fake_provider.state.enqueue_faults("slow")
    with pytest.raises(UncertainProviderError) as info:
        client.capture_payment_intent(held.id, idempotency_key="op:1:capture")
    assert isinstance(info.value.__cause__, requests.exceptions.ReadTimeout)
    assert fake_provider.state.wait_idle(timeout=2)
    assert fake_provider.state.succeeded_count() == 1


def test_capture_and_manual_create_requests__paths_forms_and_keys(scripted):
    server = scripted(*(respond(200, INTENT_JSON) for _ in range(4)))
    client = scripted_client(server)
    create(client, key="op:7:charge", metadata={"step": "charge"}, capture_method="manual")
    create(client, key="op:8:charge", metadata={"step": "charge"}, capture_method="automatic")
    client.capture_payment_intent(
        "pi_scripted",
        idempotency_key="op:7:capture",
        amount_to_capture=600,
        metadata={"shipped": "1"},
    )
    client.capture_payment_intent("pi_scripted", idempotency_key="op:7:capture-all")
    sent = [request.partition(b"\r\n\r\n") for request in server.requests]
    heads = [head.decode().split("\r\n") for head, _, _ in sent]
    bodies = [body.decode() for _, _, body in sent]
    assert bodies[0].split("&") == [
        "amount=1000",
        "currency=eur",
        "confirm=true",
        "payment_method=pm_card_visa",
        "capture_method=manual",
        "metadata%5Bstep%5D=charge",
    ]
    # An automatic create is the request it always was: stored keys keep replaying.
    assert "capture_method" not in bodies[1]
    assert heads[2][0] == "POST /v1/payment_intents/pi_scripted/capture HTTP/1.1"
    assert "Idempotency-Key: op:7:capture" in heads[2]
    assert bodies[2] == "amount_to_capture=600&metadata%5Bshipped%5D=1"
    assert "Idempotency-Key: op:7:capture-all" in heads[3] and bodies[3] == ""


def test_capture_arguments__checked_before_sending():
    client = ProviderClient("http://127.0.0.1:9", TEST_API_KEY, connect_timeout=1, read_timeout=1)
    for bad_id in ("", "pi_a/../b", "pi_a?x=1"):
        with pytest.raises(ValueError):
            client.capture_payment_intent(bad_id, idempotency_key="k")
    with pytest.raises(ValueError):
        client.capture_payment_intent("pi_x", idempotency_key="")
    for bad_amount in (0, -1, True, 1.5, "100"):
        with pytest.raises(ValueError):
            client.capture_payment_intent("pi_x", idempotency_key="k", amount_to_capture=bad_amount)
    with pytest.raises(ValueError):
        create(client, capture_method="later")


def test_intent_from_json__reads_capture_fields_with_automatic_defaults():
    held = PaymentIntent.from_json(
        {
            **INTENT_JSON,
            "status": "requires_capture",
            "capture_method": "manual",
            "amount_capturable": 1000,
            "amount_received": 0,
        }
    )
    assert (held.capture_method, held.amount_capturable, held.amount_received) == (
        "manual",
        1000,
        0,
    )
    bare = PaymentIntent.from_json(INTENT_JSON)
    assert (bare.capture_method, bare.amount_capturable, bare.amount_received) == (
        "automatic",
        0,
        0,
    )
