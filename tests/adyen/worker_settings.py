"""Settings of a worker process in the Adyen crash tests: the project's, plus Adyen's entry.

A worker process reads its PAYMENTS from the environment (project/settings.py), which
has no variable for an external system's entry: this module adds the fake's, from
ADYEN_URL. Used as DJANGO_SETTINGS_MODULE by tests/adyen/test_adyen_crash.py only.
"""

from __future__ import annotations

import os

from project.settings import *  # noqa: F403  (the project's settings, unchanged)
from project.settings import PAYMENTS
from tests.support.adyen import settings_entry

PAYMENTS = {
    **PAYMENTS,
    "SYSTEMS": {**PAYMENTS.get("SYSTEMS", {}), "adyen": settings_entry(os.environ["ADYEN_URL"])},
}
