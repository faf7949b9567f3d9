"""Adyen's signed notifications, as received: the only read Adyen offers of an outcome.

A row is written once per notification item (the inbox, consumer `adyen-notifications`,
decides "once"), before it settles anything: a step whose claim was busy when its
notification came reads the row later (`AdyenEffect.find`). Only the signed fields and
the reason are kept, never `additionalData` (it may carry card details).
"""

from __future__ import annotations

from django.db import models


class Notification(models.Model):
    """One NotificationRequestItem Adyen signed and sent."""

    psp_reference = models.CharField(max_length=64)
    original_reference = models.CharField(max_length=64, blank=True)
    merchant_account = models.CharField(max_length=100)
    merchant_reference = models.CharField(max_length=100, db_index=True)
    event_code = models.CharField(max_length=50)
    success = models.BooleanField()
    amount = models.BigIntegerField(null=True)
    currency = models.CharField(max_length=3, blank=True)
    reason = models.CharField(max_length=255, blank=True)
    event_date = models.CharField(max_length=40, blank=True)
    received_at = models.DateTimeField(auto_now_add=True)
    #: What it did when it came (settle_from_provider's word, "unmatched", ...).
    outcome = models.CharField(max_length=40, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["psp_reference", "event_code", "success"], name="adyen_notification_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.event_code} {self.psp_reference} success={self.success}"
