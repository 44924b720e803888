"""CI's scenario sample (DBT_IVM_CASES=cover): every feature tag of the cases is
carried by a case in it, and it costs less than the whole suite."""

from __future__ import annotations

import yaml

from tests.integration.test_scenarios import CASES_DIR, case_cost, feature_cover


def _cases() -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted(CASES_DIR.glob("*.yml"))]


def test_the_cover_carries_every_feature_for_less():
    cases = _cases()
    cover = feature_cover(cases)
    every = {f for c in cases for f in c.get("features", [])}
    assert {f for c in cover for f in c.get("features", [])} == every
    assert sum(map(case_cost, cover)) < sum(map(case_cost, cases))
    assert len({c["id"] for c in cover}) == len(cover)


def test_a_feature_only_one_case_has_brings_that_case():
    cases = [
        {"id": "A", "features": ["join", "insert"], "models": [{}], "steps": [[]]},
        {"id": "B", "features": ["join"], "models": [{}], "steps": [[]]},
        {"id": "C", "features": ["window"], "models": [{}, {}], "steps": [[], [], []]},
    ]
    assert [c["id"] for c in feature_cover(cases)] == ["A", "C"]
