"""One provider session per process: kept-alive connections, their limits, and stale sockets.

Everything runs over real sockets: the fake provider (plain HTTP and TLS) and,
for what the fake never does (reset a kept-alive connection at a chosen
moment), a raw keep-alive server scripted connection by connection. No test
asserts a duration: reuse is shown by counting the connections the server
accepted.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_provider.server import FakeProviderServer
from payments.engine.outcomes import Outcome
from payments.provider import client as client_module
from payments.provider.client import (
    POOL_MAXSIZE,
    PaymentIntent,
    ProviderClient,
    close_shared_session,
    shared_session,
)
from payments.provider.errors import TransientProviderError, UncertainProviderError
from tests.support.provider import TEST_API_KEY

INTENT_JSON = {
    "id": "pi_kept_alive",
    "object": "payment_intent",
    "amount": 1000,
    "currency": "eur",
    "status": "succeeded",
    "metadata": {},
    "created": 1_700_000_000,
}


@pytest.fixture(autouse=True)
def fresh_shared_session() -> Iterator[None]:
    """Each test starts and ends without a shared session (no socket of another test)."""
    close_shared_session()
    yield
    close_shared_session()


def shared_client(url: str) -> ProviderClient:
    return ProviderClient(url, TEST_API_KEY, connect_timeout=1, read_timeout=2, shared=True)


def charge(client: ProviderClient, key: str) -> PaymentIntent:
    return client.create_payment_intent(
        amount=1000,
        currency="eur",
        payment_method="pm_card_visa",
        metadata={"step": key},
        idempotency_key=key,
    )


def count_accepts(server: FakeProviderServer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the TCP connections the fake provider accepts from now on."""
    accepted: list[int] = []
    httpd = server._httpd
    original = httpd.get_request

    def get_request() -> Any:
        request = original()
        accepted.append(1)
        return request

    monkeypatch.setattr(httpd, "get_request", get_request)
    return accepted


# --- reuse, pool, idle age, fork ----------------------------------------------------


def test_from_settings__clients_share_one_session_and_one_kept_alive_connection(
    provider, monkeypatch
):
    accepted = count_accepts(provider, monkeypatch)
    first, second = ProviderClient.from_settings(), ProviderClient.from_settings()
    assert first._session is second._session is shared_session()
    for i in range(3):
        charge(first, f"reuse-a-{i}")
        charge(second, f"reuse-b-{i}")
    first.close()  # leaves the shared session open for the other clients
    charge(second, "reuse-after-close")
    assert len(accepted) == 1


def test_a_client_of_its_own__new_connection_per_client(provider, monkeypatch):
    accepted = count_accepts(provider, monkeypatch)
    for i in range(3):
        with ProviderClient(provider.url, TEST_API_KEY, connect_timeout=1, read_timeout=2) as c:
            charge(c, f"own-{i}")
    assert len(accepted) == 3


def test_shared_session__bounded_pool_and_no_automatic_retries():
    session = shared_session()
    for prefix in ("http://", "https://"):
        adapter = session.get_adapter(prefix + "provider.test")
        assert adapter.max_retries.total == 0
        assert adapter._pool_maxsize == POOL_MAXSIZE
        assert adapter._pool_block is False


def test_idle_session__closed_and_rebuilt_before_its_next_request(provider, monkeypatch):
    accepted = count_accepts(provider, monkeypatch)
    client = ProviderClient.from_settings()
    charge(client, "idle-1")
    charge(client, "idle-2")  # within the idle age: same connection
    before = shared_session()
    monkeypatch.setattr(client_module, "MAX_IDLE_SECONDS", 0.01)
    time.sleep(0.05)
    charge(client, "idle-3")  # idle too long: a new session, a new connection
    assert shared_session() is not before
    assert len(accepted) == 2


def test_after_fork__the_child_builds_its_own_session(provider):
    client = ProviderClient.from_settings()
    charge(client, "fork-parent")
    parent_session = shared_session()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            child = ProviderClient.from_settings()
            charge(child, "fork-child")
            verdict = {"own_session": shared_session() is not parent_session}
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            verdict = {"error": repr(exc)}
        os.write(write_end, json.dumps(verdict).encode())
        os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    verdict = json.loads(os.read(read_end, 4096))
    os.close(read_end)
    assert status == 0
    assert verdict == {"own_session": True}
    charge(client, "fork-parent-again")  # the parent's session is untouched
    assert shared_session() is parent_session
    assert provider.state.succeeded_count(metadata={"step": "fork-child"}) == 1


def test_pid_key__a_session_made_in_another_process_is_never_used(monkeypatch):
    session = shared_session()
    holder = client_module._process_session
    assert holder is not None
    monkeypatch.setattr(holder, "pid", holder.pid + 1)  # as if inherited from a parent
    assert shared_session() is not session


def test_tls__kept_alive_over_https_with_the_ca_from_requests_ca_bundle(
    tmp_path: Path, monkeypatch
):
    with FakeProviderServer(tls=True) as server:
        assert server.url.startswith("https://")
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(server.write_ca(tmp_path / "ca.pem")))
        accepted = count_accepts(server, monkeypatch)
        client = shared_client(server.url)
        for i in range(3):
            assert charge(client, f"tls-{i}").status == "succeeded"
        assert len(accepted) == 1


# --- stale kept-alive sockets, classified by whether the request may have been sent ---

Script = Callable[[socket.socket, "KeepAliveServer"], None]


class KeepAliveServer:
    """A raw HTTP/1.1 keep-alive server: the n-th accepted connection runs the n-th script."""

    def __init__(self, *scripts: Script) -> None:
        self._scripts = list(scripts)
        self.requests: list[tuple[int, bytes]] = []  # (connection number, request)
        self.connections = 0
        self.reset_done = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and self._scripts:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2)
            self._scripts.pop(0)(conn, self)

    def read_request(self, conn: socket.socket) -> bytes:
        """Read one whole request (head and Content-Length body) and record it."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionError("client closed")
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
        self.requests.append((self.connections, head + b"\r\n\r\n" + body))
        return head

    @staticmethod
    def answer(conn: socket.socket) -> None:
        """Answer 200 with an intent and keep the connection open."""
        payload = json.dumps(INTENT_JSON).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload)}\r\nConnection: keep-alive\r\n"
        conn.sendall(head.encode() + b"\r\n" + payload)

    @staticmethod
    def reset(conn: socket.socket) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), as a crashed peer would."""
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    def stop_listening(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()

    def keys(self) -> list[tuple[int, str]]:
        """(connection number, Idempotency-Key) of every request received."""
        found = []
        for number, request in self.requests:
            for line in request.split(b"\r\n"):
                if line.lower().startswith(b"idempotency-key:"):
                    found.append((number, line.split(b":", 1)[1].strip().decode()))
        return found


@pytest.fixture
def keep_alive_server() -> Iterator[Callable[..., KeepAliveServer]]:
    servers: list[KeepAliveServer] = []

    def start(*scripts: Script) -> KeepAliveServer:
        servers.append(KeepAliveServer(*scripts))
        return servers[-1]

    yield start
    for server in servers:
        server.stop_listening()


def serve_one_then_reset_idle(conn: socket.socket, server: KeepAliveServer) -> None:
    """Answer one request, then reset the connection while it is idle in the client's pool."""
    server.read_request(conn)
    server.answer(conn)
    server.reset(conn)
    server.reset_done.set()


def serve_one(conn: socket.socket, server: KeepAliveServer) -> None:
    server.read_request(conn)
    server.answer(conn)
    conn.close()


def serve_one_then_reset_after_the_next_request(
    conn: socket.socket, server: KeepAliveServer
) -> None:
    """Answer one request; read the next one whole on the same connection, then reset."""
    server.read_request(conn)
    server.answer(conn)
    server.read_request(conn)
    server.reset(conn)


def test_reset_before_send__socket_replaced_the_request_goes_out_once_on_a_new_one(
    keep_alive_server,
):
    server = keep_alive_server(serve_one_then_reset_idle, serve_one)
    client = shared_client(server.url)
    charge(client, "stale-1")
    assert server.reset_done.wait(2)
    charge(client, "stale-2")  # the dead socket is found before a byte is written
    assert server.keys() == [(1, "stale-1"), (2, "stale-2")]


def test_reset_before_send__provider_gone_is_transient(keep_alive_server):
    server = keep_alive_server(serve_one_then_reset_idle)
    client = shared_client(server.url)
    charge(client, "gone-1")
    assert server.reset_done.wait(2)
    server.stop_listening()
    with pytest.raises(TransientProviderError) as info:
        charge(client, "gone-2")
    assert info.value.outcome is Outcome.TRANSIENT
    assert server.keys() == [(1, "gone-1")]  # nothing of the second request was sent


def test_reset_after_send__on_the_reused_socket_is_uncertain(keep_alive_server):
    server = keep_alive_server(serve_one_then_reset_after_the_next_request)
    client = shared_client(server.url)
    charge(client, "sent-1")
    with pytest.raises(UncertainProviderError) as info:
        charge(client, "sent-2")
    assert info.value.outcome is Outcome.UNCERTAIN
    # The provider read the whole second request on the kept-alive socket: it may have acted.
    assert server.keys() == [(1, "sent-1"), (1, "sent-2")]


def test_provider_restarted_between_two_calls__new_connection_no_error(provider):
    client = ProviderClient.from_settings()
    charge(client, "restart-1")
    host, port = provider.host, provider.port
    provider.stop()  # closes the kept-alive connection from its side
    with FakeProviderServer(host, port) as restarted:
        assert charge(client, "restart-2").status == "succeeded"
        assert restarted.state.succeeded_count(metadata={"step": "restart-2"}) == 1


def test_provider_stopped_between_two_calls__transient(provider):
    client = ProviderClient.from_settings()
    charge(client, "stopped-1")
    provider.stop()
    with pytest.raises(TransientProviderError):
        charge(client, "stopped-2")
