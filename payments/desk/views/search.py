"""Search by a system's reference that no step recorded: ask the system, follow its metadata.

A charge whose answer was lost is on no step (the reference never came
back), yet it is the one an operator pastes from the provider's dashboard.
When the list finds nothing for a term shaped like a declared system's
reference (payments.engine.systems), that system is asked for the object
(its `describe`: a retrieve by id, never a search) and the operation its
metadata names (`operation_id`, `operation_key`, else the order) is shown,
with a note saying where the lead came from.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as NoAnswerYet
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models import Q

from payments.engine.systems import Described, NotAtSystem, reference_system

logger = logging.getLogger("payments.admin")

#: How long a search waits for the system's answer: an operator is looking at the page,
#: and in an incident a system that accepts the connection and never answers would hold
#: it for the client's whole read timeout (10 s by default), once per search.
SEARCH_WAIT_SECONDS = 3.0
#: The retrieves of searches in flight in this process, at most this many at once: one
#: past its wait ends in the background at the client's timeout, never holding a page or
#: a request thread. A search that finds them all busy asks nothing and says so at once:
#: during an outage retrieves never queue up behind the hung ones (nor hold a server
#: process that is shutting down).
LOOKUPS_AT_ONCE = 4
_LOOKUPS = ThreadPoolExecutor(max_workers=LOOKUPS_AT_ONCE, thread_name_prefix="desk-search")
_FREE = threading.BoundedSemaphore(LOOKUPS_AT_ONCE)


def _describe_in_background(describe: Callable[[str], Described | None], term: str) -> Any:
    """Run `describe` on a lookup thread; close any database connection it opened there
    (a system's `describe` should open none: payments.engine.systems), free its place."""
    try:
        return describe(term)
    finally:
        connections.close_all()
        _FREE.release()


@dataclass(frozen=True)
class ProviderLead:
    """What the provider's object says of where it came from."""

    reference: str
    query: Q | None  # the operations its metadata names; None: it names none
    note: str


def lead_from_provider(term: str) -> ProviderLead | None:
    """Retrieve `term` at the system whose reference it looks like and name the operations
    its metadata points to.

    None when the term is no declared system's reference, or its system offers
    no retrieve. The system being down is said in the note, not raised: the list
    still shows (nothing).
    """
    system = reference_system(term)
    if system is None or system.describe is None:
        return None
    if not _FREE.acquire(blocking=False):
        logger.warning("search: %s not asked for %s: lookups busy", system.label, term)
        return ProviderLead(
            term,
            None,
            f"No step has {term}; {system.label} was not asked: {LOOKUPS_AT_ONCE} earlier "
            "searches still wait for its answers (slow or down). Search again later, or read "
            "the object's metadata on its dashboard.",
        )
    try:
        lookup = _LOOKUPS.submit(_describe_in_background, system.describe, term)
    except RuntimeError as exc:  # the process is shutting down its threads
        _FREE.release()
        return _not_asked(term, system.label, exc)
    try:
        found = lookup.result(timeout=SEARCH_WAIT_SECONDS)
    except NoAnswerYet as exc:
        if lookup.done():  # a timeout of describe's own, raised in it: not asked, as below
            return _not_asked(term, system.label, exc)
        logger.warning("search: %s did not answer for %s in time", system.label, term)
        return ProviderLead(
            term,
            None,
            f"No step has {term}; {system.label} did not answer within "
            f"{SEARCH_WAIT_SECONDS:g} s (slow or down). Search again later"
            ", or read the object's metadata on its dashboard.",
        )
    except NotAtSystem:
        return ProviderLead(term, None, f"No step has {term}, and {system.label} does not know it.")
    except Exception as exc:  # down, refused, timed out: said in the note
        return _not_asked(term, system.label, exc)
    if found is None:
        return None
    return _lead(term, dict(found.metadata), found.status)


def _not_asked(term: str, label: str, exc: BaseException) -> ProviderLead:
    logger.warning("search: could not retrieve %s: %s", term, type(exc).__name__)
    return ProviderLead(
        term, None, f"No step has {term}; {label} could not be asked ({type(exc).__name__})."
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
