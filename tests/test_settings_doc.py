"""docs/settings.md documents every PAYMENTS key payments/conf.py accepts, and no other."""

from __future__ import annotations

import re
from pathlib import Path

from payments.conf import KNOWN_KEYS

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_every_key_has_its_section__and_every_section_names_a_key():
    headings = re.findall(r"^### (.+)$", DOC.read_text(), flags=re.M)
    named = {key for heading in headings for key in re.findall(r"`([A-Z_]+)`", heading)}
    assert named == set(KNOWN_KEYS)
