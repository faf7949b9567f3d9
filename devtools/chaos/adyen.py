"""Adyen in the chaos run: a shop of the run's own pays through a fake Adyen under faults.

A share of the orders (`adyen_rate`) is made and paid through an API client whose
`payment_system` is "adyen" (checkouts, captures and refunds alike), against the
fake Adyen Checkout API (`run_fake_provider --contract adyen`), which drops answers
after executing, answers late and fails after executing at the run's rates, and
sends its HMAC-signed notifications to the run's web process
(`/adyen/notifications/`), retried until `[accepted]`. Adyen offers no look-up: a
lost answer is settled by a same-key replay or by its notification.

The figures are Adyen's own record (the fake's timeline of what it executed, by
`merchantReference`, which names the operation and step): payments authorised per
order, refunds per refund step and refunded per payment.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass

import requests

from devtools.topology.stack import Stack, free_port
from payments.api.keys import issue_key
from payments.models import ApiClient, Operation

API_KEY = "AQE_chaos_key"
MERCHANT = "ChaosECOM"
HMAC_KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
#: The card an Adyen shop sends, and the one Adyen's test platform declines (compact JSON:
#: the API takes a payment method without spaces).
CARD = json.dumps({"type": "scheme", "holderName": "Chaos"}, separators=(",", ":"))
DECLINED = json.dumps({"type": "scheme", "holderName": "DECLINED"}, separators=(",", ":"))


@dataclass
class AdyenShop:
    """The run's fake Adyen and the shop that pays through it."""

    drop_rate: float
    fail_rate: float
    slow_rate: float
    seed: int
    port: int = 0
    key: str = ""

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Every process of the run configures Adyen's settings entry (project/settings.py)."""
        return {
            "ADYEN_URL": f"{self.url}/v72",
            "ADYEN_API_KEY": API_KEY,
            "ADYEN_MERCHANT_ACCOUNT": MERCHANT,
            "ADYEN_HMAC_KEY": HMAC_KEY,
        }

    def start(self, stack: Stack, api_port: int, run_id: str) -> None:
        """Start the fake (its notifications to the run's web process) and make the shop."""
        stack.start_fake(
            "adyen",
            [
                "--contract", "adyen", "--port", str(self.port), "--api-key", API_KEY,
                "--merchant-account", MERCHANT, "--hmac-key", HMAC_KEY,
                "--webhook-url", f"http://127.0.0.1:{api_port}/adyen/notifications/",
                "--seed", str(self.seed), "--slow-delay", "4",
                "--drop-after-accept-rate", str(self.drop_rate),
                "--fail-after-rate", str(self.fail_rate), "--slow-rate", str(self.slow_rate),
            ],
            health=f"{self.url}/_fake/health",
        )  # fmt: skip
        issued = issue_key(f"chaos-adyen-{run_id}")
        ApiClient.objects.filter(pk=issued.client.pk).update(payment_system="adyen")
        self.key = issued.key

    def session(self) -> requests.Session:
        """An API session as the Adyen shop."""
        api = requests.Session()
        api.headers["Authorization"] = f"Bearer {self.key}"
        return api

    def figures(self) -> dict[str, object]:
        """What Adyen executed for the run, by the operation and step each request named."""
        rows = requests.get(f"{self.url}/_fake/timeline", timeout=30).json()["data"]
        stats = requests.get(f"{self.url}/_fake/stats", timeout=30).json()
        ok = [row for row in rows if row["success"]]
        authorised = [row for row in ok if row["eventCode"] == "AUTHORISATION"]
        steps = Counter(row["merchantReference"] for row in authorised)
        ops = _operations([*steps, *(row["merchantReference"] for row in ok)])
        orders = Counter(ops[ref].entity_id for ref in steps if ref in ops)
        refunds = [row for row in ok if row["eventCode"] == "REFUND"]
        refunded: dict[str, int] = defaultdict(int)
        for row in refunds:
            refunded[row["originalReference"]] += int(row["amount"]["value"])
        captured: dict[str, int] = defaultdict(int)
        for row in ok:
            if row["eventCode"] == "CAPTURE":
                captured[row["originalReference"]] += 1
        charged = {row["pspReference"]: int(row["amount"]["value"]) for row in authorised}
        cancelled = {row["originalReference"] for row in ok if row["eventCode"] == "CANCELLATION"}
        return {
            "adyen_requests": stats["requests"],
            "adyen_replays": stats["replays"],
            "adyen_faults": ", ".join(
                f"{k} {n}" for k, n in sorted(stats["faults_injected"].items())
            )
            or "none",
            "adyen_notifications": stats.get("notifications"),
            "adyen_payments_authorised": len(authorised),
            # authorised and not cancelled since (a hold released is no money taken)
            "adyen_payments_taken": sum(1 for psp in charged if psp not in cancelled),
            # an order Adyen authorised twice (across its steps and attempts): a double charge
            "adyen_double_charges": sum(1 for n in orders.values() if n > 1),
            "adyen_payments_outside_the_fence": sum(1 for ref in steps if ref not in ops),
            "adyen_refunds": len(refunds),
            "adyen_double_refunds": sum(
                1 for n in Counter(row["merchantReference"] for row in refunds).values() if n > 1
            ),
            "adyen_over_refunds": sum(
                1 for psp, total in refunded.items() if total > charged.get(psp, total)
            ),
            "adyen_double_captures": sum(1 for n in captured.values() if n > 1),
        }

    def refunded_by_order(self) -> dict[int, int]:
        """What Adyen gave back per order (its refunds that succeeded, by the order their
        refund operation is about)."""
        rows = requests.get(f"{self.url}/_fake/timeline", timeout=30).json()["data"]
        refunds = [row for row in rows if row["success"] and row["eventCode"] == "REFUND"]
        ops = _operations([row["merchantReference"] for row in refunds])
        given: dict[int, int] = defaultdict(int)
        for row in refunds:
            op = ops.get(row["merchantReference"])
            if op is not None:
                given[int(op.entity_id)] += int(row["amount"]["value"])
        return dict(given)


def _operations(references: list[str]) -> dict[str, Operation]:
    """The operations `fence:<operation id>:<step>` references name, by reference."""
    ids = {
        ref: int(ref.split(":")[1])
        for ref in references
        if ref.startswith("fence:") and ref.count(":") == 2 and ref.split(":")[1].isdigit()
    }
    found = Operation.objects.in_bulk(set(ids.values()))
    return {ref: found[pk] for ref, pk in ids.items() if pk in found}
