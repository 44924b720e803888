"""How large a refresh's statement grows once Spark expands it, and the
bound past which the incremental path is not taken.

The shared pieces of a delta (delta.materialized: an input's change, the
touched keys, the inputs' rows for them) are temporary views, and a view is
inlined into every statement that reads it before Spark's analyzer runs: a
piece read twice is analyzed twice, and so is everything under it. Nested
affected-key recomputes over a CTE read several times make that product
explode (measured: a generated model nesting five recomputes over a CTE
read three times expanded to ~76 000 relation reads and spent more than five
minutes in the analyzer before its first job; TPC-H q20, the largest of the
22, expands to ~1 300 and refreshes in seconds). Such a model is rebuilt,
with the reason ``PLAN_TOO_LARGE``, instead of hanging its refresh.

Pure: rendered trees in, a count out; no Spark.
"""

from __future__ import annotations

from sqlglot import exp

from dbt_ivm.delta import Window, delta, materialized
from dbt_ivm.errors import Reason, UnsupportedQuery
from dbt_ivm.plan import Plan

# Relation reads a refresh's statement may expand to (see the module).
MAX_EXPANDED_READS = 4000


def expanded_reads(plan: Plan) -> int:
    """The relation reads of the plan's change for a window where every
    source changed, each shared piece counted once per read of it (as Spark
    inlines it)."""
    window = materialized(Window(old={s.physical: 1 for s in plan.sources},
                                 new={s.physical: 2 for s in plan.sources}), "size")
    statement = delta(plan.input, window)
    if statement is None:
        return 0
    bodies = dict(window.pieces.items)
    sizes: dict = {}

    def size(query: exp.Expression) -> int:
        total = 0
        for table in query.find_all(exp.Table):
            name = table.name
            if name in bodies:
                if name not in sizes:
                    sizes[name] = size(bodies[name])
                total += sizes[name]
            else:
                total += 1
        return total

    return size(statement)


def check(plan: Plan) -> Plan:
    """``plan``, or UnsupportedQuery(PLAN_TOO_LARGE) past MAX_EXPANDED_READS."""
    reads = expanded_reads(plan)
    if reads > MAX_EXPANDED_READS:
        raise UnsupportedQuery([Reason(
            "PLAN_TOO_LARGE",
            f"the refresh's statement would expand to about {reads} relation reads (its affected-key "
            f"recomputes nest, and Spark inlines each shared piece at every read of it; at most "
            f"{MAX_EXPANDED_READS})",
            "the model is refreshed by full rebuilds; split it into upstream incremental_mv models "
            "(a CTE read several times is a good first model) to maintain each incrementally")])
    return plan
