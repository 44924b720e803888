"""The ``ivm_consistent`` audit: the MV against a full recompute of its SQL at
the exact source versions its watermark records, compared as bags.

Floating columns (FLOAT/DOUBLE) compare within a relative tolerance: an
incrementally maintained SUM of doubles adds in a different order than a
recompute, so the last bits may differ.
"""

from __future__ import annotations

from typing import Optional

from sqlglot import exp

from dbt_ivm.apply import pinned_query
from dbt_ivm.names import PREFIX
from dbt_ivm.sqltree import (alias, aliased, and_, call, col, cte, named, or_, paren, render, select, string,
                             table, union_all)

TOLERANCE = 1e-9
RN = f"{PREFIX}rn"
SIDE = "ivm_side"
MISSING, EXTRA = "missing_from_mv", "extra_in_mv"


def consistency_sql(watermark, relation: str, tolerance: float = TOLERANCE, columns: Optional[dict] = None) -> str:
    """Rows present in one side and not the other, each tagged with ``ivm_side``.

    >>> from dbt_ivm.refresh import Watermark
    >>> wm = Watermark("s", "bag", "select a from db.t", {"a": "int"},
    ...                [{"name": "db.t", "kind": "delta", "physical": "db.t",
    ...                  "multiplicity": None, "columns": [["a", "int"]], "version": 3}])
    >>> print(consistency_sql(wm, "db.mv").replace(" UNION ALL ", chr(10) + "UNION ALL "))
    WITH `__ivm_expected` AS (SELECT a FROM db.t VERSION AS OF 3), `__ivm_actual` AS (SELECT `a` FROM `db`.`mv`) SELECT 'missing_from_mv' AS `ivm_side`, * FROM (SELECT * FROM `__ivm_expected` EXCEPT ALL SELECT * FROM `__ivm_actual`)
    UNION ALL SELECT 'extra_in_mv' AS `ivm_side`, * FROM (SELECT * FROM `__ivm_actual` EXCEPT ALL SELECT * FROM `__ivm_expected`)
    """
    # Where the view is a projection of the state's definition (Watermark.view_sql),
    # the model's SQL now is what the view must equal; ``columns``: the view's.
    expected = pinned_query(watermark.view_sql or watermark.sql, watermark.source_objects(), watermark.versions())
    types = dict(columns) if watermark.view_sql and columns else dict(watermark.columns)
    columns = list(types)
    # CTE names of our own (reserved prefix): the model's SQL may name its CTEs anything
    exp_, act, pairs_ = f"{PREFIX}expected", f"{PREFIX}actual", f"{PREFIX}pairs"
    ctes = [(exp_, expected), (act, select(*(col(c) for c in columns)).from_(table(relation)))]
    floats = [c for c, t in types.items() if t.lower() in ("float", "double")]
    if not floats:
        def missing(tag: str, a: str, b: str) -> exp.Select:
            rows = exp.Except(this=select(exp.Star()).from_(named(a)), expression=select(exp.Star()).from_(named(b)),
                              distinct=False)
            return select(alias(string(tag), SIDE), exp.Star()).from_(exp.Subquery(this=rows))

        return render(cte(union_all(missing(MISSING, exp_, act), missing(EXTRA, act, exp_)), ctes))
    exact = [c for c in columns if c not in floats]

    def numbered(side: str) -> exp.Select:
        rank = exp.Window(this=call("row_number"), partition_by=[col(c) for c in exact] or None,
                          order=exp.Order(expressions=[exp.Ordered(this=col(c)) for c in floats]))
        return select(exp.Star(), alias(rank, RN)).from_(named(side))

    def same(c: str) -> exp.Expression:
        return exp.NullSafeEQ(this=col(c, "e"), expression=col(c, "a"))

    def close(c: str) -> exp.Expression:
        e, a = col(c, "e"), col(c, "a")
        within = exp.LTE(this=exp.Abs(this=exp.Sub(this=e, expression=a)), expression=exp.Mul(
            this=exp.Literal.number(repr(float(tolerance))),
            expression=exp.Greatest(this=exp.Abs(this=e.copy()), expressions=[exp.Abs(this=a.copy())])))
        return paren(or_([same(c), within]))

    on = and_([same(c) for c in exact] + [exp.EQ(this=col(RN, "e"), expression=col(RN, "a"))])
    pairs = select(alias(col(RN, "e"), "e_rn"), alias(col(RN, "a"), "a_rn"),
                   *(alias(col(c, p), f"{p}_{c}") for c in columns for p in ("e", "a")),
                   alias(paren(and_(close(c) for c in floats)), "same"))
    pairs = pairs.from_(aliased(named(f"{exp_}_n"), "e"))
    pairs = pairs.join(aliased(named(f"{act}_n"), "a"), on=on, join_type="full outer")

    def side(tag: str, p: str) -> exp.Select:
        unmatched = or_([exp.Is(this=col("e_rn"), expression=exp.Null()),
                         exp.Is(this=col("a_rn"), expression=exp.Null()), exp.Not(this=col("same"))])
        return (select(alias(string(tag), SIDE), *(alias(col(f"{p}_{c}"), c) for c in columns))
                .from_(named(pairs_))
                .where(exp.and_(exp.Not(this=exp.Is(this=col(f"{p}_rn"), expression=exp.Null())), paren(unmatched))))

    ctes += [(f"{exp_}_n", numbered(exp_)), (f"{act}_n", numbered(act)), (pairs_, pairs)]
    return render(cte(union_all(side(MISSING, "e"), side(EXTRA, "a")), ctes))

