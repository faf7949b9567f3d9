"""`fence_audit` against the real HTTP fake provider and real PostgreSQL.

Transactional: the fence commits claims outside any transaction, and the
subprocess runs of the command must see the committed rows.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.utils import timezone

from payments.engine import fence, systems
from payments.engine.systems import Ledger, LedgerEntry
from payments.engine.writes import fence_writes
from payments.management.commands.fence_audit import parse_since
from payments.models import ClaimState, FenceAuditRun, Operation
from payments.provider.client import ProviderClient
from tests.support.flows import order_and_checkout
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]


def audit(*args: str) -> tuple[str, int]:
    """Run the command; return its output and exit code (CommandError's returncode)."""
    out = io.StringIO()
    try:
        call_command("fence_audit", *args, stdout=out)
    except CommandError as exc:
        return out.getvalue(), exc.returncode
    return out.getvalue(), 0


def plant(metadata: dict[str, str], idempotency_key: str) -> str:
    """Charge at the provider directly, outside the fence; return the intent id."""
    with ProviderClient.from_settings() as client:
        intent = client.create_payment_intent(
            amount=1999,
            currency="eur",
            payment_method="pm_card_visa",
            metadata=metadata,
            idempotency_key=idempotency_key,
        )
    assert intent.status == "succeeded"
    return intent.id


def new_operation(key: str) -> Operation:
    with transaction.atomic():
        op, _ = fence.create_operation_in_tx(
            key=key, kind="checkout", entity_type="order", entity_id=1, params={}, actor="test"
        )
    return op


def test_fence_audit__clean_after_a_normal_checkout(provider, queue):
    _, op = order_and_checkout()
    run_worker(queue)

    output, code = audit("--since", "1h")

    assert code == 0, output
    assert "Clean" in output
    run = FenceAuditRun.objects.get()
    assert run.exit_code == 0
    assert run.summary["clean"] is True
    assert run.summary["provider_successes"] == 1
    assert run.window_start < run.started_at <= run.finished_at


def test_fence_audit__finds_a_planted_double_charge(provider, queue):
    step = {"operation_key": "checkout:order:9999", "step": "charge"}
    first = plant(step, "planted-key-1")
    second = plant(step, "planted-key-2")

    output, code = audit()

    assert code == 1
    assert "double charges): 1" in output
    assert first in output and second in output
    summary = FenceAuditRun.objects.get().summary
    assert summary["double_charges"] == [
        {
            "operation_key": "checkout:order:9999",
            "step": "charge",
            "references": sorted([first, second]),
        }
    ]
    assert sorted(summary["unfenced"]) == sorted([first, second])


def test_fence_audit__a_second_charge_beside_a_fenced_one_is_double_and_unfenced(provider, queue):
    _, op = order_and_checkout()
    run_worker(queue)
    fenced = op.claims.get(step="charge").provider_reference
    extra = plant({"operation_key": op.key, "step": "charge"}, "a-call-without-a-claim")

    output, code = audit("--format", "json")

    report = json.loads(output)
    assert code == report["exit_code"] == 1
    assert report["double_charges"][0]["references"] == sorted([fenced, extra])
    assert report["unfenced"] == [extra]
    assert report["steps"][extra] == f"{op.key}/charge"


def test_fence_audit__two_successes_for_one_order_across_operations_are_a_double_charge(
    provider, queue
):
    """The desk's story: a second attempt (another operation key) charged an order already
    charged. Per (operation, step) nothing is double; per order it is."""
    order, op = order_and_checkout()
    run_worker(queue)
    fenced = op.claims.get(step="charge").provider_reference
    second = plant(
        {"operation_key": f"{op.pk}:attempt-2", "step": "charge", "order_id": str(order.pk)},
        "second-attempt-key",
    )

    output, code = audit("--format", "json")

    report = json.loads(output)
    assert code == report["exit_code"] == 1
    assert report["double_charges"] == []  # no single step charged twice
    assert report["double_charged_entities"] == [
        {
            "entity_type": "order",
            "entity_id": str(order.pk),
            "references": sorted([fenced, second]),
            "operations": sorted([op.key, f"{op.pk}:attempt-2"]),
        }
    ]
    table, _ = audit()
    assert "Entities charged more than once (double charges, across operations): 1" in table
    assert f"order {order.pk}: " in table


def test_fence_audit__finds_a_planted_unfenced_charge(provider, queue):
    op = new_operation("checkout:order:unfenced")  # an operation with no done claim
    planted = plant({"operation_key": op.key, "step": "charge"}, "unfenced-key")

    output, code = audit()

    assert code == 1
    assert "Provider successes without a done claim: 1" in output
    assert f"{planted}  {op.key}/charge" in output
    summary = FenceAuditRun.objects.get().summary
    assert (summary["unfenced"], summary["double_charges"]) == ([planted], [])


def test_fence_audit__a_done_claim_the_provider_does_not_know(provider, queue):
    op = new_operation("checkout:order:ghost")
    claim = fence.claim_step(op, "charge", owner="test", lease_seconds=30).claim
    fence.settle_claim(claim, ClaimState.DONE, actor="test", reference="pi_nowhere")

    output, code = audit()

    assert code == 1
    assert "pi_nowhere" in output
    assert FenceAuditRun.objects.get().summary["unknown_references"] == ["pi_nowhere"]


def test_fence_audit__uncertain_claims_past_the_grace_are_found_whatever_the_window(
    provider, queue
):
    op = new_operation("checkout:order:unsure")
    claim = fence.claim_step(op, "charge", owner="test", lease_seconds=30).claim
    fence.settle_claim(claim, ClaimState.UNCERTAIN, actor="test", error="read timeout")
    with fence_writes():  # hand-made state, as the test says
        claim.__class__.objects.filter(pk=claim.pk).update(
            claimed_at=timezone.now() - timedelta(days=3)
        )

    output, code = audit("--since", "30m")

    assert code == 1
    assert f"{op.key}/charge" in output
    assert FenceAuditRun.objects.get().summary["stale_uncertain"] == [f"{op.key}/charge"]


def test_fence_audit__exits_2_when_the_provider_is_down(settings, closed_port):
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "PROVIDER_URL": f"http://127.0.0.1:{closed_port}",
        "PROVIDER_CONNECT_TIMEOUT": 0.5,
        "PROVIDER_READ_TIMEOUT": 1.0,
    }

    output, code = audit()

    assert code == 2
    run = FenceAuditRun.objects.get()
    assert run.exit_code == 2
    assert "provider could not be read" in run.summary["error"]


@pytest.mark.parametrize("value", ["", "24", "h", "0h", "5w", "-1d", "1.5h", "24 hours"])
def test_fence_audit__refuses_a_bad_since(value):
    with pytest.raises(CommandError, match="--since"):
        parse_since(value)
    assert not FenceAuditRun.objects.exists()


def test_fence_audit__since_accepts_minutes_hours_days():
    assert parse_since("30m") == timedelta(minutes=30)
    assert parse_since("24h") == timedelta(hours=24)
    assert parse_since("7d") == timedelta(days=7)


def _manage(*args: str, provider_url: str) -> subprocess.CompletedProcess:
    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "PAYMENT_PROVIDER_URL": provider_url,
        "PROVIDER_CONNECT_TIMEOUT": "0.5",
        "PROVIDER_READ_TIMEOUT": "1",
    }
    return subprocess.run(
        [sys.executable, "manage.py", "fence_audit", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_fence_audit__process_exit_codes_are_0_1_and_2(provider, queue, closed_port):
    clean = _manage("--since", "1h", provider_url=provider.url)
    plant({"operation_key": "checkout:order:7", "step": "charge"}, "k-a")
    plant({"operation_key": "checkout:order:7", "step": "charge"}, "k-b")
    found = _manage("--format", "json", provider_url=provider.url)
    down = _manage(provider_url=f"http://127.0.0.1:{closed_port}")

    assert clean.returncode == 0, clean.stderr
    assert found.returncode == 1, found.stderr
    assert json.loads(found.stdout)["double_charges"]  # stdout stays pure JSON
    assert down.returncode == 2, down.stderr
    assert "provider could not be read" in down.stderr
    assert list(FenceAuditRun.objects.values_list("exit_code", flat=True)) == [2, 1, 0]


def test_fence_audit__shows_a_success_we_left_uncertain_on_its_claim(provider, queue):
    """The desk puts the provider's view beside ours: the audit records what it found."""
    provider.state.enqueue_faults("drop_after_accept", 1)  # charged; the answer is lost
    _, op = order_and_checkout()
    run_worker(queue)
    op.refresh_from_db()
    claim = op.claims.get(step="charge")
    assert claim.state == ClaimState.UNCERTAIN

    _, code = audit()

    assert code == 1
    claim.refresh_from_db()
    view = claim.provider_view
    assert (view["source"], view["status"]) == ("fence_audit", "succeeded")
    assert view["reference"].startswith("pi_") and view["amount"] == claim.request["amount"]
    assert claim.state == ClaimState.UNCERTAIN  # an observation: the reconciler settles it


def test_an_over_refund__the_table_names_the_payment_and_exits_1(monkeypatch):
    """The table's over-refund line read a key the audit no longer writes (a KeyError, a
    traceback instead of the finding, exactly when money was given back twice)."""
    paid = LedgerEntry("pay_1", succeeded=True, metadata={}, amount=1000, created=int(time.time()))
    refunds = [
        LedgerEntry(f"ref_{n}", succeeded=True, metadata={}, amount=700, created=paid.created,
                    parent="pay_1")
        for n in (1, 2)
    ]  # fmt: skip
    declared = dataclasses.replace(
        systems.system_named("provider"), ledger=lambda _f, _t: Ledger([paid], refunds)
    )
    monkeypatch.setitem(systems._declared, "provider", declared)

    output, code = audit("--since", "1h")

    assert "pay_1: refunded 1400 of 1000" in output
    assert code == 1


def test_the_systems_it_does_not_audit__named_with_why(provider):
    """Adyen offers no list to audit against, the accounting system moves no money: the
    report says so instead of leaving them out in silence (issue 38: it 'ignores' them)."""
    output, code = audit("--since", "1h")
    as_json = json.loads(audit("--since", "1h", "--format", "json")[0])

    assert "Not audited: Adyen (adyen): it offers no list of its payments" in output
    assert "Not audited: the accounting system (accounting): it moves no money" in output
    assert {"adyen", "accounting"} <= {item["system"] for item in as_json["not_audited"]}
    assert code == 0


def no_handler_calls_the_provider(monkeypatch) -> None:
    """A project of its own (docs/install.md): the provider is declared by the fence, but
    none of its handlers calls it (a label service, an SMS gateway)."""
    from payments.engine import handlers

    monkeypatch.setattr(
        handlers,
        "_HANDLERS",
        {
            kind: spec
            for kind, spec in handlers._HANDLERS.items()
            if all(
                systems.system_of(e).name != systems.DEFAULT_SYSTEM for e in spec.effects.values()
            )
        },
    )


def test_no_handler_calls_the_provider__nothing_read_from_it__exit_0_and_said(
    monkeypatch, settings, closed_port
):
    """An outsider's catch: in a project without a payment provider the audit read the
    provider's default URL, and exited 2 every hour ("provider could not be read")."""
    no_handler_calls_the_provider(monkeypatch)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": f"http://127.0.0.1:{closed_port}"}

    output, code = audit("--since", "1h")

    assert code == 0, output
    assert "Not audited: the provider (provider): no registered handler calls it" in (output)
    assert FenceAuditRun.objects.get().exit_code == 0


def test_no_handler_calls_the_provider__stale_uncertain_claims_still_found(
    monkeypatch, settings, closed_port
):
    op = new_operation("label:parcel:unsure")
    claim = fence.claim_step(op, "charge", owner="test", lease_seconds=30).claim
    fence.settle_claim(claim, ClaimState.UNCERTAIN, actor="test", error="read timeout")
    with fence_writes():
        claim.__class__.objects.filter(pk=claim.pk).update(
            claimed_at=timezone.now() - timedelta(days=3)
        )
    no_handler_calls_the_provider(monkeypatch)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": f"http://127.0.0.1:{closed_port}"}

    output, code = audit("--since", "30m")

    assert code == 1
    assert f"{op.key}/charge" in output
