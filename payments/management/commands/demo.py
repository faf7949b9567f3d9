"""The main job end to end: real workers, a real crash, no double charge."""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from pathlib import Path

import requests
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count, Q
from django.utils import timezone

from payments.audit import audit
from payments.models import ClaimState, Invoice, Operation, OperationState, Order, StepClaim
from payments.provider.client import ProviderClient
from payments.stack import Stack, free_port

SETTLED = (OperationState.SUCCEEDED, OperationState.FAILED, OperationState.NEEDS_REVIEW)


class Command(BaseCommand):
    help = (
        "Start the fake provider, the API server, two RQ workers and the recovery loop; create "
        "orders and check them out through the HTTP API; SIGKILL a worker in the middle of a "
        "charge; wait until every operation is settled; print what happened. Exits 1 on any "
        "double charge or unfenced charge."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orders", type=int, default=20, help="How many orders.")
        parser.add_argument("--workers", type=int, default=2, help="How many RQ workers.")
        parser.add_argument("--timeout", type=float, default=120, help="Seconds to settle.")

    def handle(self, *args: object, **options: object) -> None:
        n, k = options["orders"], options["workers"]
        if n < 1 or k < 1:
            raise CommandError("--orders and --workers must be at least 1.")
        run = uuid.uuid4().hex[:8]
        provider_port, api_port = free_port(), free_port()
        env = {
            **os.environ,
            "DEBUG": "1",
            "PAYMENT_PROVIDER_URL": f"http://127.0.0.1:{provider_port}",
            "API_TOKEN": settings.API_TOKEN,
            "SECRET_KEY": settings.SECRET_KEY,
            # A short lease so the crashed worker's charge is picked up within seconds.
            "PROVIDER_CONNECT_TIMEOUT": "2",
            "PROVIDER_READ_TIMEOUT": "5",
            "JOB_TIMEOUT": "10",
            "CLAIM_LEASE": "12",
            "RETRY_BACKOFF": "1,3",
            "EMAIL_BACKEND": "django.core.mail.backends.dummy.EmailBackend",
        }
        stack = Stack(env=env, log_dir=Path(settings.BASE_DIR) / "var" / "log" / f"demo-{run}")
        self.stdout.write(f"Demo run {run}: logs in {stack.log_dir}")
        try:
            stack.start_provider(provider_port, "--slow-delay", "4")
            stack.start_api(api_port)
            for _ in range(k):
                stack.start_worker()
            stack.start_recovery(interval=2)
            self.stdout.write(
                f"Started fake provider :{provider_port}, API :{api_port}, "
                f"{k} workers, recovery loop."
            )
            started = time.monotonic()
            keys = self._checkout(n, run, api_port, provider_port)
            killed = self._kill_mid_charge(stack, keys)
            self._wait_settled(keys, options["timeout"])
            drained = time.monotonic() - started
            ok = self._report(keys, provider_port, killed, drained)
        finally:
            stack.stop()
        if not ok:
            raise CommandError("invariant violated: see the table above")

    def _checkout(self, n: int, run: str, api_port: int, provider_port: int) -> list[str]:
        api = requests.Session()
        api.headers["Authorization"] = f"Bearer {settings.API_TOKEN}"
        base = f"http://127.0.0.1:{api_port}/api"
        # The first charge is held open 4 s at the provider: the crash lands inside it.
        requests.post(
            f"http://127.0.0.1:{provider_port}/_fake/faults",
            json={"mode": "slow", "count": 1},
            timeout=5,
        ).raise_for_status()
        keys = []
        for i in range(n):
            order = api.post(
                f"{base}/orders",
                json={"amount": 1000 + i, "currency": "eur", "email": f"demo{i}@example.com"},
                timeout=10,
            )
            order.raise_for_status()
            key = f"demo-{run}-{i}"
            pm = "pm_card_chargeDeclined" if i % 10 == 9 else "pm_card_visa"
            resp = api.post(
                f"{base}/orders/{order.json()['id']}/checkout",
                json={"payment_method": pm},
                headers={"Idempotency-Key": key},
                timeout=10,
            )
            if resp.status_code != 202:
                raise CommandError(f"checkout answered {resp.status_code}: {resp.text[:200]}")
            keys.append(key)
        self.stdout.write(
            f"Created {n} orders and checked them out through the API "
            f"({n // 10} with a card that is declined)."
        )
        return keys

    def _kill_mid_charge(self, stack: Stack, keys: list[str]) -> int:
        """SIGKILL the worker whose charge is held open at the provider (accepted, unanswered)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            in_flight = (
                StepClaim.objects.filter(
                    operation__key__in=keys,
                    step="charge",
                    state=ClaimState.CLAIMED,
                    claimed_at__lt=timezone.now() - timedelta(seconds=1),
                )
                .exclude(claimed_by="")
                .select_related("operation")
                .first()
            )
            owner = in_flight.claimed_by.split("/")[0] if in_flight else None
            victim = next((w for w in stack.workers() if w.name == owner), None)
            if victim is not None:
                stack.kill(victim)
                stack.start_worker()
                self.stdout.write(
                    self.style.WARNING(
                        f"SIGKILLed {victim.name} and its work horse in the middle of the charge "
                        f"of {in_flight.operation.key}; started a replacement worker."
                    )
                )
                return 1
            time.sleep(0.05)
        self.stdout.write(self.style.WARNING("No charge was caught in flight; nothing killed."))
        return 0

    def _wait_settled(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            counts = dict(
                Operation.objects.filter(key__in=keys)
                .values_list("state")
                .annotate(n=Count("id"))
                .values_list("state", "n")
            )
            line = ", ".join(f"{state} {n}" for state, n in sorted(counts.items()))
            if line != last:
                self.stdout.write(f"  operations: {line}")
                last = line
            if sum(counts.get(s, 0) for s in SETTLED) == len(keys):
                return
            time.sleep(0.5)
        raise CommandError(f"operations not settled within {timeout:.0f}s: {last}")

    def _report(self, keys: list[str], provider_port: int, killed: int, drained: float) -> bool:
        ops = Operation.objects.filter(key__in=keys)
        order_ids = [int(op.entity_id) for op in ops]
        client = ProviderClient(
            f"http://127.0.0.1:{provider_port}",
            settings.PAYMENTS["PROVIDER_API_KEY"],
            connect_timeout=2,
            read_timeout=10,
        )
        intents = [
            pi
            for pi in client.list_payment_intents()
            if pi.metadata.get("operation_key") in set(keys)
        ]
        result = audit(intents, Q(operation__key__in=keys))
        states = dict(ops.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
        rows = [
            ("orders", len(order_ids)),
            ("orders paid", Order.objects.filter(pk__in=order_ids, status="paid").count()),
            (
                "orders declined",
                Order.objects.filter(pk__in=order_ids, status="payment_failed").count(),
            ),
            ("operations by state", ", ".join(f"{s} {n}" for s, n in sorted(states.items()))),
            ("provider successes", result.provider_successes),
            (
                "charge claims done",
                StepClaim.objects.filter(
                    operation__key__in=keys,
                    step="charge",
                    state=ClaimState.DONE,
                    result__status="succeeded",
                ).count(),
            ),
            ("invoices", Invoice.objects.filter(order_id__in=order_ids).count()),
            ("workers SIGKILLed", killed),
            ("double charges", len(result.double_charges)),
            ("provider successes without a claim", len(result.unfenced)),
            ("time to drain", f"{drained:.1f}s"),
        ]
        width = max(len(name) for name, _ in rows)
        self.stdout.write("")
        for name, value in rows:
            self.stdout.write(f"  {name:<{width}}  {value}")
        self.stdout.write("")
        ok = not result.double_charges and not result.unfenced
        if ok:
            self.stdout.write(
                self.style.SUCCESS(
                    "No double charge; every provider success has exactly one done claim."
                )
            )
        else:
            self.stdout.write(self.style.ERROR(f"Invariant violated: {result.as_dict()}"))
        return ok
