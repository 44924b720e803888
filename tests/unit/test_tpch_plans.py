"""The 22 TPC-H queries (tests/tpch/models) plan for the incremental path, and
each one's delta statement renders and parses back, for a change of every
source at once and for one of the two fact tables (pure: no Spark; the integration tier runs them on data)."""

import pytest
import sqlglot

from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.delta import Window, delta
from dbt_ivm.plan import build_plan
from tests.tpch.schema import COLUMNS, compiled, queries

CATALOG = Catalog({f"tpch.{t}": Source(f"tpch.{t}", tuple(c)) for t, c in COLUMNS.items()})
ALL = Window(old={f"tpch.{t}": 4 for t in COLUMNS}, new={f"tpch.{t}": 5 for t in COLUMNS})
# the usual batch: new orders with their lineitems
FACTS = Window(old={f"tpch.{t}": 4 if t in ("orders", "lineitem") else 9 for t in COLUMNS},
               new={f"tpch.{t}": 5 if t in ("orders", "lineitem") else 9 for t in COLUMNS})


@pytest.mark.parametrize("name", sorted(queries()))
def test_tpch_query_plans_incrementally(name):
    plan = build_plan(compiled(queries()[name], "tpch"), CATALOG)  # UnsupportedQuery would fail here
    for window in (ALL, FACTS):
        d = delta(plan.input, window)
        if d is None:  # reads neither orders nor lineitem
            assert window is FACTS and not {"orders", "lineitem"} & {s.name.split(".")[1] for s in plan.sources}
            continue
        text = d.sql("spark")
        sqlglot.parse_one(text, read="spark")
        if window is FACTS:  # two changed inputs: new snapshots and change feeds only
            assert "VERSION AS OF 4" not in text


def test_all_22_queries_are_here():
    assert sorted(queries()) == [f"q{i:02d}" for i in range(1, 23)]
