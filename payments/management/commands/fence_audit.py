"""Compare the provider's payment intents and refunds with the step claims; report double
charges and refunds.

The window is audited day by day (payments.observability.audit_window): its
memory is a day's, whatever the window. Exit codes: 0 clean, 1 findings
(after the report is printed), 2 the provider could not be read. Every run is
stored as a FenceAuditRun with its counts, its first findings and its
checkpoint (the end of the last day audited): `--since last` starts there.
"""

from __future__ import annotations

import gc
import json
import re
import sys
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Q
from django.utils import timezone

from payments.conf import payments_settings
from payments.engine import fence
from payments.engine.effects import EffectResult
from payments.engine.facts import SystemUnavailable
from payments.engine.handlers import systems_called
from payments.engine.outcomes import Outcome
from payments.engine.systems import (
    DEFAULT_SYSTEM,
    ExternalSystem,
    NotAtSystem,
    declared,
    system_named,
)
from payments.models import ClaimState, FenceAuditRun, StepClaim
from payments.observability.audit import audit
from payments.observability.audit_window import WindowAudit, audit_day, days
from payments.provider.errors import ProviderError

_UNITS = {"m": "minutes", "h": "hours", "d": "days"}
#: `--since last`: from where the last run stopped (its checkpoint).
SINCE_LAST = "last"
#: `--since last` with no earlier run: this much.
FIRST_WINDOW = timedelta(hours=24)


def parse_since(value: str) -> timedelta:
    """Turn `30m`, `24h` or `7d` into a timedelta; raise CommandError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([mhd])\s*", value or "")
    if match is None or int(match[1]) == 0:
        raise CommandError(
            f"--since must be last, or a positive number followed by m, h or d (e.g. 30m, "
            f"24h, 7d), not {value!r}."
        )
    return timedelta(**{_UNITS[match[2]]: int(match[1])})


def last_checkpoint() -> datetime | None:
    """Where the last run that got anywhere stopped (the end of its last audited day)."""
    return (
        FenceAuditRun.objects.filter(checkpoint__isnull=False)
        .order_by("-checkpoint")
        .values_list("checkpoint", flat=True)
        .first()
    )


class Command(BaseCommand):
    help = (
        "Audit the fence against the provider: list its payment intents of the window and "
        "report steps charged more than once, provider successes without a done claim, done "
        "claims the provider does not know, and uncertain claims past the grace period. "
        "Exit 0 clean, 1 findings, 2 provider unreadable."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since",
            default="24h",
            help="Window to audit: 30m, 24h, 7d (default 24h), or `last`: from where the "
            "last run stopped (a scheduled run; 24h when there is none).",
        )
        parser.add_argument(
            "--format", choices=["table", "json"], default="table", help="Report format."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        started = timezone.now()
        window_start = self._window_start(options["since"], started)
        totals = WindowAudit()
        checkpoint: datetime | None = None
        spans = list(days(window_start, started))
        if DEFAULT_SYSTEM not in systems_called():  # no handler of this project pays there
            spans = []  # nothing to list; not_audited says why, stale claims are still read
        try:
            system = system_named(DEFAULT_SYSTEM)
            ledger = system.ledger
            if ledger is None:
                raise CommandError(
                    f"fence audit: system {DEFAULT_SYSTEM!r} declares no ledger to audit against",
                    returncode=2,
                )
            for n, (start, end) in enumerate(spans):
                day = audit_day(ledger, start, end, first=n == 0, last=n == len(spans) - 1)
                self._note_on_claims(system, day.charges.unfenced)
                totals.add_day(day)
                checkpoint = end
                if options["verbosity"] >= 2:
                    self.stdout.write(
                        f"  {start:%Y-%m-%d %H:%M}: {day.intents_listed} intents, "
                        f"{day.refunds_listed} refunds listed"
                    )
                # One day at a time: neither this day's objects nor their cyclic
                # garbage (responses, parsed pages) are held while the next is listed.
                del day
                gc.collect()
        except (ProviderError, SystemUnavailable) as exc:
            cause = exc.__cause__ if isinstance(exc, SystemUnavailable) else exc
            reason = f"provider could not be read: {type(cause or exc).__name__}"
            summary = {
                **totals.as_summary(),
                "error": reason,
                "since": options["since"],
                "clean": None,
            }
            self._store(started, window_start, 2, summary, checkpoint)
            if options["format"] == "json":
                self.stdout.write(json.dumps({**summary, "exit_code": 2}, indent=2))
            raise CommandError(f"fence audit: {reason} ({exc})", returncode=2) from exc

        # Stale uncertain claims are reported whatever their age (never "outside the window").
        totals.add_stale(audit([], Q(pk__in=[]), stale_claims=Q(), now=started).stale_uncertain)
        exit_code = 0 if totals.clean else 1
        summary = {
            **totals.as_summary(),
            "not_audited": not_audited(),
            "since": options["since"],
            "window_start": window_start.isoformat(),
            "checkpoint": started.isoformat(),
            "reconcile_grace_seconds": payments_settings().reconcile_grace,
        }
        self._store(started, window_start, exit_code, summary, started)
        if options["format"] == "json":
            self.stdout.write(json.dumps({**summary, "exit_code": exit_code}, indent=2))
        else:
            self._write_table(summary)
            self._write_refund_table(summary["refunds"])
        if exit_code:
            raise CommandError(
                f"fence audit found {summary['findings']} problem(s); see the report above.",
                returncode=1,
            )

    @staticmethod
    def _window_start(since: str, started: datetime) -> datetime:
        if since.strip() == SINCE_LAST:
            checkpoint = last_checkpoint()
            if checkpoint is None:
                sys.stderr.write("fence audit: no earlier run to resume from; auditing 24h\n")
                checkpoint = started - FIRST_WINDOW
            start = min(checkpoint, started)
        else:
            start = started - parse_since(since)
        kept = timedelta(days=payments_settings().retention_days)
        if start < started - kept:
            # Claims older than that may be purged: their provider successes would look
            # unfenced.
            raise CommandError(
                f"--since reaches past the retention of claims (RETENTION_DAYS="
                f"{payments_settings().retention_days}); audit a shorter window."
            )
        return start

    def _write_refund_table(self, refunds: dict[str, Any]) -> None:
        write = self.stdout.write
        write(
            f"Refunds: {refunds['provider_refunds']} provider refunds, {refunds['done_claims']} "
            "done refund claims in the window."
        )
        sections = [
            (
                "Refund steps refunded more than once (double refunds)",
                "double_refunds",
                [f"{d['step']}: {', '.join(d['references'])}" for d in refunds["double_refunds"]],
            ),
            (
                "Payments refunded more than they were charged (over-refunds)",
                "over_refunds",
                [
                    f"{a['payment']}: refunded {a['refunded']} of {a['charged']}"
                    for a in refunds["over_refunds"]
                ],
            ),
            ("Provider refunds without a done claim", "unfenced", refunds["unfenced"]),
            (
                "Done refund claims the provider does not list as succeeded",
                "unknown_references",
                refunds["unknown_references"],
            ),
        ]
        self._write_sections(sections, refunds["counts"])

    def _write_sections(
        self, sections: list[tuple[str, str, list[str]]], counts: dict[str, int]
    ) -> None:
        """Each kind of finding: its count, its first lines, and how many more the count has."""
        for title, kind, lines in sections:
            total = counts.get(kind, len(lines))
            style = self.style.ERROR if total else self.style.SUCCESS
            self.stdout.write(style(f"{title}: {total}"))
            for line in lines:
                self.stdout.write(f"  {line}")
            if total > len(lines):
                self.stdout.write(f"  ... and {total - len(lines)} more")

    @staticmethod
    def _note_on_claims(system: ExternalSystem, unfenced: list[str]) -> None:
        """Show each unfenced success on the unsettled claim that asked for it (the desk reads it).

        A claim left uncertain, or in review, whose request the system did
        execute: the operator sees the system's answer beside ours. Findings
        are few: one lookup each (the system's `describe`), none when it has none.
        """
        for ref in unfenced:
            try:
                shown = system.describe(ref) if system.describe is not None else None
            except NotAtSystem:
                shown = None
            if shown is None:
                continue
            key, step = shown.metadata.get("operation_key"), shown.metadata.get("step")
            if not key or not step:
                continue
            claims = StepClaim.objects.filter(operation__key=key, step=step).exclude(
                state=ClaimState.DONE
            )
            if "operation_id" in shown.metadata:
                claims = claims.filter(operation_id=shown.metadata["operation_id"])
            found = EffectResult(
                Outcome.SUCCESS,
                reference=ref,
                data={"status": shown.status, "amount": shown.amount, "currency": shown.currency},
            )
            for claim in claims:
                fence.note_provider_view(claim, found, source="fence_audit")

    @staticmethod
    def _store(
        started: datetime,
        window_start: datetime,
        code: int,
        summary: dict,
        checkpoint: datetime | None,
    ) -> None:
        FenceAuditRun.objects.create(
            started_at=started,
            finished_at=timezone.now(),
            window_start=window_start,
            exit_code=code,
            summary=summary,
            checkpoint=checkpoint,
        )

    def _write_table(self, summary: dict[str, Any]) -> None:
        steps = summary["steps"]
        self.stdout.write(
            f"Fence audit since {summary['window_start']} ({summary['since']}, "
            f"{summary['days']} day(s)): {summary['intents_listed']} intents listed, "
            f"{summary['provider_successes']} provider successes, {summary['done_claims']} "
            "done claims in the window."
        )
        for item in summary.get("not_audited", []):
            self.stdout.write(f"Not audited: {item['label']} ({item['system']}): {item['why']}")
        sections = [
            (
                "Entities charged more than once (double charges, across operations)",
                "double_charged_entities",
                [
                    f"{d['entity_type']} {d['entity_id']}: {', '.join(d['references'])}  "
                    f"(operations: {', '.join(d['operations'])})"
                    for d in summary["double_charged_entities"]
                ],
            ),
            (
                "Steps charged more than once (double charges)",
                "double_charges",
                [
                    f"{d['operation_key']}/{d['step']}: {', '.join(d['references'])}"
                    for d in summary["double_charges"]
                ],
            ),
            (
                "Provider successes without a done claim",
                "unfenced",
                [f"{ref}  {steps.get(ref, '')}" for ref in summary["unfenced"]],
            ),
            (
                "Done claims whose reference the provider does not list as succeeded",
                "unknown_references",
                [f"{ref}  {steps.get(ref, '')}" for ref in summary["unknown_references"]],
            ),
            (
                f"Uncertain claims older than {summary['reconcile_grace_seconds']}s",
                "stale_uncertain",
                list(summary["stale_uncertain"]),
            ),
        ]
        self._write_sections(sections, summary["counts"])
        back = summary.get("refunded_in_full_count", 0)
        if back:
            self.stdout.write(f"Refunded in full (not findings): {back}")
            for ref in summary["refunded_in_full"]:
                self.stdout.write(f"  {ref}  {steps.get(ref, '')}".rstrip())
            if back > len(summary["refunded_in_full"]):
                self.stdout.write(f"  ... and {back - len(summary['refunded_in_full'])} more")
        if summary["clean"]:
            self.stdout.write(
                self.style.SUCCESS(
                    "Clean: every provider success has exactly one done claim"
                    + (", or was refunded in full." if back else ".")
                )
            )


def not_audited() -> list[dict[str, str]]:
    """The declared systems this audit does not judge, and why: it lists the provider's
    objects (its declared ledger); another system that moves money has its own record
    (Adyen's settlement report, no list API), one that moves none has no money to check."""
    found = []
    called = systems_called()
    for system in declared():
        if system.name == DEFAULT_SYSTEM and system.name in called:
            continue
        if system.name not in called:
            why = "no registered handler calls it"
        elif not system.moves_money:
            why = "it moves no money; its own reads settle each step"
        elif system.ledger is None:
            why = (
                "it offers no list of its payments to audit against: reconcile its done "
                "steps with its own report (the desk shows each step's reference)"
            )
        else:
            why = "its ledger is not audited by this command yet"
        found.append({"system": system.name, "label": system.label, "why": why})
    return found
