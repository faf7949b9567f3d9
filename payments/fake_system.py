"""A fake external system for handler tests: a real HTTP server with lost answers on demand.

Part of the test kit (`payments.testing.FakeSystem`; docs/testing.md, "A fake external
system"). It keeps the contract most idempotent APIs share, so that a test can drive a
handler's effect through every way a call ends without the real system:

- `POST /objects` with a JSON object and an `Idempotency-Key` header makes an object:
  `201` `{"id": "obj_…", "status": "succeeded", "external_id": …, "amount": …,
  "currency": …, "request": {…}}`. The same key with the same body answers the same
  again (header `Idempotent-Replayed: true`) and makes nothing; the same key with
  another body is `422 {"error": "idempotency_key_reused"}`; no key is `400`.
- `GET /objects/<id>`: the object, or `404 {"error": "not_found"}`.
- `GET /objects?external_id=<x>`: `{"data": [...]}`, every object made with that
  `external_id`, oldest first (a consistent read, never a lagging search); without
  one (or empty) `400 {"error": "external_id_required"}`.
- A body is read by its `Content-Length`: without one (chunked, or none sent) `411`,
  a length that is no number or negative `400`; nothing is made either way.

What goes wrong is set from the test, in its process: `lose_answers(n)` (the next `n`
new objects are made, and the connection closes without a byte of the answer: the
worker cannot know), `fail_next(n, status)` (answered `status`, nothing made),
`forget_keys()` (its keys' retention passed: a key sent again makes a new object, so
only a read settles a lost answer), and `objects()` is what was made, for the test's
count of each effect.
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["FakeSystem"]

OBJECTS = "/objects"
REPLAYED = "Idempotent-Replayed"


class FakeSystem:
    """The fake system's state and its server; `with FakeSystem() as system:` runs it on a
    free port of 127.0.0.1 (`system.url`) until the block ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: list[dict[str, Any]] = []
        self._by_key: dict[str, tuple[str, int, dict[str, Any]]] = {}  # body, status, answer
        self._lose = 0
        self._fail: list[int] = []
        self._server: ThreadingHTTPServer | None = None
        self.url = ""

    # --- the test's side -------------------------------------------------------------
    def start(self) -> FakeSystem:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        server.daemon_threads = True
        self._server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, name="fake-system", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeSystem:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def lose_answers(self, n: int = 1) -> None:
        """The next `n` objects are made and their answers lost (the connection closes)."""
        with self._lock:
            self._lose += n

    def fail_next(self, n: int = 1, status: int = 503) -> None:
        """The next `n` creates answer `status` and make nothing."""
        with self._lock:
            self._fail += [status] * n

    def forget_keys(self) -> None:
        """Forget every idempotency key, as a system does once its retention passed: a key
        sent again makes a new object."""
        with self._lock:
            self._by_key.clear()

    def objects(self, external_id: str | None = None) -> list[dict[str, Any]]:
        """What was made (each object once, however often its key was replayed)."""
        with self._lock:
            return [
                dict(o)
                for o in self._objects
                if external_id is None or o["external_id"] == external_id
            ]

    # --- the server's side -------------------------------------------------------------
    def create(self, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], bool, bool]:
        """(status, answer, replayed, lost) for a create under `key`."""
        canonical = json.dumps(body, sort_keys=True)
        with self._lock:
            if self._fail:
                status = self._fail.pop(0)
                return status, {"error": "unavailable"}, False, False
            known = self._by_key.get(key)
            if known is not None:
                sent, status, answer = known
                if sent != canonical:
                    return 422, {"error": "idempotency_key_reused"}, False, False
                return status, answer, True, False
            made = {
                "id": f"obj_{uuid.uuid4().hex[:24]}",
                "status": "succeeded",
                "external_id": str(body.get("external_id", "")),
                "amount": body.get("amount"),
                "currency": body.get("currency"),
                "request": body,
            }
            self._objects.append(made)
            self._by_key[key] = (canonical, 201, made)
            lost = self._lose > 0
            if lost:
                self._lose -= 1
            return 201, dict(made), False, lost

    def find(self, object_id: str) -> dict[str, Any] | None:
        with self._lock:
            return next((dict(o) for o in self._objects if o["id"] == object_id), None)


def _handler_for(system: FakeSystem) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "FakeSystem/1.0"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet in tests: what was made is in `objects()`

        def do_POST(self) -> None:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or (
                self.headers.get("Content-Length") is None
            ):
                self.close_connection = True  # a body of unknown length is not read
                return self._answer(411, {"error": "length_required"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0:
                self.close_connection = True
                return self._answer(400, {"error": "invalid_content_length"})
            raw = self.rfile.read(length) if length > 0 else b""
            if urlsplit(self.path).path != OBJECTS:
                return self._answer(404, {"error": "not_found"})
            key = self.headers.get("Idempotency-Key", "")
            if not key:
                return self._answer(400, {"error": "missing_idempotency_key"})
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                return self._answer(400, {"error": "invalid_json"})
            if not isinstance(body, dict):
                return self._answer(400, {"error": "invalid_json"})
            status, answer, replayed, lost = system.create(key, body)
            if lost:  # made, and the answer never leaves: the client sees the socket close
                self.close_connection = True
                return None
            return self._answer(status, answer, replayed=replayed)

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            if parts.path == OBJECTS:
                wanted = parse_qs(parts.query).get("external_id", [""])[0]
                if not wanted:  # a list of everything is no answer about one request
                    return self._answer(400, {"error": "external_id_required"})
                return self._answer(200, {"data": system.objects(wanted)})
            if parts.path.startswith(OBJECTS + "/"):
                found = system.find(parts.path[len(OBJECTS) + 1 :])
                if found is not None:
                    return self._answer(200, found)
            return self._answer(404, {"error": "not_found"})

        def _answer(self, status: int, body: dict[str, Any], *, replayed: bool = False) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if replayed:
                self.send_header(REPLAYED, "true")
            self.end_headers()
            self.wfile.write(data)

    return Handler
