"""The README says one thing about multi-group (hybrid) models: KV tiers and the P/D transfer
carry every KV cache group. A sentence saying they are refused or unsupported there (as the
GDN section once did) contradicts its own tier and P/D sections, and what the connectors
declare."""

from __future__ import annotations

import re
from pathlib import Path

from speckv.connectors.capability import EVERY_GROUP
from speckv.connectors.nixl.connector import NixlConnector

README = Path(__file__).resolve().parents[1] / "README.md"


def _sentences() -> list[str]:
    text = " ".join(README.read_text().replace("|", ". X").split())  # table cells apart
    return re.split(r"(?<=\.)\s(?=[A-Z])", text)


def test_no_sentence_refuses_tiers_or_pd_on_multi_group_models():
    wrong = [s for s in _sentences()
             if re.search(r"(not supported|refused|unsupported)", s, re.I)
             and re.search(r"multi-group|hybrid|one group only", s, re.I)
             and re.search(r"KV connectors|tiers|P/D transfer", s)
             and not re.search(r"\bdo run\b|carry every group", s)]
    assert not wrong, wrong


def test_the_pd_transfer_declares_every_group():
    support = NixlConnector.kv_group_support.fget(None)  # a constant of the class
    assert support == EVERY_GROUP and support.multiple_groups
