"""Compare the provider's payment intents with the step claims; report double charges.

Exit codes: 0 clean, 1 findings (after the report is printed), 2 the provider
could not be read. Every run is stored as a FenceAuditRun.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Q
from django.utils import timezone

from payments.conf import payments_settings
from payments.engine import fence
from payments.engine.effects import EffectResult
from payments.engine.outcomes import Outcome
from payments.models import ClaimState, FenceAuditRun, StepClaim
from payments.observability.audit import AuditResult, RefundAuditResult, audit, audit_refunds
from payments.provider.client import PaymentIntent, ProviderClient, Refund
from payments.provider.errors import ProviderError

#: Intents are listed from this much before the window: the provider's clock and
#: ours differ, and a claim in the window must find its intent in the list.
CLOCK_MARGIN = timedelta(minutes=5)

_UNITS = {"m": "minutes", "h": "hours", "d": "days"}


def parse_since(value: str) -> timedelta:
    """Turn `30m`, `24h` or `7d` into a timedelta; raise CommandError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([mhd])\s*", value or "")
    if match is None or int(match[1]) == 0:
        raise CommandError(
            f"--since must be a positive number followed by m, h or d (e.g. 30m, 24h, 7d), "
            f"not {value!r}."
        )
    return timedelta(**{_UNITS[match[2]]: int(match[1])})


class Command(BaseCommand):
    help = (
        "Audit the fence against the provider: list its payment intents of the window and "
        "report steps charged more than once, provider successes without a done claim, done "
        "claims the provider does not know, and uncertain claims past the grace period. "
        "Exit 0 clean, 1 findings, 2 provider unreadable."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since", default="24h", help="Window to audit: 30m, 24h, 7d (default 24h)."
        )
        parser.add_argument(
            "--format", choices=["table", "json"], default="table", help="Report format."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        since = parse_since(options["since"])
        started = timezone.now()
        window_start = started - since
        try:
            intents = self._list_intents(window_start - CLOCK_MARGIN, options["verbosity"])
            refunds = self._list_refunds(intents)
        except ProviderError as exc:
            reason = f"provider could not be read: {type(exc).__name__}"
            summary = {"error": reason, "since": options["since"], "clean": None}
            self._store(started, window_start, 2, summary)
            if options["format"] == "json":
                self.stdout.write(json.dumps({**summary, "exit_code": 2}, indent=2))
            raise CommandError(f"fence audit: {reason} ({exc})", returncode=2) from exc

        # Only the steps whose effects take money are judged against the intent list (audit's
        # audited_steps: a hold or a release is not); stale uncertain
        # claims are reported whatever their age (they are never "outside the window").
        in_window = Q(claimed_at__gte=window_start)
        result = audit(intents, in_window, stale_claims=Q(), now=started)
        self._note_on_claims(intents, result.unfenced)
        refund_result = audit_refunds(
            refunds,
            {intent.id: intent.amount_received or intent.amount for intent in intents},
            Q(claimed_at__gte=window_start),
        )
        clean = result.clean and refund_result.clean
        exit_code = 0 if clean else 1
        summary = {
            **result.as_dict(),
            "clean": clean,
            "findings": result.findings + refund_result.findings,
            "refunds": refund_result.as_dict(),
            "since": options["since"],
            "window_start": window_start.isoformat(),
            "intents_listed": len(intents),
            "reconcile_grace_seconds": payments_settings().reconcile_grace,
        }
        self._store(started, window_start, exit_code, summary)
        if options["format"] == "json":
            self.stdout.write(json.dumps({**summary, "exit_code": exit_code}, indent=2))
        else:
            self._write_table(result, summary)
            self._write_refund_table(refund_result)
        if exit_code:
            raise CommandError(
                f"fence audit found {summary['findings']} problem(s); see the report above.",
                returncode=1,
            )

    def _list_intents(self, created_gte: datetime, verbosity: int) -> list[PaymentIntent]:
        intents: list[PaymentIntent] = []
        with ProviderClient.from_settings() as client:
            for intent in client.list_payment_intents(created_gte=int(created_gte.timestamp())):
                intents.append(intent)
                if verbosity >= 2:
                    key = intent.metadata.get("operation_key", "-")
                    self.stdout.write(f"  {intent.id} {intent.status} {key}")
        return intents

    @staticmethod
    def _list_refunds(intents: list[PaymentIntent]) -> dict[str, list[Refund]]:
        """The refunds of every succeeded intent of the window (one listing per intent)."""
        refunds: dict[str, list[Refund]] = {}
        with ProviderClient.from_settings() as client:
            for intent in intents:
                if intent.status == "succeeded":
                    refunds[intent.id] = list(client.list_refunds(payment_intent=intent.id))
        return refunds

    def _write_refund_table(self, result: RefundAuditResult) -> None:
        write = self.stdout.write
        write(
            f"Refunds: {result.provider_refunds} provider refunds, {result.done_claims} done "
            "refund claims in the window."
        )
        sections = [
            (
                "Refund steps refunded more than once (double refunds)",
                [
                    f"{step}: {', '.join(refs)}"
                    for step, refs in sorted(result.double_refunds.items())
                ],
            ),
            (
                "Intents refunded more than they were charged (over-refunds)",
                [
                    f"{pi}: refunded {a['refunded']} of {a['charged']}"
                    for pi, a in sorted(result.over_refunds.items())
                ],
            ),
            ("Provider refunds without a done claim", list(result.unfenced)),
            (
                "Done refund claims the provider does not list as succeeded",
                list(result.unknown_references),
            ),
        ]
        for title, lines in sections:
            style = self.style.ERROR if lines else self.style.SUCCESS
            write(style(f"{title}: {len(lines)}"))
            for line in lines:
                write(f"  {line}")

    @staticmethod
    def _note_on_claims(intents: list[PaymentIntent], unfenced: list[str]) -> None:
        """Show each unfenced success on the unsettled claim that asked for it (the desk reads it).

        A claim left uncertain, or in review, whose request the provider did
        execute: the operator sees the provider's answer beside ours.
        """
        by_id = {intent.id: intent for intent in intents}
        for ref in unfenced:
            intent = by_id[ref]
            key, step = intent.metadata.get("operation_key"), intent.metadata.get("step")
            if not key or not step:
                continue
            claims = StepClaim.objects.filter(operation__key=key, step=step).exclude(
                state=ClaimState.DONE
            )
            if "operation_id" in intent.metadata:
                claims = claims.filter(operation_id=intent.metadata["operation_id"])
            found = EffectResult(
                Outcome.SUCCESS,
                reference=intent.id,
                data={
                    "status": intent.status,
                    "amount": intent.amount,
                    "currency": intent.currency,
                },
            )
            for claim in claims:
                fence.note_provider_view(claim, found, source="fence_audit")

    @staticmethod
    def _store(started: datetime, window_start: datetime, code: int, summary: dict) -> None:
        FenceAuditRun.objects.create(
            started_at=started,
            finished_at=timezone.now(),
            window_start=window_start,
            exit_code=code,
            summary=summary,
        )

    def _write_table(self, result: AuditResult, summary: dict[str, Any]) -> None:
        write = self.stdout.write
        write(
            f"Fence audit since {summary['window_start']} ({summary['since']}): "
            f"{summary['intents_listed']} intents listed, {result.provider_successes} provider "
            f"successes, {result.done_claims} done claims in the window."
        )
        sections = [
            (
                "Entities charged more than once (double charges, across operations)",
                [
                    f"{kind} {ident}: {', '.join(found['references'])}  "
                    f"(operations: {', '.join(found['operations'])})"
                    for (kind, ident), found in sorted(result.double_charged_entities.items())
                ],
            ),
            (
                "Steps charged more than once (double charges)",
                [
                    f"{key}/{step}: {', '.join(refs)}"
                    for (key, step), refs in sorted(result.double_charges.items())
                ],
            ),
            (
                "Provider successes without a done claim",
                [f"{ref}  {result.steps.get(ref, '')}" for ref in result.unfenced],
            ),
            (
                "Done claims whose reference the provider does not list as succeeded",
                [f"{ref}  {result.steps.get(ref, '')}" for ref in result.unknown_references],
            ),
            (
                f"Uncertain claims older than {summary['reconcile_grace_seconds']}s",
                list(result.stale_uncertain),
            ),
        ]
        for title, lines in sections:
            style = self.style.ERROR if lines else self.style.SUCCESS
            write(style(f"{title}: {len(lines)}"))
            for line in lines:
                write(f"  {line}")
        if result.clean:
            write(self.style.SUCCESS("Clean: every provider success has exactly one done claim."))
