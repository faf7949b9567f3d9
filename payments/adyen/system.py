"""Adyen's Checkout API as the fence must know it, declared once.

- Idempotency: the `Idempotency-Key` header, kept per company account "for a minimum
  period of 7 days after first submission" (docs.adyen.com/development-resources/
  api-idempotency); a same-key request replays the first answer, one while the first
  is in flight is refused 409/422 `704` with `transient-error: true`.
- Reads: none. The Checkout API has no endpoint that looks a payment up by reference
  or by pspReference (its OpenAPI specification, CheckoutService-v72, has no GET of a
  payment): a lost answer is settled by a same-key replay while the key is kept, by the
  signed notification, or by a person with a report.
- References: a pspReference is Adyen's 16-character reference, letters and digits.
"""

from __future__ import annotations

import re

from payments.fence import ExternalSystem, declare_system

#: The system's name: its entry in PAYMENTS["SYSTEMS"] and ApiClient.payment_system.
NAME = "adyen"
#: A pspReference: 16 upper-case letters and digits.
PSP_REFERENCE = re.compile(r"[A-Z0-9]{16}")
#: Adyen's documented minimum key retention (seven days).
KEY_RETENTION = 7 * 24 * 3600

ADYEN = declare_system(
    ExternalSystem(
        name=NAME,
        label="Adyen",
        key_retention=KEY_RETENTION,
        key_scope="company account",
        # The documentation describes no refusal of a reused key with another body: the
        # first answer is replayed. The fence never sends one (a claim stores its request).
        compares_parameters=False,
        reads=(),
        moves_money=True,
        reference_patterns=(PSP_REFERENCE.pattern,),
        object_noun="payment",
    )
)
