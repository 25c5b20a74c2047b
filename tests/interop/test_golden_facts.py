"""``kvq-codebooks golden``'s facts.json against the official facts of each method.

The rules, settings and arithmetic kvq_ref's facts state must be the official ones (so an
implementation tested against our golden files is held to the official behaviour), except the
rules listed in ``amended``, each with its reason: there ours are more precise and must still
start with the official statement.
"""

from __future__ import annotations

import json
import re

import pytest

from kvq_ref.golden import METHODS, facts

from .golden_format import DATA


@pytest.mark.parametrize("method", METHODS)
def test_facts_state_the_official_rules(method):
    path = DATA / method / "facts.json"  # bundled: every method's official facts ship with the tests
    official, ours = json.loads(path.read_text()), facts(method)
    assert ours["settings"] == official["settings"] and ours["arithmetic"] == official["arithmetic"]
    assert ours["source"]["reproduces"]["commit"] == official["source"]["commit"]
    amended = {int(re.match(r"rules\[(\d+)\]: ", note).group(1)) for note in ours["amended"]}
    assert len(ours["rules"]) == len(official["rules"])
    for i, (a, b) in enumerate(zip(ours["rules"], official["rules"])):
        if i in amended:
            first = b.split(";")[0]
            assert a.startswith(first) and a != b, f"rules[{i}] is amended but does not refine the official rule"
        else:
            assert a == b, f"rules[{i}] differs from the official facts"
