"""A deposit held at an external system of its own: the whole of what a project writes.

What a handler author writes for a system that is not the payment provider
(docs/handlers.md, "An external system in your own project" shows this file as
it is; tests/test_readme_handler.py checks they agree), against payments.testing.FakeSystem's
contract: a create under the claim's key, a retrieve by id, a list by the
`external_id` the request carries (a consistent read that settles a lost
answer). It imports nothing of the fence but its public API, payments.fence.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import requests

from payments.fence import (
    ClaimView,
    ConflictError,
    EffectResult,
    ExternalSystem,
    NotFoundError,
    PermanentError,
    ProviderEffect,
    Read,
    Run,
    TransientError,
    UncertainError,
    classify_request_failure,
    declare_system,
    note_request,
    operation,
    system_settings,
)

DEPOSITS = "kit_deposits"
TAKE_DEPOSIT = "kit_take_deposit"
HOLD = "hold_deposit"

declare_system(
    ExternalSystem(
        name=DEPOSITS,
        label="the deposit service",
        reads=(Read.LIST_BY_REFERENCE,),
        reference_patterns=(r"obj_[0-9a-f]{24}",),
        object_noun="deposit",
    )
)


def _object(answer: requests.Response, context: str) -> SimpleNamespace:
    """The object of a 2xx; a failure as the error whose outcome the fence acts on."""
    if answer.status_code in (200, 201):
        return SimpleNamespace(**answer.json())
    if answer.status_code == 404:
        raise NotFoundError(f"{context}: 404", http_status=404)
    if answer.status_code == 422:
        raise ConflictError(f"{context}: key reused", http_status=422)
    if answer.status_code in (429, 503):  # the contract: nothing was made
        raise TransientError(f"{context}: {answer.status_code}", http_status=answer.status_code)
    if answer.status_code == 409:  # a request under this key is still in flight
        busy = TransientError(f"{context}: in flight", http_status=409)
        busy.in_flight = True  # it may still succeed: wait for it, never fail the step
        raise busy
    if 400 <= answer.status_code < 500:
        raise PermanentError(f"{context}: {answer.status_code}", http_status=answer.status_code)
    # A 5xx, or anything else: the deposit may have been made. Never failed: replayed
    # under the same key, or settled by the list below.
    raise UncertainError(f"{context}: {answer.status_code}", http_status=answer.status_code)


def _send(method: str, path: str, **kwargs: Any) -> SimpleNamespace:
    """One request, never retried (a retry is the fence's, under the same key); its
    answer's object, or the error the fence acts on (`_object`)."""
    entry = system_settings(DEPOSITS)  # PAYMENTS["SYSTEMS"]["kit_deposits"]
    url = entry.url.rstrip("/") + path
    timeout = (entry.connect_timeout, entry.read_timeout)
    key = kwargs.get("headers", {}).get("Idempotency-Key")
    try:
        answer = requests.request(method, url, timeout=timeout, **kwargs)
    except requests.RequestException as exc:
        # Noted for the desk's evidence (its "requests" column) and the audit trail.
        note_request(method, path, status=None, request_id=None, idempotency_key=key,
                     error=type(exc).__name__)  # fmt: skip
        raise classify_request_failure(exc, context=f"{method} {path}") from exc
    note_request(method, path, status=answer.status_code, request_id=None, idempotency_key=key,
                 replayed=answer.headers.get("Idempotent-Replayed") == "true")  # fmt: skip
    return _object(answer, f"{method} {path}")


class HoldDeposit(ProviderEffect):
    SYSTEM = DEPOSITS
    MAY_HAVE_HAPPENED = "The deposit may already be held."

    def request(self) -> dict[str, Any]:
        return {
            "external_id": f"{self.operation.key}@{self.operation.pk}",
            "amount": int(self.params["amount"]),
            "currency": "eur",
        }

    def build_request(self) -> dict[str, Any]:
        return dict(self.request())  # the system keeps no metadata: the external id names it

    def send(self, request: dict[str, Any], idempotency_key: str) -> Any:
        return _send("POST", "/objects", json=request, headers={"Idempotency-Key": idempotency_key})

    def retrieve(self, reference: str) -> Any:
        return _send("GET", f"/objects/{reference}")

    def candidates(self, claim: ClaimView) -> Iterator[Any]:
        # The external id as a query parameter (requests encodes it: keys hold "@", ":").
        found = _send("GET", "/objects", params={"external_id": claim.request["external_id"]})
        return (SimpleNamespace(**o) for o in found.data)

    def outcome(self, obj: Any) -> EffectResult | None:
        return self.succeeded(obj.id, amount=obj.amount, currency=obj.currency)

    def matches(self, obj: Any, request: dict[str, Any]) -> bool:
        return obj.external_id == request["external_id"] and obj.amount == request["amount"]


@operation(TAKE_DEPOSIT, steps={HOLD: HoldDeposit})
def take_deposit(run: Run) -> None:
    run.external(HOLD)
