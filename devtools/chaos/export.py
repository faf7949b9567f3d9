"""The invoice export in the chaos run: a fake accounting API of its own, under faults.

Every paid order of the run is exported (ACCOUNTING_EXPORT on) to the fake
accounting API (`run_fake_provider --contract accounting`), which drops the
answer after committing the invoice, answers 500 after committing it, or
answers late, at the run's rates; the workers are SIGKILLed all along as for
the charges. The figures are the accounting API's own list: one invoice per
export operation (`external_id`), none made outside one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import requests

from devtools.topology.stack import Stack, free_port
from payments.invoices.effect import external_id
from payments.invoices.names import INVOICE_EXPORT
from payments.models import Operation, OperationState
from payments.shop.models import Order

API_KEY = "acct_chaos"


@dataclass
class Export:
    """The fake accounting API of one run, and what the run's settings need to reach it."""

    drop_rate: float
    fail_rate: float
    slow_rate: float
    seed: int
    port: int = 0

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Every process of the run exports paid orders to this fake."""
        return {
            "ACCOUNTING_URL": self.url,
            "ACCOUNTING_API_KEY": API_KEY,
            "ACCOUNTING_EXPORT": "1",
        }

    def start(self, stack: Stack) -> None:
        """Start the fake and give it the run's fault rates (its control API)."""
        stack.start_fake(
            "accounting",
            [
                "--contract", "accounting", "--port", str(self.port),
                "--api-key", API_KEY, "--seed", str(self.seed), "--slow-delay", "4",
            ],
            health=f"{self.url}/_fake/health",
        )  # fmt: skip
        answer = requests.post(
            f"{self.url}/_fake/config",
            json={
                "drop_after_commit_rate": self.drop_rate,
                "fail_after_commit_rate": self.fail_rate,
                "slow_rate": self.slow_rate,
            },
            timeout=5,
        )
        answer.raise_for_status()

    def figures(self, order_ids: list[int], paid: Iterable[str]) -> dict[str, object]:
        """The export's figures, from the accounting API's own list of invoices; `paid`: the
        order statuses that took the money (refunded ones included)."""
        paid_ids = set(
            Order.objects.filter(pk__in=order_ids, status__in=list(paid)).values_list(
                "pk", flat=True
            )
        )
        invoices = requests.get(f"{self.url}/_fake/invoices", timeout=30).json()
        made = Counter(str(i["external_id"]) for i in invoices["data"])
        ops = Operation.objects.filter(
            kind=INVOICE_EXPORT, entity_type="order", entity_id__in=[str(o) for o in order_ids]
        )
        exported = {external_id(op): op for op in ops}
        succeeded = {
            int(op.entity_id) for op in exported.values() if op.state == OperationState.SUCCEEDED
        }
        stats = requests.get(f"{self.url}/_fake/stats", timeout=30).json()
        return {
            "export_faults": ", ".join(f"{k} {n}" for k, n in sorted(stats["faults"].items())),
            "export_replays": stats["replays"],
            "export_operations": len(exported),
            "export_by_state": dict(Counter(op.state for op in exported.values())),
            "invoices_at_accounting": sum(made[x] for x in exported),
            # the same export made twice at the accounting system: what the fence prevents
            "double_invoices": sum(1 for x in exported if made[x] > 1),
            # the same export made twice, of any operation (a leftover job of an earlier run
            # exports to this run's fake too)
            "double_invoices_any_operation": sum(1 for n in made.values() if n > 1),
            # an invoice no export operation asked for: outside the fence
            "invoices_outside_the_fence": sum(
                n for x, n in made.items() if x not in exported and not _an_export(x)
            ),
            "paid_orders_exported_once": sum(
                1 for o in paid_ids if o in succeeded and made[_id_of(exported, o)] == 1
            ),
        }


def _an_export(reference: str) -> bool:
    """Whether an external id names an export operation of this database (`key@id`)."""
    key, _, pk = reference.rpartition("@")
    return pk.isdigit() and Operation.objects.filter(pk=int(pk), key=key).exists()


def _id_of(exported: dict[str, Operation], order_id: int) -> str:
    return next((x for x, op in exported.items() if op.entity_id == str(order_id)), "")
