"""The accounting API as the fence must know it (payments.engine.systems, through payments.fence).

Its contract (the fake of devtools/fake_provider/accounting keeps it): a key kept 24 hours,
the body compared under a key (`422 idempotency_key_reused`), `409` while the key's first
request is in flight, invoices listed by the `external_id` the fence sends (a consistent
read), no webhooks. It moves no money: the desk's money at stake and the audit leave it out.
"""

from __future__ import annotations

from payments.fence import ExternalSystem, Read, declare_system
from payments.invoices.names import ACCOUNTING

SYSTEM = declare_system(
    ExternalSystem(
        name=ACCOUNTING,
        label="the accounting system",
        key_retention=24 * 3600,
        compares_parameters=True,
        reads=(Read.LIST_BY_REFERENCE,),
        moves_money=False,
        reference_patterns=(r"inv_[A-Za-z0-9]+",),
        object_noun="invoice",
    )
)
