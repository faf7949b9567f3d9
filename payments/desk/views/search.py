"""Search by a provider reference that no step recorded: ask the provider, follow its metadata.

A charge whose answer was lost is on no step (the reference never came
back), yet it is the one an operator pastes from the provider's dashboard.
When the list finds nothing for a term shaped like a provider id, the
provider is asked for that object (retrieve by id, never its search) and
the operation its metadata names (`operation_id`, `operation_key`, else the
order) is shown, with a note saying where the lead came from.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from django.db.models import Q

from payments.provider.client import ProviderClient
from payments.provider.errors import ProviderError, ResourceMissing

logger = logging.getLogger("payments.admin")

#: The provider ids worth a retrieve: payment intents and refunds (Stripe's shapes).
PROVIDER_ID = re.compile(r"^(pi|re)_[A-Za-z0-9]{1,64}$")


@dataclass(frozen=True)
class ProviderLead:
    """What the provider's object says of where it came from."""

    reference: str
    query: Q | None  # the operations its metadata names; None: it names none
    note: str


def lead_from_provider(term: str) -> ProviderLead | None:
    """Retrieve `term` at the provider and name the operations its metadata points to.

    None when the term is no provider id. The provider being down is said in
    the note, not raised: the list still shows (nothing).
    """
    if not PROVIDER_ID.match(term):
        return None
    try:
        with ProviderClient.from_settings() as client:
            found: Any = (
                client.retrieve_refund(term)
                if term.startswith("re_")
                else client.retrieve_payment_intent(term)
            )
    except ResourceMissing:
        return ProviderLead(term, None, f"No step has {term}, and the provider does not know it.")
    except ProviderError as exc:
        logger.warning("search: could not retrieve %s: %s", term, type(exc).__name__)
        return ProviderLead(
            term,
            None,
            f"No step has {term}; the provider could not be asked ({type(exc).__name__}).",
        )
    return _lead(
        term, dict(getattr(found, "metadata", {}) or {}), str(getattr(found, "status", ""))
    )


def _lead(term: str, metadata: dict[str, str], status: str) -> ProviderLead:
    op_id, key = metadata.get("operation_id", ""), metadata.get("operation_key", "")
    order = metadata.get("order_id", "")
    query = Q()
    named = []
    if op_id.isdigit():
        query |= Q(pk=int(op_id))
        named.append(f"operation id {op_id}")
    if key:
        query |= Q(key=key)
        named.append(f"operation {key}")
    if order.isdigit():
        query |= Q(entity_type="order", entity_id=order)
        named.append(f"order {order}")
    if not named:
        return ProviderLead(term, None, f"No step has {term}, and its metadata names nothing.")
    step = f" (step {metadata['step']})" if metadata.get("step") else ""
    return ProviderLead(
        term,
        query,
        f"No step has {term}: the provider shows it {status or 'with no status'}; its metadata "
        f"names {', '.join(named)}{step}. Shown below: the operations it names.",
    )
